"""Waiting in a test's event loop for a condition a real process or server brings about."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, every_s: float = 0.01) -> None:
    """Until `check()` is true, looking every `every_s`; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)
