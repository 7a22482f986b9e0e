"""Following the settings changed at run time (the logging and trace extensions) in every process.

A process subscribes to `Keys.settings_changed` and, on each message, re-reads the hash it names
(fleet/log_settings.py, fleet/trace_settings.py) and applies it. It also reads every hash each time it
(re)subscribes: at start, so a process started later picks up the settings in force, and after a lost
connection, so a change announced meanwhile is not missed (pub/sub keeps nothing for absent listeners).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from fleet.keys import Keys
from fleet.log_settings import CHANNEL_MESSAGE as LOGGING
from fleet.log_settings import read_log_settings
from fleet.logs import apply_log_settings, default_log_settings
from fleet.redis_clients import async_client
from fleet.settings import Settings
from fleet.subscription import follow_channel

OnChange = Callable[[str], Awaitable[None]]


async def follow_settings(url: str, keys: Keys, kinds: Sequence[str], on_change: OnChange) -> None:
    """Call `on_change(kind)` for each of `kinds` now and whenever one is announced; runs until
    cancelled, riding out Redis outages with backoff. `on_change` may raise a Redis error (it reads
    Redis): the subscription is then made anew, and everything read again."""

    async def read_all() -> None:
        for kind in kinds:
            await on_change(kind)

    async def announced(data: object) -> None:
        kind = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        if kind in kinds:
            await on_change(kind)

    await follow_channel(url, keys.settings_changed(), "settings listener", announced, read_all)


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
