"""Carries one model's scheduler actions to its instances (the driver of workers/loop.py): runs, stages,
grows and takes back batches on the instances' threads, and reports what the threads say (a batch done,
a staged one refused, idle) to the schedulers. What becomes of the requests a scheduler expires, drops or
releases is the loop's: it answers them, through the three callables it gives here.

The jobs dispatched and the outcomes computed are kept here, by (version, batch id), until released.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import replace
from operator import attrgetter

from batching.holding import Holding
from batching.plan import Batch, Drop, Expire, Grow, Release, Run, Stage, Unstage
from batching.policy import Pending
from batching.scheduler import Scheduler
from fleet.clock import Clock
from fleet.model_spec import ModelSpec
from fleet.redis_link import entry_order
from fleet.redis_time import RedisClock
from fleet.trace_points import BATCH_FORMED
from workers import gil
from workers.custody import Custody
from workers.execute import BatchOutcome, Computed, LoopRun, compute_batch, run_batch
from workers.held import HeldRequests, stamp
from workers.inline import LONE_BATCHES, batch_cost, may_inline
from workers.instance import Callbacks, Instance, Job
from workers.request_parts import GaveWay, run_in_parts
from workers.sequence_driver import Sequences

_LANE = attrgetter("lane")  # (a C getter: a batch's lanes looked at with no Python frame per request)

# What the loop does with requests the scheduler is done with: expired in the queue (items, now µs),
# dropped (items), released once computed (version, batch, outcome or error, started µs).
Expired = Callable[[tuple[Pending, ...], int], None]
Dropped = Callable[[tuple[Pending, ...]], None]
Released = Callable[[int, Batch, "BatchOutcome | BaseException", int], None]


class Dispatch:
    def __init__(self, spec: ModelSpec, instances: dict[int, list[Instance]], schedulers: dict[int, Scheduler],
                 sequences: Sequences, held: HeldRequests, custody: Custody, clock: Clock, redis_clock: RedisClock,
                 *, bulk_lane: int, lane_aware: bool, wake: Callable[[], None], expired: Expired,
                 dropped: Dropped, released: Released, neighbours_hold: Callable[[], bool] = lambda: False) -> None:
        self.spec = spec
        self.instances = instances
        self.schedulers = schedulers
        self._sequences = sequences
        self._held = held
        self._custody = custody
        self._clock = clock
        self._redis_clock = redis_clock
        self._bulk_lane = bulk_lane
        self._lane_aware = lane_aware  # a generation engine admits by (lane, arrival) among its requests
        self._wake = wake
        self._expired, self._dropped, self._released = expired, dropped, released
        self._jobs: dict[tuple[int, int], Job] = {}  # (version, batch id) -> dispatched job
        self._outcomes: dict[tuple[int, int], tuple[BatchOutcome | BaseException, int]] = {}
        # The longest batch the loop computes itself (workers/inline.py); 0: none. Set by the model's loop
        # once its watchdog guards such batches.
        self.inline_max_ns = 0
        # The model version has one instance (workers/inline.py's `sole`; the loop's top-up read asks too).
        self.sole = sum(len(insts) for insts in instances.values()) == 1
        self._neighbours_hold = neighbours_hold  # another model loop of the worker holds requests
        # Batches dispatched (run, staged or grown) in a row, this one included, that were one request each.
        self._lone_batches = 0
        self._runs_in_parts = spec.runs_in_parts
        self._gave_way = GaveWay()  # packed requests that gave way to online requests, their rest queued again

    @property
    def one_at_a_time(self) -> bool:
        """The model's last batches were lone requests (workers/inline.py's LONE_BATCHES): its clients
        send one at a time."""
        return self._lone_batches >= LONE_BATCHES

    def apply(self, version: int, scheduler: Scheduler, action: object, now: int) -> None:
        if isinstance(action, Run):
            self._start(version, action.instance, action.batch)
        elif isinstance(action, Stage):
            job = self._job(version, action.instance, action.batch)
            if not self.instances[version][action.instance].stage(job):
                self._jobs.pop((version, action.batch.id), None)
                scheduler.stage_refused(action.instance, action.batch.id)
        elif isinstance(action, Grow):
            old = self._jobs.pop((version, action.batch.id))
            job = self._job(version, action.instance, action.into)
            replaced = self.instances[version][action.instance].restage(old, job)
            if not replaced:  # the thread took the staged batch meanwhile: it runs as it was
                self._jobs.pop((version, action.into.id))
                self._jobs[(version, action.batch.id)] = old
            scheduler.grown(action.instance, action.into.id, replaced)
        elif isinstance(action, Unstage):
            taken = self.instances[version][action.instance].unstage()
            if taken is not None:
                self._jobs.pop((version, action.batch.id), None)
            scheduler.unstaged(action.instance, action.batch.id, taken is not None)
        elif isinstance(action, Expire):
            self._forget_parts(action.items)
            self._expired(action.items, now)
        elif isinstance(action, Drop):
            self._forget_parts(action.items)
            self._dropped(action.items)
        elif isinstance(action, Release):
            for batch_id in action.batches:
                job = self._jobs.pop((version, batch_id))
                result, started_us = self._outcomes.pop((version, batch_id))
                if isinstance(result, BatchOutcome) and result.rest is not None:
                    continue  # it gave way: queued again for the rest of its rows (`_on_done`)
                if self._gave_way and len(job.batch.items) == 1:
                    started_us = self._gave_way.finished(self._held[job.batch.items[0].request_id], started_us)
                self._released(version, job.batch, result, started_us)

    def _forget_parts(self, items: tuple[Pending, ...]) -> None:
        """Expired or dropped: a request that gave way is answered (or left) as it was read."""
        if self._gave_way:
            for p in items:
                self._gave_way.finished(self._held[p.request_id], 0)

    def _job(self, version: int, index: int, batch: Batch) -> Job:
        envs, state_of = self._sequences.requests(version, [self._held[p.request_id].env for p in batch.items],
                                                  batch.items)
        if self._held.traced:
            stamp(envs, BATCH_FORMED, self._redis_clock.now_ns())
        instance = self.instances[version][index]
        self._lone_batches = self._lone_batches + 1 if len(batch.items) == 1 else 0
        lanes = [p.lane for p in batch.items] if self._lane_aware else None
        # A bulk job's packed request (larger than max_batch_size): its parts one after another, on the thread.
        # (The rest of one that gave way keeps its scheduler entry's rows, so it still runs alone and comes here.)
        parts = self._runs_in_parts and len(envs) == 1 and (batch.items[0].rows > self.spec.max_batch_size
                                                            or batch.items[0].request_id in self._gave_way)
        if parts:
            job = Job(version, batch, functools.partial(
                run_in_parts, self.spec, instance.backend, envs[0], lanes, functools.partial(_part_started, instance),
                functools.partial(_online_held, self._custody.holding),
                self._gave_way.done_before(batch.items[0].request_id)))
        else:
            job = Job(version, batch, functools.partial(run_batch, self.spec, instance.backend, envs, state_of, lanes),
                      functools.partial(compute_batch, self.spec, instance.backend, envs, state_of, lanes))
            if instance.loop_backend is not None:
                job.on_loop = LoopRun(self.spec, instance.loop_backend, envs, state_of, lanes)
        job.bulk = self._bulk_lane in map(_LANE, batch.items)
        if job.on_loop is None and not parts and self.inline_max_ns and instance.inline_capable:
            job.nbytes = sum(env.input_bytes for env in envs)  # its cost measured, by the thread or the loop
            # Run, or staged: the loop computes it where it starts it, if that still holds then. (The
            # partial holds no job: a job that held itself would wait for the cycle collector.)
            if self._may_inline(instance, job.nbytes, job.bulk):
                job.inline = functools.partial(self._may_inline, instance, job.nbytes, job.bulk)
        self._jobs[(version, batch.id)] = job
        gil.batch_started(job.bulk, self._clock.now_us())
        return job

    def _start(self, version: int, index: int, batch: Batch) -> None:
        instance = self.instances[version][index]
        callbacks = Callbacks(done=functools.partial(self._on_done, version, index),
                              idle=functools.partial(self._on_idle, version, index),
                              refused=functools.partial(self._on_refused, version, index),
                              custody_fresh=self._custody.fresh)
        instance.start(self._job(version, index, batch), asyncio.get_running_loop(), callbacks)

    def _may_inline(self, instance: Instance, nbytes: int, bulk: bool) -> bool:
        """Whether the loop computes a batch of `nbytes` on `instance` (asked again when it gets to it)."""
        others, queued = False, 0  # one instance: none other, and its queue is not asked
        if not self.sole:
            others = any(i.busy for insts in self.instances.values() for i in insts if i is not instance)
            # (A staged batch counts as queued: with other instances, the thread computes those.)
            queued = sum(s.queued() for s in self.schedulers.values())
        return may_inline(instance.costs.predict(nbytes), self.inline_max_ns, bulk=bulk,
                          neighbours_hold=self._neighbours_hold(), sole=self.sole, others_running=others,
                          lone_batches=self._lone_batches, queued=queued)

    def _on_done(self, version: int, index: int, job: Job, result: BatchOutcome | Computed | BaseException,
                 started_us: int) -> None:
        """On the loop, as soon as an instance has computed a batch (its replies encoded here if the thread
        left them: `Computed`)."""
        if isinstance(result, Computed):
            try:
                result = result.complete()
            except Exception as exc:  # a bug in the encoding's plumbing: reported as the thread's would be
                result = exc
        now = self._clock.now_us()
        self._custody.claim_timeout.observe((now - started_us) / 1000)
        batch: Batch = job.batch
        self._outcomes[(version, batch.id)] = (result, started_us)
        try:
            if isinstance(result, BatchOutcome) and result.rest is not None:
                # A packed request gave way to online requests between its parts: the rest of its rows is queued again
                # before the instance is free (by arrival among the bulk lane's requests), unless another worker has
                # claimed it meanwhile (then it is dropped, as one not started).
                (item,) = batch.items
                held = self._held[item.request_id]
                if held.lost:
                    self._gave_way.finished(held, 0)
                    self._dropped((item,))
                else:
                    self._gave_way.gave_way(held, result, started_us)
                    held.pending = replace(item, aging_from_us=now)  # (its wait for aging starts again: it just ran)
                    self.schedulers[version].arrive(held.pending, entry_order(held.message[1]), now)
            if job.nbytes >= 0 and isinstance(result, BatchOutcome) and all(r.ok for r in result.replies):
                # What a batch this large costs (a failed one says nothing: it may have failed early).
                wall_ns = result.compute_input_ns + result.compute_infer_ns + result.compute_output_ns
                self.instances[version][index].costs.measured(job.nbytes, batch_cost(wall_ns, result.cpu_ns,
                                                                                     job.on_the_loop))
        finally:  # the instance is free whatever happened above
            self.schedulers[version].done(index, batch.id, now, started_us)
            self._wake()

    def _on_refused(self, version: int, index: int, job: Job) -> None:
        """The thread would not start a staged batch (custody had gone stale): back to the queue."""
        self._jobs.pop((version, job.batch.id), None)
        self.schedulers[version].stage_refused(index, job.batch.id)
        self._wake()

    def _on_idle(self, version: int, index: int, instance: Instance) -> None:
        self.schedulers[version].idle(index)
        self._wake()


def _part_started(instance: Instance) -> None:
    """On the instance's thread, as a packed request's next part starts: the watchdog times each part as a batch
    (a request of K parts may run K times a batch's time)."""
    instance.running_since = time.monotonic()


def _online_held(holding: Holding) -> bool:
    """On the instance's thread, between a packed request's parts: whether the worker holds online requests of
    the model, queued or until their replies are written. Not only those queued: while online clients are
    answered, their next requests are about to come (both measured beside a job, bench/RESULTS.md, stop 66)."""
    return holding.online_rows() > 0
