"""Following the settings changed at run time (the logging and trace extensions) in every process.

A process subscribes to `Keys.settings_changed` and, on each message, re-reads the hash it names
(fleet/log_settings.py, fleet/trace_settings.py) and applies it. It also reads every hash each time it
(re)subscribes: at start, so a process started later picks up the settings in force, and after a lost
connection, so a change announced meanwhile is not missed (pub/sub keeps nothing for absent listeners).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import RedisError

from fleet.backoff import Backoff
from fleet.keys import Keys
from fleet.log_settings import CHANNEL_MESSAGE as LOGGING
from fleet.log_settings import read_log_settings
from fleet.logs import apply_log_settings, default_log_settings
from fleet.redis_clients import async_client
from fleet.settings import Settings

log = logging.getLogger(__name__)

OnChange = Callable[[str], Awaitable[None]]


async def follow_settings(url: str, keys: Keys, kinds: Sequence[str], on_change: OnChange) -> None:
    """Call `on_change(kind)` for each of `kinds` now and whenever one is announced; runs until
    cancelled, riding out Redis outages with backoff. `on_change` may raise a Redis error (it reads
    Redis): the subscription is then made anew, and everything read again."""
    backoff = Backoff()
    while True:
        _raise_if_cancelled()
        client = async_client(url)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(keys.settings_changed())
            for kind in kinds:  # subscribed first: a change made while reading is announced after it
                await on_change(kind)
            backoff.reset()
            async for message in pubsub.listen():
                _raise_if_cancelled()
                if message.get("type") != "message":
                    continue
                data = message.get("data")
                kind = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
                if kind in kinds:
                    await on_change(kind)
        except (RedisError, OSError) as exc:
            _raise_if_cancelled()
            log.warning("settings listener: %s", exc)
        finally:
            try:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                await client.aclose()
            except (RedisError, OSError):
                pass
        await asyncio.sleep(backoff.next_delay())


async def follow_log_settings(url: str, keys: Keys, settings: Settings) -> None:
    """A process that only logs (a worker): apply the logging extension's settings as they change."""
    client = async_client(url)
    defaults = default_log_settings(settings)

    async def apply(kind: str) -> None:
        apply_log_settings(await read_log_settings(client, keys, defaults))

    try:
        await follow_settings(url, keys, (LOGGING,), apply)
    finally:
        await client.aclose()


def _raise_if_cancelled() -> None:
    """redis-py can turn a cancellation that lands while it connects into a connection error (or swallow
    it): the task's pending cancellation request still says what was meant."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_following(task: asyncio.Task[None], wait_s: float = 5.0) -> None:
    """Cancel a follow_settings task and wait for it, cancelling again until it ends, for at most `wait_s`
    (a stop never hangs on it: it holds nothing that must be released in order)."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while not task.done():
        if asyncio.get_running_loop().time() > deadline:
            log.warning("the settings listener did not stop within %.0f s; leaving it", wait_s)
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
