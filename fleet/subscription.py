"""One pub/sub channel followed for the life of a process: resubscribed after a lost connection with
backoff, stopped by cancellation (fleet/cancellation.py). Used by the cancellation listener
(workers/main.py) and the run-time settings listener (fleet/settings_watch.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from fleet.backoff import Backoff
from fleet.cancellation import raise_if_cancelled
from fleet.redis_clients import async_client

log = logging.getLogger(__name__)


async def follow_channel(url: str, channel: str, what: str, on_message: Callable[[object], Awaitable[None]],
                         on_subscribed: Callable[[], Awaitable[None]] | None = None) -> None:
    """Call `on_message(data)` for each message on `channel` and `on_subscribed()` each time the
    subscription is (re)made; runs until cancelled. A Redis error (also from either callback) ends the
    subscription, which is made anew after a backoff delay."""
    backoff = Backoff()
    while True:
        raise_if_cancelled()
        client = async_client(url)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(channel)
            if on_subscribed is not None:  # subscribed first: what changes meanwhile is announced after it
                await on_subscribed()
            backoff.reset()
            async for message in pubsub.listen():
                raise_if_cancelled()
                if message.get("type") == "message":
                    await on_message(message.get("data"))
        except (RedisError, OSError) as exc:
            raise_if_cancelled()
            log.warning("%s: %s", what, exc)
        finally:
            try:
                await pubsub.aclose()
                await client.aclose()
            except (RedisError, OSError):
                pass
        await asyncio.sleep(backoff.next_delay())
