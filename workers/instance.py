"""A model instance: one backend on its own thread, fed by the worker loop, with room for one staged batch.

An instance runs batches on a single-thread executor. When the loop has the next batch ready while the
instance is still computing (a full one; any one where the compute leaves the host's CPU alone, see
batching/scheduler.py), it stages it here; the instance thread takes it the moment the current batch is
done, without a round trip through the event loop (which may be busy writing the previous batch's
replies). That gap was a quarter of the instance's time on bulk jobs. A staged batch can be taken back
(`unstage`) or replaced by a bigger one (`restage`) as long as the thread has not started it, so a
higher-priority request that arrives in the meantime still goes first, and one that can join does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from batching.plan import Batch
from fleet.model_spec import InstanceLimit
from workers.backends.base import Backend
from workers.execute import BatchOutcome
from workers.rate_limiter import RateLimiter


@dataclass(slots=True)
class Job:
    """One batch for one instance: `run` computes it on the instance thread."""

    version: int
    batch: Batch  # what the scheduler dispatched, returned to the driver with the outcome
    run: Callable[[], BatchOutcome]


Done = Callable[[Job, "BatchOutcome | BaseException", int], None]  # (job, outcome or error, started µs)
Refused = Callable[[Job], None]  # a staged job the thread would not start: back to the loop unstarted


@dataclass(frozen=True, slots=True)
class Callbacks:
    """How an instance's thread reports to the loop (each call is posted to the loop, in this order)."""

    done: Done
    idle: Callable[[Instance], None]
    refused: Refused
    # Whether this worker's custody of its messages was confirmed recently. A staged job is started only
    # then: after a stall (the process frozen past the claim timeout) another worker may own its
    # messages now, and the loop must look before anything more is started.
    custody_fresh: Callable[[], bool]


@dataclass(eq=False)
class Instance:
    name: str
    backend: Backend
    executor: ThreadPoolExecutor
    # Its rate_limiter and the worker's limiter (workers/rate_limiter.py); None: it executes at will.
    limit: InstanceLimit | None = None
    limiter: RateLimiter | None = None
    busy: bool = False  # a chain of batches is running on the thread (changed under _lock)
    running_since: float | None = None  # time.monotonic() the current batch started (the watchdog reads it)
    _staged: Job | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def staged(self) -> Job | None:
        return self._staged

    def start(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks) -> None:
        """Run `job` now (the instance must be idle), then whatever gets staged behind it."""
        with self._lock:
            assert not self.busy, f"{self.name} is already running a batch"
            self.busy = True
        self.executor.submit(self._chain, job, loop, callbacks)

    def stage(self, job: Job) -> bool:
        """Queue `job` behind the running batch; False if the instance is idle or already has one."""
        with self._lock:
            if not self.busy or self._staged is not None:
                return False
            self._staged = job
            return True

    def restage(self, old: Job, new: Job) -> bool:
        """Replace the staged `old` with `new` (the same batch grown); False if the thread took `old`."""
        with self._lock:
            if self._staged is not old:
                return False
            self._staged = new
            return True

    def unstage(self) -> Job | None:
        """Take back the staged job if the thread has not started it."""
        with self._lock:
            job, self._staged = self._staged, None
            return job

    def _chain(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks) -> None:
        current: Job | None = job
        while current is not None:
            held = None
            started_us = time.time_ns() // 1000
            result: BatchOutcome | BaseException
            try:
                waited_ns = -1
                if self.limiter is not None and self.limit is not None:
                    # Waiting for rate-limiter resources comes first: not running yet (for the watchdog).
                    waiting_since = time.perf_counter_ns()
                    held = self.limiter.acquire(self.limit)
                    waited_ns = time.perf_counter_ns() - waiting_since
                    started_us = time.time_ns() // 1000
                self.running_since = time.monotonic()
                result = current.run()
                if isinstance(result, BatchOutcome):
                    result.resource_wait_ns = waited_ns
            except Exception as exc:  # reported to the loop; the thread keeps serving
                result = exc
            finally:
                self.running_since = None
                if held is not None:
                    assert self.limiter is not None
                    self.limiter.release(held)
            loop.call_soon_threadsafe(callbacks.done, current, result, started_us)
            with self._lock:
                current, self._staged = self._staged, None
                if current is not None and not callbacks.custody_fresh():
                    loop.call_soon_threadsafe(callbacks.refused, current)
                    current = None
                if current is None:
                    self.busy = False
        loop.call_soon_threadsafe(callbacks.idle, self)

