"""The driver of one model on one worker: feeds the schedulers (batching.scheduler, one per version) events
from custody and the instances, carries out their actions, and supervises its own tasks. No policy of
its own: what to batch, stage, expire or release is the scheduler's; which messages are held, refreshed,
claimed and acknowledged is custody's.

Tasks (each under fleet.supervision: logged and restarted with backoff if it dies, the model
unadvertised meanwhile, the worker exits for its supervisor if one keeps dying): one reader per lane,
the driver, keepalive, claims, the watchdog. The driver itself never waits on Redis: replies are
written by custody in the background, so a Redis error can never stop scheduling.

Times: the envelope's times are in Redis's clock (fleet/redis_time.py); they are converted to this
process's clock once, on admission. A request's queue delay counts from when the gateway enqueued it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from redis.exceptions import RedisError

from batching.holding import Holding, MessageId
from batching.policy import BatchPolicy, Pending
from batching.scheduler import Batch, Drop, Expire, Release, Run, Scheduler, SchedulerConfig, Stage, Unstage
from batching.sequences import Admit, Refuse, SequenceGate, Verdict, no_correlation_id
from fleet.admission import bulk_lane, lane_count, lane_policy
from fleet.backoff import Backoff
from fleet.cancellation import cancel_and_wait, raise_if_cancelled
from fleet.clock import Clock
from fleet.envelope import ReplyEnvelope, RequestEnvelope, decode_request, encode_request
from fleet.errors import InvalidInput, RequestTimeout
from fleet.llm_spec import is_llm, llm_settings
from fleet.model_config import ModelSpec
from fleet.redis_time import RedisClock
from fleet.supervision import Supervisor
from fleet.trace_points import (
    BATCH_FORMED,
    COMPUTE_END,
    COMPUTE_INPUT_END,
    COMPUTE_OUTPUT_START,
    COMPUTE_START,
    WORKER_READ,
)
from workers import gil
from workers.consumer import StreamConsumer
from workers.custody import Answer, Custody, CustodyConfig, LiveWorkers
from workers.execute import BatchOutcome, run_batch
from workers.instance import Callbacks, Instance, Job
from workers.samples import batch_sample, rejected_samples
from workers.sequence_tensors import SequenceTensors
from workers.watchdog import HungHandler, Watchdog

log = logging.getLogger(__name__)

# Waiting out a queue delay precisely. uvloop's timers have millisecond resolution (a 0.1 ms timer fires
# at once, a 0.8 ms one after ~1.1 ms), and Triton's delays are µs. So a loop timer aimed a millisecond
# early for long waits, and below TIMER_RESOLUTION_S a helper thread's time.sleep, which wakes the loop
# ~150 µs late (measured here; THREAD_WAKE_S is taken off). Never a spin on the loop: besides burning a
# core the gateway needs, it keeps the GIL from an instance thread whose TorchScript forward wants it
# back (measured: mlp's batches computed ~13% slower, C=32 throughput 0.8x).
TIMER_RESOLUTION_S = 0.002
THREAD_WAKE_S = 0.00015


def policy_for(spec: ModelSpec, aging_us: int = 0) -> BatchPolicy:
    db = spec.dynamic_batching
    bulk = bulk_lane(spec)
    seq = spec.sequence
    if seq is not None:  # the sequence batcher's strategy batches each instance's sequences
        return BatchPolicy(max_batch_size=spec.max_batch_size, preferred_batch_sizes=seq.preferred_batch_sizes,
                           max_queue_delay_us=seq.max_queue_delay_us, dynamic=spec.max_batch_size > 0,
                           aging_us=aging_us, bulk_lane=bulk)
    if db is None or spec.max_batch_size == 0:
        return BatchPolicy(max_batch_size=spec.max_batch_size, dynamic=False, aging_us=aging_us, bulk_lane=bulk)
    return BatchPolicy(max_batch_size=spec.max_batch_size, preferred_batch_sizes=db.preferred_batch_sizes,
                       max_queue_delay_us=db.max_queue_delay_us, aging_us=aging_us, bulk_lane=bulk)


@dataclass(frozen=True, slots=True)
class LoopConfig:
    block_ms: int = 1000
    read_ahead_batches: int = 2
    aging_us: int = 0
    bulk_share: float = 1.0
    watchdog_s: float = 120.0
    custody: CustodyConfig = CustodyConfig()


@dataclass(slots=True)
class _Held:
    """A request this worker holds, as the driver knows it."""

    message: MessageId
    env: RequestEnvelope
    version: int
    pending: Pending


def _order(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


class ModelLoop:
    """One model's driver on this worker; `instances` maps each loaded version to its instances."""

    def __init__(self, spec: ModelSpec, instances: dict[int, list[Instance]], consumer: StreamConsumer,
                 clock: Clock, redis_clock: RedisClock, config: LoopConfig = LoopConfig(), *,
                 on_hung: HungHandler | None = None, on_health: Callable[[], None] | None = None,
                 on_give_up: Callable[[str, BaseException], None] | None = None,
                 live_workers: LiveWorkers | None = None, sequence_tensors: SequenceTensors | None = None) -> None:
        self.spec = spec
        self.instances = instances
        self.clock = clock
        self.redis_clock = redis_clock
        self.config = config
        self.bulk_lane = bulk_lane(spec)
        assert len(consumer.streams) == lane_count(spec), "consumer built for another lane count"
        policy = policy_for(spec, config.aging_us)
        preserve = spec.dynamic_batching is not None and spec.dynamic_batching.preserve_ordering
        seq = spec.sequence
        # A generation engine's slots (workers/backends/llm.py): never staged, and bulk requests hold at most
        # max_running of them, so online ones always find a slot and preempt bulk inside the engine.
        llm = llm_settings(spec) if is_llm(spec) else None
        # bulk_share's pauses would hold every bulk request for seconds after each generation: the engine's
        # lane preemption already puts online first.
        share = config.bulk_share if llm is None else 1.0
        self.schedulers = {v: Scheduler(SchedulerConfig(policy, len(insts), self.bulk_lane, share,
                                                        preserve_ordering=preserve, pinned=seq is not None,
                                                        stage=llm is None,
                                                        bulk_instances=llm.continuous.max_running if llm else 0))
                           for v, insts in instances.items()}
        # Sequence batching (batching/sequences.py): each version's live sequences, one request of each at a
        # time, pinned to the sequence's instance; and the control and state tensors its requests get.
        self._gates = {} if seq is None else {
            v: SequenceGate(spec.name, len(insts), seq.max_sequence_idle_us) for v, insts in instances.items()}
        self._sequence_tensors = sequence_tensors
        if seq is not None and sequence_tensors is None:
            self._sequence_tensors = SequenceTensors(seq, spec.max_batch_size > 0)
        n_instances = sum(len(i) for i in instances.values())
        per_batch = max(1, spec.max_batch_size) if policy.dynamic else 1
        self.holding = Holding(self.bulk_lane + 1, per_batch, per_batch * n_instances * config.read_ahead_batches)
        self.custody = Custody(consumer, self.holding, config.custody, admit=self.admit, lost=self._lost,
                               released=self._freed, verified=self.wake, live_workers=live_workers)
        self.watchdog = Watchdog(spec.name, [i for insts in instances.values() for i in insts], config.watchdog_s,
                                 on_hung=on_hung, on_health=on_health)
        self.supervisor = Supervisor(f"model '{spec.name}'", on_give_up=on_give_up)
        self._on_health = on_health or (lambda: None)
        self._preserve_ordering = preserve
        self._lane_aware = is_llm(spec)  # a generation engine admits by (lane, arrival) among its requests
        self._delay_lanes = frozenset(lane for lane in range(self.bulk_lane)
                                      if lane_policy(spec, lane).delay_on_timeout)
        self._held: dict[str, _Held] = {}  # by Pending.request_id
        self._jobs: dict[tuple[int, int], Job] = {}  # (version, batch id) -> dispatched job
        self._outcomes: dict[tuple[int, int], tuple[BatchOutcome | BaseException, int]] = {}
        self._lost_ids: set[str] = set()  # claimed by another worker: never acknowledged by this one
        # Held requests that are traced (the trace extension): while 0, tracing costs a batch one check.
        self._traced = 0
        self._wake = asyncio.Event()
        self._timer = ThreadPoolExecutor(1, thread_name_prefix=f"{spec.name}-timer")
        self._room = [asyncio.Event() for _ in range(self.bulk_lane + 1)]
        self._stopping = False
        self._retired: str | None = None  # retire(): answer what is read with this, UNAVAILABLE
        self._readers_done = False

    @property
    def consumer(self) -> StreamConsumer:
        return self.custody.consumer

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def healthy(self) -> bool:
        """Advertised as ready: its tasks run, its instances are not hung or down, it can read."""
        return self.supervisor.healthy and self.watchdog.healthy and self.custody.reading

    def queued(self) -> dict[int, int]:
        """Per version: requests waiting here for an instance (Triton's pending count)."""
        return {v: s.queued() for v, s in self.schedulers.items()}

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        await self.consumer.join_when_reachable()
        sup = self.supervisor
        background = [sup.start("keepalive", self.custody.keep_alive),
                      sup.start("claims", self.custody.claim_abandoned), sup.start("watchdog", self.watchdog.run)]
        readers = [sup.start(f"reader-{lane}", functools.partial(self._read, lane))
                   for lane in range(self.bulk_lane + 1)]
        driver = sup.start("driver", self._drive)
        try:
            await asyncio.gather(*readers)  # they return once stopping
            self._readers_done = True
            self._wake.set()
            await driver  # returns once everything read is answered
            await self.custody.drained()
            await background[0]  # keepalive: ends once nothing is held
        finally:
            await cancel_and_wait([*background, *readers, driver], f"model '{self.spec.name}'")
            self._timer.shutdown(wait=False)

    def retire(self, why: str) -> None:
        """From now on, answer what is read with UNAVAILABLE `why` (the version is unloaded and no other
        unit reads its streams); what is already held is still computed."""
        self._retired = why

    def stop(self) -> None:
        """Stop reading; finish and answer what is held, then run() returns."""
        self._stopping = True
        self.custody.stop()
        self._freed()
        self._wake.set()

    def _freed(self) -> None:
        for event in self._room:
            event.set()

    # ------------------------------------------------------------------ reading and admission

    async def _read(self, lane: int) -> None:
        room_event = self._room[lane]
        backoff = Backoff()
        while not self._stopping:
            room = self.holding.room(lane)
            if room <= 0:
                room_event.clear()
                await room_event.wait()
                continue
            try:
                messages = await self.custody.read(lane, room, self.config.block_ms)
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                delay = backoff.next_delay()
                log.warning("%s: read failed (%s); retrying in %.2f s", self.spec.name, exc, delay)
                await asyncio.sleep(delay)
                if not self.custody.reading:
                    self._on_health()  # unadvertised now: say so at once, not at the next heartbeat
                continue
            if backoff.attempt:
                backoff.reset()
                self._on_health()  # reading again: advertised again
            for message, payload in messages:
                self.admit(message, payload)

    def admit(self, message: MessageId, payload: bytes | None) -> None:
        """Take a message into custody and its request into its version's scheduler."""
        if message in self.holding:
            # Delivered again while held: Redis lost the first delivery (a restart from an AOF a moment
            # old) and gave it out anew. It is already here; answering it acknowledges the new delivery.
            return
        try:
            if payload is None:
                raise InvalidInput("message without a payload")
            env = decode_request(payload)
        except InvalidInput as exc:
            log.error("%s: unreadable message %r: %s", self.spec.name, message, exc)
            self.custody.park_unreadable(message, exc.message, payload)
            return
        rows = env.batch_rows(self.spec.max_batch_size > 0)
        self.holding.hold(message, rows)
        scheduler = self.schedulers.get(env.version)
        if scheduler is None or self._retired is not None:
            reply = ReplyEnvelope(id=env.id, model_version=env.version, error_code="UNAVAILABLE",
                                  error_message=self._retired or
                                  f"model '{env.model}' version {env.version} is not loaded here")
            self.custody.finish([Answer(message, env.reply_to, reply)])
            return
        lane, entry_id = message
        to_local = self.redis_clock.to_local
        deadline = None if env.deadline_us is None else to_local(env.deadline_us)
        delay = lane in self._delay_lanes
        if env.expires_us is not None and (deadline is None or to_local(env.expires_us) < deadline):
            # The caller stops waiting before the queue policy would act: drop it then (never DELAY).
            deadline, delay = to_local(env.expires_us), False
        now = self.clock.now_us()
        pending = Pending(request_id=f"{lane}/{entry_id.decode()}", lane=lane,
                          enqueued_at_us=min(now, to_local(env.enqueued_at_us)), deadline_us=deadline, rows=rows,
                          shape_key=self.spec.batch_key(env.inputs), delay_on_timeout=delay, aging_from_us=now)
        self._held[pending.request_id] = _Held(message, env, env.version, pending)
        if env.trace is not None:
            env.trace[WORKER_READ] = self.redis_clock.now_ns()
            self._traced += 1
        gate = self._gates.get(env.version)
        if gate is not None:
            flags = env.sequence
            verdict: Verdict = Refuse(pending.request_id, no_correlation_id(env.model)) if flags is None else \
                gate.arrive(pending.request_id, flags.id, flags.start, flags.end, now)
            self._sequence_verdicts(env.version, [verdict], now)
        else:
            scheduler.arrive(pending, _order(entry_id), now)
        self._wake.set()

    def _sequence_verdicts(self, version: int, verdicts: list[Verdict], now: int) -> None:
        """Carry out the gate's verdicts: schedule on the sequence's instance, or answer the error."""
        for verdict in verdicts:
            held = self._held[verdict.request_id]
            if isinstance(verdict, Admit):
                held.pending = replace(held.pending, instance=verdict.instance)
                self.schedulers[version].arrive(held.pending, _order(held.message[1]), now)
            elif isinstance(verdict, Refuse):
                self._forget((held.pending,))
                err = InvalidInput(verdict.message)
                reply = ReplyEnvelope(id=held.env.id, model_version=held.env.version, error_code=err.code.value,
                                      error_message=err.message)
                self.custody.finish([Answer(held.message, held.env.reply_to, reply)], ordered=True)

    def _sequences_done(self, held: list[_Held], states: list[object] | None, now: int) -> None:
        """These requests are answered: their sequences keep the state they left and move on."""
        for i, h in enumerate(held):
            gate = self._gates.get(h.version)
            if gate is None:
                continue
            if states is not None and states[i] is not None:
                gate.set_state(h.pending.request_id, states[i])
            self._sequence_verdicts(h.version, gate.finished(h.pending.request_id, now), now)

    def cancel(self, request_ids: set[str]) -> None:
        """Callers went away (disconnected, or the gateway gave up): drop their requests if not started."""
        by_version: dict[int, set[str]] = {}
        for held in self._held.values():
            if held.env.id in request_ids:
                by_version.setdefault(held.version, set()).add(held.pending.request_id)
        for version, ids in by_version.items():
            self.schedulers[version].cancel(ids)
        if by_version:
            self._wake.set()

    def _lost(self, messages: list[MessageId]) -> None:
        """Another worker claimed these (this one stalled): drop those not started, never ack them."""
        ids = {f"{lane}/{entry_id.decode()}" for lane, entry_id in messages}
        by_version: dict[int, set[str]] = {}
        for rid in ids & self._held.keys():
            self._lost_ids.add(rid)
            by_version.setdefault(self._held[rid].version, set()).add(rid)
        for version, group in by_version.items():
            self.schedulers[version].cancel(group)
        self._wake.set()

    # ------------------------------------------------------------------ the driver

    async def _drive(self) -> None:
        while True:
            if not self.custody.fresh():
                # This process stalled (or Redis was away) past half the claim timeout: another worker may
                # own some of what it holds now. Start nothing until a keepalive round has said which.
                self.custody.verify_soon()
                if self._readers_done and not self._held and not any(s.busy() for s in self.schedulers.values()):
                    return
                await self._nap(None)
                continue
            now = self.clock.now_us()
            acted = False
            wake: int | None = None
            for version, scheduler in self.schedulers.items():
                plan = scheduler.step(now)
                if plan.actions:
                    acted = True
                    for action in plan.actions:
                        self._apply(version, scheduler, action, now)
                if plan.wake_at_us is not None:
                    wake = plan.wake_at_us if wake is None else min(wake, plan.wake_at_us)
            for gate in self._gates.values():
                for gone in gate.release_idle(now):
                    log.info("%s: sequence %s released after %d µs idle", self.spec.name, gone, gate.idle_us)
                idle_at = gate.next_idle_us()
                if idle_at is not None:
                    wake = idle_at if wake is None else min(wake, idle_at)
            if acted:
                continue
            if self._readers_done and not self._held and not any(s.busy() for s in self.schedulers.values()):
                return
            await self._nap(None if wake is None else (wake - now) / 1e6)

    async def _nap(self, timeout_s: float | None) -> None:
        """Until an event (arrival, finished batch, idle instance) or `timeout_s`."""
        self._wake.clear()
        if timeout_s is None:
            await self._wake.wait()
        elif timeout_s >= TIMER_RESOLUTION_S:
            # Aimed a millisecond early: the rest is timed precisely below. (wait_for, whose 3.11 race can
            # lose a cancellation: run() stops the driver with cancel_and_wait, which cancels again.)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s - TIMER_RESOLUTION_S / 2)
            except TimeoutError:
                pass
        elif timeout_s > 0:
            timer = asyncio.get_running_loop().run_in_executor(
                self._timer, time.sleep, max(0.0, timeout_s - THREAD_WAKE_S))
            timer.add_done_callback(lambda _: self._wake.set())  # a late one only costs an extra step
            await self._wake.wait()

    def _apply(self, version: int, scheduler: Scheduler, action: object, now: int) -> None:
        if isinstance(action, Run):
            self._start(version, action.instance, action.batch, now)
        elif isinstance(action, Stage):
            job = self._job(version, action.instance, action.batch)
            if not self.instances[version][action.instance].stage(job):
                self._jobs.pop((version, action.batch.id), None)
                scheduler.stage_refused(action.instance, action.batch.id)
        elif isinstance(action, Unstage):
            taken = self.instances[version][action.instance].unstage()
            if taken is not None:
                self._jobs.pop((version, action.batch.id), None)
            scheduler.unstaged(action.instance, action.batch.id, taken is not None)
        elif isinstance(action, Expire):
            self._expire(action.items, now)
        elif isinstance(action, Drop):
            self._drop(action.items)
        elif isinstance(action, Release):
            for batch_id in action.batches:
                self._release(version, batch_id)

    def _job(self, version: int, index: int, batch: Batch) -> Job:
        envs = [self._held[p.request_id].env for p in batch.items]
        state_of = None
        if self._sequence_tensors is not None:
            gate = self._gates[version]
            seq = self._sequence_tensors
            envs = [seq.request(env, gate.state(p.request_id)) for env, p in zip(envs, batch.items, strict=True)]
            state_of = seq.state_of if seq.capture else None
        if self._traced:
            formed = self.redis_clock.now_ns()
            for env in envs:
                if env.trace is not None:
                    env.trace[BATCH_FORMED] = formed
        backend = self.instances[version][index].backend
        lanes = [p.lane for p in batch.items] if self._lane_aware else None
        job = Job(version, batch, functools.partial(run_batch, self.spec, backend, envs, state_of, lanes))
        self._jobs[(version, batch.id)] = job
        if any(p.lane == self.bulk_lane for p in batch.items):
            gil.bulk_batch_started(self.clock.now_us())
        else:
            gil.maybe_restore(self.clock.now_us())
        return job

    def _start(self, version: int, index: int, batch: Batch, now: int) -> None:
        instance = self.instances[version][index]
        callbacks = Callbacks(done=functools.partial(self._on_done, version, index),
                              idle=functools.partial(self._on_idle, version, index),
                              refused=functools.partial(self._on_refused, version, index),
                              custody_fresh=self.custody.fresh)
        instance.start(self._job(version, index, batch), asyncio.get_running_loop(), callbacks)

    def _on_done(self, version: int, index: int, job: Job, result: BatchOutcome | BaseException,
                 started_us: int) -> None:
        """On the loop, as soon as an instance has computed a batch."""
        now = self.clock.now_us()
        self.custody.claim_timeout.observe((now - started_us) / 1000)
        batch: Batch = job.batch
        self._outcomes[(version, batch.id)] = (result, started_us)
        self.schedulers[version].done(index, batch.id, now, started_us)
        self._wake.set()

    def _on_refused(self, version: int, index: int, job: Job) -> None:
        """The thread would not start a staged batch (custody had gone stale): back to the queue."""
        self._jobs.pop((version, job.batch.id), None)
        self.schedulers[version].stage_refused(index, job.batch.id)
        self._wake.set()

    def _on_idle(self, version: int, index: int, instance: Instance) -> None:
        self.schedulers[version].idle(index)
        self._wake.set()

    # ------------------------------------------------------------------ answering

    def _forget(self, items: tuple[Pending, ...]) -> list[_Held]:
        held = [self._held.pop(p.request_id) for p in items]
        if self._traced:
            self._traced -= sum(1 for h in held if h.env.trace is not None)
        return held

    def _traced_replies(self, held: list[_Held], replies: list[ReplyEnvelope], outcome: BatchOutcome | None) -> None:
        """Traced requests' replies carry their timestamps back, with the batch's compute times (the
        instance measured them on perf_counter: converted here to Redis's clock, ns)."""
        stamps: dict[str, int] = {}
        if outcome is not None:
            start = outcome.started_ns + self.redis_clock.now_ns() - time.perf_counter_ns()
            stamps = {COMPUTE_START: start, COMPUTE_INPUT_END: start + outcome.compute_input_ns,
                      COMPUTE_OUTPUT_START: start + outcome.compute_input_ns + outcome.compute_infer_ns,
                      COMPUTE_END: start + outcome.compute_input_ns + outcome.compute_infer_ns
                      + outcome.compute_output_ns}
        for h, reply in zip(held, replies, strict=True):
            if h.env.trace is not None:
                reply.trace = h.env.trace | stamps

    def _expire(self, items: tuple[Pending, ...], now: int) -> None:
        traced = self._traced
        held = self._forget(items)
        err = RequestTimeout()
        replies = [ReplyEnvelope(id=h.env.id, model_version=h.env.version, error_code=err.code.value,
                                 error_message=err.message) for h in held]
        if traced:
            self._traced_replies(held, replies, None)
        answers = [Answer(h.message, h.env.reply_to, reply) for h, reply in zip(held, replies, strict=True)]
        self.custody.finish(answers, rejected_samples([h.env for h in held], self._envelope_times(held), now),
                            ordered=bool(self._gates))
        if self._gates:
            self._sequences_done(held, None, now)

    def _drop(self, items: tuple[Pending, ...]) -> None:
        held = self._forget(items)
        lost = [h.message for h in held if h.pending.request_id in self._lost_ids]
        self._lost_ids -= {h.pending.request_id for h in held}
        self.custody.release(lost)  # another worker owns these now: released, never acknowledged
        self.custody.finish([], [], [h.message for h in held if h.message not in lost])
        if self._gates:
            self._sequences_done(held, None, self.clock.now_us())

    def _release(self, version: int, batch_id: int) -> None:
        job = self._jobs.pop((version, batch_id))
        result, started_us = self._outcomes.pop((version, batch_id))
        batch: Batch = job.batch
        traced = self._traced
        held = self._forget(batch.items)
        self._lost_ids -= {h.pending.request_id for h in held}
        if isinstance(result, BaseException):
            # run_batch never raises; an error here is a bug in the instance plumbing. The messages stay
            # pending (released, not acknowledged) and are claimed and computed again.
            log.error("%s: batch of %d failed outside the model: %r", self.spec.name, len(held), result)
            self.custody.release([h.message for h in held])
            if self._gates:
                self._sequences_done(held, None, self.clock.now_us())
            return
        envs = [h.env for h in held]
        sample = batch_sample(version, self.spec.max_batch_size > 0, envs, result,
                              self._envelope_times(held), started_us, self.clock.now_us())
        if traced:
            self._traced_replies(held, result.replies, result)
        poisoned = set(result.poisoned)
        answers = [Answer(h.message, h.env.reply_to, reply,
                          park=reply.error_message if i in poisoned else None,
                          payload=encode_request(h.env) if i in poisoned else None)
                   for i, (h, reply) in enumerate(zip(held, result.replies, strict=True))]
        # A sequence's replies must reach its caller in the order its requests ran (a gRPC stream answers
        # in the order replies arrive): its next request may finish while this write is still in flight.
        self.custody.finish(answers, [sample], ordered=self._preserve_ordering or bool(self._gates))
        if self._gates:
            states = [None if not reply.ok else state
                      for reply, state in zip(result.replies, result.states or [None] * len(held), strict=True)]
            self._sequences_done(held, states, self.clock.now_us())

    def _envelope_times(self, held: list[_Held]) -> list[int]:
        """When each request was enqueued, on this process's clock."""
        return [self.redis_clock.to_local(h.env.enqueued_at_us) for h in held]

