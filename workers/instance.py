"""A model instance: one backend on its own thread, fed by the worker loop, with room for one staged batch.

An instance runs batches on a single-thread executor. When the loop has the next batch ready while the
instance is still computing (a full one; any one where the compute leaves the host's CPU alone, see
batching/scheduler.py), it stages it here; the instance thread takes it the moment the current batch is
done, without a round trip through the event loop (which may be busy writing the previous batch's
replies). That gap was a quarter of the instance's time on bulk jobs. A staged batch can be taken back
(`unstage`) or replaced by a bigger one (`restage`) as long as the thread has not started it, so a
higher-priority request that arrives in the meantime still goes first, and one that can join does.

A backend that computes in another process (a Python-backend stub) is driven by the event loop itself
while it can be (`Job.on_loop`, workers/execute.py's LoopRun): the loop writes the call and the stub's
reply wakes the loop, which reports the batch done and starts the staged one. The thread hand-offs that
saves (loop to thread, thread to loop) were a wake-up each, ~35 and ~140 µs of a C=1 request's time here
(bench/RESULTS.md, stop 41). What needs a thread (a restart, a BLS call on the way, a rate limiter's
wait) runs on the instance's thread as before.

An in-process CPU model's batch is computed by the loop itself where that holds the loop briefly
(`Job.inline`; workers/inline.py says when), which saves the two hand-offs.

A batch the thread computes is reported to the loop with its replies still to encode, where that is safe and
brief (`Job.compute`, workers/execute.py's `Computed`): the loop encodes them while the thread goes on to the
staged batch.

A batch handed to the thread gets the GIL at once: the loop waits until the thread has begun it
(`_to_thread`). The loop holds the GIL through its own work (uvloop writes to sockets without letting it
go) and lets go only when it waits for I/O; a thread that wants the GIL meanwhile gets it only after the
interpreter's switch interval (CPython's 5 ms; a worker's 0.5 ms, workers/gil.py). Under load the loop
always has the last batch's replies to write and the next requests to read, so a batch started on the
thread waited for the GIL: traced at `mlp` C=32 (bench/RESULTS.md, stop 45), 513 µs from formed to
compute start; 68-82 µs with the wait. The loop waits at most HANDOFF_WAIT_S for the thread to begin,
then for the GIL while the thread prepares the batch (decoding and stacking its inputs): until the
thread lets go in the forward, or the switch interval. So that wait comes on the loop's next turn
(`_hand_off`), after what the driver's step set going: the batch just finished has its replies released in
the same step, ahead of the next batch's Run (batching/scheduler.py), and their write's task sends them first
(unless its finish is ordered and waits for an earlier write: preserve_ordering, sequences). Handed over in
the step itself, the replies waited for the hand-off and the thread's preparation: traced at `mlp` Poisson
2,000/s (bench/RESULTS.md, stop 49), computed → reply written 330 µs (median) against 194 after. A call to a
stub (`Job.on_loop`) does not wait for the GIL but goes on the next turn too, after the replies: at `double`
C=32 that grew the batches from 5 requests to 7 and throughput 1.13x, where starting it at once did not
(stop 49).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from batching.plan import Batch
from fleet.model_spec import InstanceLimit
from workers.backends.base import Backend, LoopBackend
from workers.execute import BatchOutcome, Computed, LoopOutcome, LoopRun
from workers.inline import Costs
from workers.rate_limiter import RateLimiter

# The longest the loop waits for an instance's thread to begin a batch handed to it (see above): a thread
# still busy (finishing a batch's report) or a host that does not run it soon costs the loop no more.
HANDOFF_WAIT_S = 0.002


@dataclass(slots=True)
class Job:
    """One batch for one instance: `run` computes it (on the loop: `inline`; on the instance thread, `compute`
    where set)."""

    version: int
    batch: Batch  # what the scheduler dispatched, returned to the driver with the outcome
    run: Callable[[], BatchOutcome]
    # The same batch computed by the instance's thread up to its replies, which the loop encodes (`Computed`):
    # the thread goes on to the next batch meanwhile. None: the thread runs `run`.
    compute: Callable[[], Computed | BatchOutcome] | None = None
    on_loop: LoopRun | None = None  # the same batch run from the event loop, where the backend allows
    # Set where the event loop may call `run` itself (workers/inline.py): asked again when the loop gets to it.
    inline: Callable[[], bool] | None = None
    nbytes: int = -1  # its input bytes, where its cost is measured for `inline`
    bulk: bool = False  # it has a bulk-lane request
    on_the_loop: bool = False  # the loop computed it (`Instance._inline`): its cost is how long it held the loop


# (job, outcome or error, started µs); a `Computed` from the thread is completed by `done` on the loop.
Done = Callable[[Job, "BatchOutcome | Computed | BaseException", int], None]
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
    busy: bool = False  # a chain of batches is running, on the thread or from the loop (changed under _lock)
    running_since: float | None = None  # time.monotonic() the current batch started (the watchdog reads it)
    # The backend, if the event loop may drive its calls (and no rate limiter makes them wait).
    loop_backend: LoopBackend | None = field(init=False)
    # Whether the loop may compute a batch itself (workers/inline.py), and what its batches cost.
    inline_capable: bool = field(init=False)
    costs: Costs = field(default_factory=Costs)
    running_inline: bool = False  # the loop is computing a batch of this instance (its watchdog's thread reads it)
    _staged: Job | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        backend = self.backend
        self.loop_backend = backend if self.limiter is None and isinstance(backend, LoopBackend) else None
        self.inline_capable = self.limiter is None and backend.runs_inline

    @property
    def staged(self) -> Job | None:
        return self._staged

    def start(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks) -> None:
        """Run `job` (the instance must be idle), then whatever gets staged behind it: on the loop's next turn
        (see above), by `_begin` for a stub's call, by `_inline` or `_to_thread` otherwise."""
        with self._lock:
            assert not self.busy, f"{self.name} is already running a batch"
            self.busy = True
        if job.on_loop is not None:
            loop.call_soon(self._begin, job, loop, callbacks)
        else:
            self._begin(job, loop, callbacks)

    def _begin(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks) -> None:
        """On the loop: start `job` from the loop if it can go that way, else on the thread."""
        if job.on_loop is not None:
            started_us = time.time_ns() // 1000
            self.running_since = time.monotonic()
            if job.on_loop.begin(loop, functools.partial(self._computed, job, loop, callbacks, started_us)):
                return
            self.running_since = None
        elif job.inline is not None:  # after the loop's current step, as a thread's report would come
            loop.call_soon(self._inline, job, loop, callbacks)
            return
        self._to_thread(job, loop, callbacks)

    def _to_thread(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks,
                   rest: Callable[[], BatchOutcome] | None = None, rest_started_us: int = 0) -> None:
        """On the loop: run `job` (or finish it: `rest`) on the thread, handed over on the loop's next turn
        (see above)."""
        loop.call_soon(self._hand_off, job, loop, callbacks, rest, rest_started_us)

    def _hand_off(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks,
                  rest: Callable[[], BatchOutcome] | None = None, rest_started_us: int = 0) -> None:
        """On the loop: give `job` to the thread, which takes the GIL before the loop goes on (see above)."""
        began = threading.Event()
        try:
            self.executor.submit(self._chain, job, loop, callbacks, rest, rest_started_us, began)
        except RuntimeError as exc:
            # The executor is shut down. Not expected: instances close only once their model's loop has
            # ended, and it ends only once every batch is done. Reported as a failed batch all the same
            # (its messages are claimed and computed again), so the instance is never left busy.
            self._computed(job, loop, callbacks, time.time_ns() // 1000, exc)
            return
        began.wait(HANDOFF_WAIT_S)

    def _inline(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks) -> None:
        """On the loop: compute `job` here if that still holds (more may have come meanwhile), then report it
        and go on as after a call made from the loop."""
        assert job.inline is not None
        if not job.inline():
            self._hand_off(job, loop, callbacks)  # this is the loop's next turn already
            return
        self.running_inline = job.on_the_loop = True
        try:
            result, started_us = self._run(job)
            assert not isinstance(result, Computed)  # (only the thread leaves the replies to the loop)
        finally:
            self.running_inline = False
        self._computed(job, loop, callbacks, started_us, result)

    def _computed(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks, started_us: int,
                  outcome: LoopOutcome) -> None:
        """On the loop, once a batch started there has its reply: report it and start the staged one. An
        outcome still to be finished (a callable) is finished on the thread, which goes on from there."""
        if callable(outcome):
            self._to_thread(job, loop, callbacks, outcome, started_us)
            return
        self.running_since = None
        try:
            callbacks.done(job, outcome, started_us)
        finally:  # the staged batch starts (and the instance idles) whatever reporting this one did
            current = self._take_staged(callbacks, callbacks.refused)
            if current is not None:
                self._begin(current, loop, callbacks)
            else:
                callbacks.idle(self)

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

    def _chain(self, job: Job, loop: asyncio.AbstractEventLoop, callbacks: Callbacks,
               rest: Callable[[], BatchOutcome] | None = None, rest_started_us: int = 0,
               began: threading.Event | None = None) -> None:
        """On the thread: run `job` (or finish it: `rest`, from where the loop left it), then whatever gets
        staged behind it; a staged job the loop can run goes back to the loop. `began` is set first: the
        loop that handed `job` over waits for it."""
        if began is not None:
            began.set()
        current: Job | None = job
        result: BatchOutcome | Computed | BaseException
        while current is not None:
            if rest is not None:
                result, started_us = self._finish(rest), rest_started_us
                rest = None
            else:
                result, started_us = self._run(current, on_thread=True)
            loop.call_soon_threadsafe(callbacks.done, current, result, started_us)
            current = self._take_staged(callbacks, lambda job: loop.call_soon_threadsafe(callbacks.refused, job))
            if current is not None and current.on_loop is not None and current.on_loop.ready():
                loop.call_soon_threadsafe(self._begin, current, loop, callbacks)
                return
        loop.call_soon_threadsafe(callbacks.idle, self)

    def _take_staged(self, callbacks: Callbacks, refuse: Callable[[Job], object]) -> Job | None:
        """The staged job to run next, if custody is fresh (else it goes to `refuse`); with none, the
        instance is not busy any more."""
        with self._lock:
            current, self._staged = self._staged, None
            if current is not None and not callbacks.custody_fresh():
                refuse(current)
                current = None
            if current is None:
                self.busy = False
            return current

    def _run(self, job: Job, on_thread: bool = False) -> tuple[BatchOutcome | Computed | BaseException, int]:
        """`job` computed (on the thread: up to its replies, where it can be, `Job.compute`) or its error."""
        held = None
        started_us = time.time_ns() // 1000
        result: BatchOutcome | Computed | BaseException
        try:
            waited_ns = -1
            if self.limiter is not None and self.limit is not None:
                # Waiting for rate-limiter resources comes first: not running yet (for the watchdog).
                waiting_since = time.perf_counter_ns()
                held = self.limiter.acquire(self.limit)
                waited_ns = time.perf_counter_ns() - waiting_since
                started_us = time.time_ns() // 1000
            self.running_since = time.monotonic()
            if on_thread and job.compute is not None:
                result = job.compute()
            else:
                result = job.run()
            if isinstance(result, (BatchOutcome, Computed)):
                result.resource_wait_ns = waited_ns
        except Exception as exc:  # reported to the loop; the thread keeps serving
            result = exc
        finally:
            self.running_since = None
            if held is not None:
                assert self.limiter is not None
                self.limiter.release(held)
        return result, started_us

    def _finish(self, rest: Callable[[], BatchOutcome]) -> BatchOutcome | BaseException:
        try:
            return rest()
        except Exception as exc:  # reported to the loop; the thread keeps serving
            return exc
        finally:
            self.running_since = None
