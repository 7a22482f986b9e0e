"""Supervised long-lived tasks: a task that dies is logged and restarted with backoff, never silent.

Every long-lived task of a worker or gateway (readers, the scheduler's driver, keepalive, claims, the
statistics fold, the reply reader, the readiness refresher) runs under `Supervisor.run`. A task that
raises is logged with its traceback and started again after a capped, jittered delay; while it is down
`healthy` is False (a worker stops advertising the model). A task that keeps dying - `max_failures`
within `window_s` - is given up on: `on_give_up` is called (a worker exits non-zero, so its own
supervisor starts a fresh process). What never happens is a live process whose task has quietly stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fleet.backoff import Backoff
from fleet.cancellation import raise_if_cancelled

log = logging.getLogger(__name__)


@dataclass
class Supervisor:
    name: str
    on_give_up: Callable[[str, BaseException], None] | None = None
    max_failures: int = 5
    window_s: float = 60.0
    failures: list[float] = field(default_factory=list)  # monotonic times of recent failures
    down: set[str] = field(default_factory=set)  # tasks restarting after a failure

    @property
    def healthy(self) -> bool:
        return not self.down

    def start(self, task_name: str, factory: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        return asyncio.create_task(self.run(task_name, factory), name=f"{self.name}:{task_name}")

    async def run(self, task_name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Run `factory()` until it returns; restart it each time it raises (not on cancellation)."""
        backoff = Backoff(base_s=0.1, cap_s=5.0)
        while True:
            try:
                await factory()
                self.down.discard(task_name)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise_if_cancelled()  # a cancellation turned into an error is still a stop, not a failure
                now = time.monotonic()
                self.failures = [t for t in self.failures if now - t < self.window_s] + [now]
                self.down.add(task_name)
                if len(self.failures) >= self.max_failures:
                    log.critical("%s: %s failed %d times within %.0f s; giving up", self.name, task_name,
                                 len(self.failures), self.window_s, exc_info=exc)
                    if self.on_give_up is not None:
                        self.on_give_up(f"{self.name}:{task_name}", exc)
                    raise
                delay = backoff.next_delay()
                log.error("%s: %s failed; restarting it in %.2f s", self.name, task_name, delay, exc_info=exc)
                await asyncio.sleep(delay)
                self.down.discard(task_name)

    def mark_running(self, task_name: str) -> None:
        """A restarted task says it works again (before returning, which long-lived tasks never do)."""
        self.down.discard(task_name)
