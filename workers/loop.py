"""The async driver of one model on one worker: read -> decide (batching.policy) -> execute -> finish.

The only place in the worker that waits. The policy is asked what to do whenever something changes (an
arrival, a freed instance, a timer); it answers Dispatch, Wait(until) or Reject, and this loop acts.
A batch runs on a free instance's own thread, so `instance_group.count` instances run concurrently.

One reader per lane feeds the queue, each blocked on its own stream. Read-ahead is bounded, and a
lower lane may never fill the room a higher one needs: each lane above has one more batch of room
than the lane below it (workers/holding.py), so a saturating bulk job (or a flood of low-priority requests)
delays a higher-priority request by at most the batches already executing. Every lower lane always
keeps one batch in the queue (the floor in `_room`) so that lane aging (batching.policy) can promote
it when higher-priority load saturates the model.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from batching.policy import BatchPolicy, Dispatch, Pending, Reject, Wait, decide
from fleet.admission import bulk_lane, lane_count, lane_policy
from fleet.backoff import Backoff
from fleet.claims import ClaimTimeout
from fleet.clock import Clock
from fleet.envelope import ReplyEnvelope, RequestEnvelope, decode_request, encode_request
from fleet.errors import InvalidInput, RequestTimeout, ServingError
from fleet.model_config import ModelSpec
from workers import gil
from workers.consumer import MessageId, StreamConsumer
from workers.execute import BatchOutcome, run_batch
from workers.holding import Holding
from workers.instance import Instance, Job
from workers.recovery import HungHandler, Recovery, RecoveryConfig
from workers.samples import batch_sample, rejected_samples

log = logging.getLogger(__name__)

# Online traffic counts as present for this long after an online request arrived: bulk batches are
# then neither staged behind a running batch nor allowed more than `bulk_share` of the instance.
ONLINE_QUIET_US = 200_000
STAGE_DEADLINE_MARGIN_US = 1_000_000


def policy_for(spec: ModelSpec, aging_us: int = 0) -> BatchPolicy:
    db = spec.dynamic_batching
    if db is None or spec.max_batch_size == 0:
        return BatchPolicy(max_batch_size=spec.max_batch_size, dynamic=False, aging_us=aging_us)
    return BatchPolicy(max_batch_size=spec.max_batch_size, preferred_batch_sizes=db.preferred_batch_sizes,
                       max_queue_delay_us=db.max_queue_delay_us, aging_us=aging_us)


@dataclass(slots=True)
class _Queued:
    message: MessageId
    env: RequestEnvelope
    pending: Pending
    seq: int  # admission order: restores the queue's order when a staged batch is taken back


@dataclass
class ModelLoop:
    """One model's loop on this worker; `instances` maps each loaded version to its instances."""

    spec: ModelSpec
    instances: dict[int, list[Instance]]
    consumer: StreamConsumer
    clock: Clock
    block_ms: int = 1000
    read_ahead_batches: int = 2
    recovery_config: RecoveryConfig = field(default_factory=RecoveryConfig)
    on_hung: HungHandler | None = None
    on_health: Callable[[], None] | None = None  # the model's health changed (heartbeat it now)
    aging_us: int = 0
    # The most of the instance's time bulk batches take while online requests are coming in (see
    # _on_done). Below 1 only on CPU devices, where bulk compute competes for the cores online needs.
    bulk_share: float = 1.0
    policy: BatchPolicy = field(init=False)
    _queued: dict[int, list[_Queued]] = field(init=False, default_factory=dict)
    _free: dict[int, list[Instance]] = field(init=False, default_factory=dict)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    # One per lane reader: a shared event could be cleared by one reader after it was set for another.
    _room_events: list[asyncio.Event] = field(init=False, default_factory=list)
    _stopping: bool = field(init=False, default=False)
    _seq: int = field(init=False, default=0)
    _online_seen_us: int = field(init=False, default=0)  # when a request of an online lane last arrived
    _bulk_after_us: int = field(init=False, default=0)  # while online is about, no bulk batch before this

    def __post_init__(self) -> None:
        self.policy = policy_for(self.spec, self.aging_us)
        self._queued = {v: [] for v in self.instances}
        self._free = {v: list(insts) for v, insts in self.instances.items()}
        self.bulk_lane = bulk_lane(self.spec)
        self._room_events = [asyncio.Event() for _ in range(self.bulk_lane + 1)]
        # Messages this worker holds (queued, staged or executing): a claim must not admit them twice.
        n_instances = sum(len(i) for i in self.instances.values())
        per_batch = max(1, self.spec.max_batch_size) if self.policy.dynamic else 1
        self.holding = Holding(self.bulk_lane + 1, per_batch, per_batch * n_instances * self.read_ahead_batches)
        assert len(self.consumer.streams) == lane_count(self.spec), "consumer built for another lane count"
        lane_policies = [lane_policy(self.spec, lane) for lane in range(self.bulk_lane)]
        self._delay_lanes = frozenset(lane for lane, lp in enumerate(lane_policies) if lp.delay_on_timeout)
        cfg = self.recovery_config
        self.claim_timeout = ClaimTimeout(floor_ms=cfg.claim_min_ms, fixed_ms=cfg.claim_idle_ms)
        self.recovery = Recovery(self, cfg, self.on_hung)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def healthy(self) -> bool:
        """Advertised as ready: no instance of it is hung or failed to restart."""
        return not self.recovery.hung and not self.recovery.down

    def health_changed(self) -> None:
        if self.on_health is not None:
            self.on_health()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        await self.consumer.join_when_reachable()
        schedulers = [asyncio.create_task(self._schedule(v)) for v in self.instances]
        schedulers += self.recovery.tasks()
        try:
            await asyncio.gather(*(self._read(lane) for lane in range(self.bulk_lane + 1)))
            # Stopping: nothing new is read; finish and answer what this worker holds.
            while self.holding.rows():
                self._wake.set()
                await asyncio.sleep(0.01)
        finally:
            for task in schedulers:
                task.cancel()
            await asyncio.gather(*schedulers, return_exceptions=True)

    def stop(self) -> None:
        self._stopping = True
        self._freed()
        self._wake.set()

    def _freed(self) -> None:
        for event in self._room_events:
            event.set()

    async def _read(self, lane: int) -> None:
        room_event = self._room_events[lane]
        backoff = Backoff()
        while not self._stopping:
            room = self.holding.room(lane)
            if room <= 0:
                room_event.clear()
                await room_event.wait()
                continue
            try:
                # Room is in rows; a message holds as many rows as the last one of this lane did.
                count = self.holding.messages_to_read(lane, room)
                messages = await self.consumer.read(lane, count, self.block_ms)
                backoff.reset()
            except (RedisError, OSError) as exc:
                delay = backoff.next_delay()
                log.warning("%s: read failed (%s); retrying in %.2f s", self.spec.name, exc, delay)
                await asyncio.sleep(delay)
                continue
            for message, payload in messages:
                await self.admit(message, payload)
            if messages:
                self._wake.set()

    async def admit(self, message: MessageId, payload: bytes | None) -> None:
        try:
            if payload is None:
                raise InvalidInput("message without a payload")
            env = decode_request(payload)
        except InvalidInput as exc:
            log.error("%s: unreadable message %r: %s", self.spec.name, message, exc)
            await self.consumer.dead_letter(message, exc.message, payload)
            return
        queue = self._queued.get(env.version)
        if queue is None:
            reply = ReplyEnvelope(id=env.id, model_version=env.version, error_code="NOT_FOUND",
                                  error_message=f"model '{env.model}' version {env.version} is not loaded here")
            await self.consumer.finish([(env.reply_to, reply)], [message], [])
            return
        rows = env.batch_rows(self.spec.max_batch_size > 0)
        key = tuple((t.name, t.shape[1:]) for t in env.inputs) if self.spec.needs_equal_shapes else \
            tuple(sorted(t.name for t in env.inputs))
        lane, entry_id = message
        deadline, delay = env.deadline_us, lane in self._delay_lanes
        if env.expires_us is not None and (deadline is None or env.expires_us < deadline):
            # The caller stops waiting before the queue policy would act: drop it then (never DELAY).
            deadline, delay = env.expires_us, False
        if lane < self.bulk_lane:
            self._online_seen_us = self.clock.now_us()
        self.holding.hold(message, rows)
        self._seq += 1
        queue.append(_Queued(message, env, seq=self._seq, pending=Pending(
            request_id=f"{lane}/{entry_id.decode()}", lane=lane, enqueued_at_us=env.enqueued_at_us,
            deadline_us=deadline, rows=rows, shape_key=key, delay_on_timeout=delay,
            aging_from_us=self.clock.now_us())))

    async def _schedule(self, version: int) -> None:
        queue = self._queued[version]
        free = self._free[version]
        instances = self.instances[version]
        loop = asyncio.get_running_loop()
        while True:
            self._unstage_if_outranked(version, queue)
            if not queue:
                await self._sleep(None)
                continue
            now = self.clock.now_us()
            stageable = None if free else next((i for i in instances if i.busy and i.staged is None), None)
            if not free and stageable is None:
                await self._sleep_busy(queue, now)
                continue
            decision = decide(self.policy, [q.pending for q in queue], now)
            if isinstance(decision, Reject):
                await self._reject(queue, decision)
            elif isinstance(decision, Dispatch):
                if now < self._bulk_after_us and self._online_active(now) and \
                        all(p.lane == self.bulk_lane for p in decision.items):
                    await self._sleep((self._bulk_after_us - now) / 1e6)
                    continue
                if not free and not self._stageable(decision):
                    await self._sleep_busy(queue, now)
                    continue
                chosen = {p.request_id for p in decision.items}
                batch = [q for q in queue if q.pending.request_id in chosen]
                target = free[-1] if free else stageable
                assert target is not None
                job = Job(version, batch, functools.partial(run_batch, self.spec, target.backend,
                                                            [q.env for q in batch]))
                if any(q.pending.lane == self.bulk_lane for q in batch):
                    gil.bulk_batch_started(now)
                else:
                    gil.maybe_restore(now)
                if free:
                    free.pop().start(job, loop, self._on_done, self._on_idle)
                elif not target.stage(job):
                    await asyncio.sleep(0)  # it went idle just now; its on_idle call is queued
                    continue
                queue[:] = [q for q in queue if q.pending.request_id not in chosen]
            elif isinstance(decision, Wait):
                await self._sleep((decision.until_us - now) / 1e6)

    def _stageable(self, decision: Dispatch) -> bool:
        """Whether a batch may wait behind a running one instead of in the queue: only if it is full
        (the largest preferred size, or 1 without batching) - a batch that could still grow is formed
        when an instance frees up, as Triton does - and none of it can time out before it runs (expiry
        is checked only while queued; a staged batch starts within one batch time)."""
        full = 1 if not self.policy.dynamic or self.policy.max_batch_size == 0 else \
            max(self.policy.preferred_batch_sizes, default=self.policy.max_batch_size)
        if any(p.lane == self.bulk_lane for p in decision.items) and self._online_active(self.clock.now_us()):
            # Online traffic is about: a bulk batch waits in the queue, where an online request that
            # arrives while the instance computes still goes first (a staged batch it could only
            # overtake if the loop got there before the instance thread).
            return False
        now_us = self.clock.now_us()
        return sum(p.rows for p in decision.items) >= full and all(
            p.deadline_us is None or p.delay_on_timeout or p.deadline_us - now_us > STAGE_DEADLINE_MARGIN_US
            for p in decision.items)

    def _unstage_if_outranked(self, version: int, queue: list[_Queued]) -> None:
        """A staged batch goes back to the queue when a request of a higher lane is waiting."""
        for instance in self.instances[version]:
            staged = instance.staged
            if staged is None or not queue:
                continue
            if min(q.pending.lane for q in queue) < max(q.pending.lane for q in staged.batch):
                job = instance.unstage()
                if job is not None:
                    queue.extend(job.batch)
                    queue.sort(key=lambda q: q.seq)

    async def _sleep_busy(self, queue: list[_Queued], now: int) -> None:
        # Nothing can run now, but a timed-out request is still answered at its deadline, not when an
        # instance frees up (REJECT never waits for compute).
        nearest = self._nearest_reject_deadline(queue)
        if nearest is not None and nearest <= now:
            decision = decide(self.policy, [q.pending for q in queue], now)
            if isinstance(decision, Reject):
                await self._reject(queue, decision)
                return
        await self._sleep(None if nearest is None else (nearest - now) / 1e6)

    def _nearest_reject_deadline(self, queue: list[_Queued]) -> int | None:
        deadlines = [q.pending.deadline_us for q in queue
                     if q.pending.deadline_us is not None and not q.pending.delay_on_timeout]
        return min(deadlines, default=None)

    async def _sleep(self, timeout_s: float | None) -> None:
        """Until something changes (arrival, freed instance) or `timeout_s` passes."""
        self._wake.clear()
        if timeout_s is None:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), max(0.0, timeout_s))
        except TimeoutError:
            pass

    async def _reject(self, queue: list[_Queued], decision: Reject) -> None:
        chosen = {p.request_id for p in decision.items}
        expired = [q for q in queue if q.pending.request_id in chosen]
        queue[:] = [q for q in queue if q.pending.request_id not in chosen]
        err: ServingError = RequestTimeout()
        replies = [(q.env.reply_to, ReplyEnvelope(id=q.env.id, model_version=q.env.version,
                                                  error_code=err.code.value, error_message=err.message))
                   for q in expired]
        now_us = self.clock.now_us()
        samples = rejected_samples([q.env for q in expired], now_us)
        try:
            await self.consumer.finish(replies, [q.message for q in expired], samples)
        finally:
            self.holding.release(q.message for q in expired)
            self._freed()

    def _online_active(self, now_us: int) -> bool:
        return now_us - self._online_seen_us < ONLINE_QUIET_US

    def _on_done(self, job: Job, result: BatchOutcome | BaseException, started_us: int) -> None:
        """On the loop, as soon as an instance has computed a batch: write its replies."""
        self.claim_timeout.observe((self.clock.now_us() - started_us) / 1000)
        if self.bulk_share < 1 and all(q.pending.lane == self.bulk_lane for q in job.batch):
            # While online requests come in, each bulk batch is followed by idle time in proportion, so
            # bulk uses at most `bulk_share` of the instance. On a CPU worker a bulk batch occupies a
            # core the online path (gateway, Redis, this loop) needs. Measured on 2 cores (bench/bulk.py,
            # mlp, online C=4 while a job saturates the lane): online p99 12.5 ms with no limit, 8-10 ms
            # at a share of 0.5, 6.6-7.0 ms at 0.35 (idle: 3.9-5 ms), bulk then at 0.2x direct.
            now_us = self.clock.now_us()
            self._bulk_after_us = now_us + int((now_us - started_us) * (1 - self.bulk_share) / self.bulk_share)
        self._wake.set()  # a staging slot may be free again
        asyncio.create_task(self._finish(job, result, started_us))

    def _on_idle(self, instance: Instance) -> None:
        for version, insts in self.instances.items():
            if instance in insts and not instance.busy and instance not in self._free[version]:
                self._free[version].append(instance)
        self._wake.set()

    async def _finish(self, job: Job, result: BatchOutcome | BaseException, started_us: int) -> None:
        batch = job.batch
        try:
            if isinstance(result, BaseException):
                raise result
            envs = [q.env for q in batch]
            sample = batch_sample(job.version, self.spec.max_batch_size > 0, envs, result, started_us,
                                  self.clock.now_us())
            poisoned = {batch[i].message for i in result.poisoned}
            replies = [(e.reply_to, r) for e, r in zip(envs, result.replies, strict=True)]
            await self.consumer.finish_retrying(replies, [q.message for q in batch if q.message not in poisoned],
                                                [sample])
            for i in result.poisoned:  # answered above; parked so `fleet dead-letters` can show and replay them
                await self.consumer.dead_letter(batch[i].message, result.replies[i].error_message,
                                                encode_request(batch[i].env))
        except Exception:
            # Redis stayed away: the messages stay pending and will be claimed and computed again.
            log.exception("%s: batch of %d could not be finished", self.spec.name, len(batch))
        finally:
            self.holding.release(q.message for q in batch)
            self._wake.set()
            self._freed()

    def cancel(self, request_ids: set[str]) -> list[MessageId]:
        """Drop queued requests whose callers went away (disconnected, or the gateway gave up): they are
        never computed. Returns their messages, for the caller to acknowledge."""
        dropped: list[MessageId] = []
        for version, instances in self.instances.items():
            for instance in instances:
                staged = instance.staged
                if staged is not None and any(q.env.id in request_ids for q in staged.batch):
                    job = instance.unstage()  # back to the queue, where it is dropped below
                    if job is not None:
                        self._queued[version].extend(job.batch)
                        self._queued[version].sort(key=lambda q: q.seq)
        for queue in self._queued.values():
            keep = [q for q in queue if q.env.id not in request_ids]
            if len(keep) != len(queue):
                dropped += [q.message for q in queue if q.env.id in request_ids]
                queue[:] = keep
        if dropped:
            self.holding.release(dropped)
            self._freed()
        return dropped
