"""Stopping long-lived tasks so that a stop never hangs.

Two things can make a cancelled task carry on: redis-py turns a cancellation that lands while it
connects or reads into a ConnectionError (or swallows it), and Python 3.11's `asyncio.wait_for` returns
the inner result instead of raising when the cancellation and the inner completion coincide. A retry
loop that catches RedisError then simply retries, and whoever awaits the task waits forever. So every
such loop calls `raise_if_cancelled()` in its error handler (the task's pending cancellation request
still says what was meant), and every stop goes through `cancel_and_wait`, which cancels again until
the task ends and gives up after a bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task has a cancellation request that something swallowed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], what: str, wait_s: float = 5.0) -> None:
    """Cancel `tasks` and wait for them to end, cancelling again every 0.1 s, for at most `wait_s`; a
    task still running then is left (logged), never waited on for ever."""
    pending = {t for t in tasks if not t.done()}
    deadline = asyncio.get_running_loop().time() + wait_s
    while pending:
        if asyncio.get_running_loop().time() > deadline:
            log.warning("%s: %d task(s) did not stop within %.0f s; leaving them", what, len(pending), wait_s)
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
