"""One pub/sub channel followed for the life of a process: resubscribed after a lost connection with
backoff, stopped by cancellation. Used by the cancellation listener (workers/main.py) and the run-time
settings listener (fleet/settings_watch.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from fleet.backoff import Backoff
from fleet.redis_clients import async_client

log = logging.getLogger(__name__)


def raise_if_cancelled() -> None:
    """redis-py can turn a cancellation that lands while it connects into a connection error (or swallow
    it): the task's pending cancellation request still says what was meant."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


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
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                await client.aclose()
            except (RedisError, OSError):
                pass
        await asyncio.sleep(backoff.next_delay())


async def stop_following(task: asyncio.Task[None], wait_s: float = 5.0) -> None:
    """Cancel a follow_channel task and wait for it, cancelling again until it ends, for at most `wait_s`
    (a stop never hangs on it: it holds nothing that must be released in order)."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while not task.done():
        if asyncio.get_running_loop().time() > deadline:
            log.warning("a channel listener did not stop within %.0f s; leaving it", wait_s)
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
