"""The async driver of one model on one worker: read -> decide (batching.policy) -> execute -> finish.

The only place in the worker that waits. The policy is asked what to do whenever something changes (an
arrival, a freed instance, a timer); it answers Dispatch, Wait(until) or Reject, and this loop acts.
A batch runs on a free instance's own thread, so `instance_group.count` instances run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from batching.policy import BatchPolicy, Dispatch, Pending, Reject, Wait, decide
from fleet.clock import Clock
from fleet.envelope import ReplyEnvelope, RequestEnvelope, decode_request
from fleet.errors import InvalidInput, RequestTimeout, ServingError
from fleet.model_config import ModelSpec
from fleet.stats import BatchSample
from workers.backends.base import Backend
from workers.consumer import StreamConsumer
from workers.execute import BatchOutcome, run_batch

log = logging.getLogger(__name__)


def policy_for(spec: ModelSpec) -> BatchPolicy:
    db = spec.dynamic_batching
    if db is None or spec.max_batch_size == 0:
        return BatchPolicy(max_batch_size=spec.max_batch_size, dynamic=False)
    return BatchPolicy(max_batch_size=spec.max_batch_size, preferred_batch_sizes=db.preferred_batch_sizes,
                       max_queue_delay_us=db.max_queue_delay_us)


@dataclass(slots=True)
class Instance:
    name: str
    backend: Backend
    executor: ThreadPoolExecutor


@dataclass(slots=True)
class _Queued:
    entry_id: bytes
    env: RequestEnvelope
    pending: Pending


@dataclass
class ModelLoop:
    """One model's loop on this worker; `instances` maps each loaded version to its instances."""

    spec: ModelSpec
    instances: dict[int, list[Instance]]
    consumer: StreamConsumer
    clock: Clock
    block_ms: int = 1000
    read_ahead_batches: int = 2
    claim_idle_ms: int = 30_000
    claim_interval_s: float = 5.0
    max_deliveries: int = 3
    policy: BatchPolicy = field(init=False)
    _queued: dict[int, list[_Queued]] = field(init=False, default_factory=dict)
    _free: dict[int, list[Instance]] = field(init=False, default_factory=dict)
    _in_flight: int = field(init=False, default=0)
    # Entry ids this worker holds (queued or executing): a claim must not admit them twice.
    _holding: set[bytes] = field(init=False, default_factory=set)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _room: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _stopping: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.policy = policy_for(self.spec)
        self._queued = {v: [] for v in self.instances}
        self._free = {v: list(insts) for v, insts in self.instances.items()}

    @property
    def capacity(self) -> int:
        """Requests this worker holds at most (queued + executing): enough to form the next batches."""
        per_batch = max(1, self.spec.max_batch_size) if self.policy.dynamic else 1
        n_instances = sum(len(i) for i in self.instances.values())
        return per_batch * n_instances * self.read_ahead_batches

    def held(self) -> int:
        return sum(len(q) for q in self._queued.values()) + self._in_flight

    async def run(self) -> None:
        await self.consumer.join()
        schedulers = [asyncio.create_task(self._schedule(v)) for v in self.instances]
        schedulers.append(asyncio.create_task(self._claim_abandoned()))
        try:
            await self._read()
            # Stopping: nothing new is read; finish and answer what this worker holds.
            while self.held():
                self._wake.set()
                await asyncio.sleep(0.01)
        finally:
            for task in schedulers:
                task.cancel()
            await asyncio.gather(*schedulers, return_exceptions=True)

    def stop(self) -> None:
        self._stopping = True
        self._room.set()
        self._wake.set()

    async def _read(self) -> None:
        while not self._stopping:
            room = self.capacity - self.held()
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                messages = await self.consumer.read(room, self.block_ms)
            except (RedisError, OSError) as exc:
                log.warning("%s: read failed (%s); retrying", self.spec.name, exc)
                await asyncio.sleep(0.5)
                continue
            for entry_id, payload in messages:
                await self._admit(entry_id, payload)
            if messages:
                self._wake.set()

    async def _claim_abandoned(self) -> None:
        """Serve what a dead worker left pending: XAUTOCLAIM after claim_idle_ms, on a timer."""
        while True:
            await asyncio.sleep(self.claim_interval_s)
            room = self.capacity - self.held()
            if room <= 0:
                continue
            try:
                claimed = await self.consumer.claim(self.claim_idle_ms, room)
                for entry_id, payload, deliveries in claimed:
                    if entry_id in self._holding:
                        continue  # our own read-ahead that waited long: already queued here
                    if deliveries > self.max_deliveries:
                        await self._give_up(entry_id, payload, deliveries)
                    else:
                        log.warning("%s: claimed %r after another worker left it (delivery %d)",
                                    self.spec.name, entry_id, deliveries)
                        await self._admit(entry_id, payload)
                if claimed:
                    self._wake.set()
            except (RedisError, OSError) as exc:
                log.warning("%s: claiming abandoned messages failed: %s", self.spec.name, exc)

    async def _give_up(self, entry_id: bytes, payload: bytes | None, deliveries: int) -> None:
        """A message that keeps killing its workers: dead-letter it and tell its caller."""
        reason = f"the request was delivered {deliveries} times without completing; moved to the dead letters"
        log.error("%s: %r: %s", self.spec.name, entry_id, reason)
        try:
            env = decode_request(payload) if payload else None
        except InvalidInput:
            env = None
        if env is not None:
            reply = ReplyEnvelope(id=env.id, model_version=env.version, error_code="INTERNAL", error_message=reason)
            await self.consumer.finish([(env.reply_to, reply)], [], None)
        await self.consumer.dead_letter(entry_id, reason)

    async def _admit(self, entry_id: bytes, payload: bytes | None) -> None:
        try:
            if payload is None:
                raise InvalidInput("message without a payload")
            env = decode_request(payload)
        except InvalidInput as exc:
            log.error("%s: unreadable message %r: %s", self.spec.name, entry_id, exc)
            await self.consumer.dead_letter(entry_id, exc.message)
            return
        queue = self._queued.get(env.version)
        if queue is None:
            reply = ReplyEnvelope(id=env.id, model_version=env.version, error_code="NOT_FOUND",
                                  error_message=f"model '{env.model}' version {env.version} is not loaded here")
            await self.consumer.finish([(env.reply_to, reply)], [entry_id], None)
            return
        rows = env.batch_rows(self.spec.max_batch_size > 0)
        key = tuple((t.name, t.shape[1:]) for t in env.inputs) if self.spec.needs_equal_shapes else \
            tuple(sorted(t.name for t in env.inputs))
        self._holding.add(entry_id)
        queue.append(_Queued(entry_id, env, Pending(
            request_id=entry_id.decode(), lane=0, enqueued_at_us=env.enqueued_at_us,
            deadline_us=env.deadline_us, rows=rows, shape_key=key)))

    async def _schedule(self, version: int) -> None:
        queue = self._queued[version]
        free = self._free[version]
        while True:
            if not queue or not free:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.clock.now_us()
            decision = decide(self.policy, [q.pending for q in queue], now)
            if isinstance(decision, Reject):
                await self._reject(queue, decision)
            elif isinstance(decision, Dispatch):
                chosen = {p.request_id for p in decision.items}
                batch = [q for q in queue if q.pending.request_id in chosen]
                queue[:] = [q for q in queue if q.pending.request_id not in chosen]
                instance = free.pop()
                self._in_flight += len(batch)
                asyncio.create_task(self._execute(version, instance, batch, now))
            elif isinstance(decision, Wait):
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), max(0.0, (decision.until_us - now) / 1e6))
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
        await self.consumer.finish(replies, [q.entry_id for q in expired], None)
        self._holding.difference_update(q.entry_id for q in expired)
        self._room.set()

    async def _execute(self, version: int, instance: Instance, batch: list[_Queued], started_us: int) -> None:
        envs = [q.env for q in batch]
        released = False
        try:
            loop = asyncio.get_running_loop()
            outcome: BatchOutcome = await loop.run_in_executor(
                instance.executor, run_batch, self.spec, instance.backend, envs)
            # The instance is free as soon as it has computed: the next batch runs while this one's
            # replies are written (acks still follow the replies, in the same pipeline).
            self._free[version].append(instance)
            released = True
            self._wake.set()
            sample = self._sample(version, envs, outcome, started_us)
            await self.consumer.finish([(e.reply_to, r) for e, r in zip(envs, outcome.replies, strict=True)],
                                       [q.entry_id for q in batch], sample)
        except Exception:
            # Redis trouble while finishing: the messages stay pending and will be claimed again.
            log.exception("%s: batch of %d could not be finished", self.spec.name, len(batch))
        finally:
            self._in_flight -= len(batch)
            self._holding.difference_update(q.entry_id for q in batch)
            if not released:
                self._free[version].append(instance)
            self._wake.set()
            self._room.set()

    def _sample(self, version: int, envs: list[RequestEnvelope], outcome: BatchOutcome,
                started_us: int) -> BatchSample:
        now_us = self.clock.now_us()
        ok = [e for e, r in zip(envs, outcome.replies, strict=True) if r.ok]
        bad = [e for e, r in zip(envs, outcome.replies, strict=True) if not r.ok]
        rows = sum(e.batch_rows(self.spec.max_batch_size > 0) for e in ok)
        return BatchSample(
            version=version, batch_size=rows, requests_ok=len(ok), requests_failed=len(bad),
            request_ns_ok=sum(now_us - e.enqueued_at_us for e in ok) * 1000,
            request_ns_failed=sum(now_us - e.enqueued_at_us for e in bad) * 1000,
            queue_ns=sum(max(0, started_us - e.enqueued_at_us) for e in ok) * 1000,
            compute_input_ns=outcome.compute_input_ns, compute_infer_ns=outcome.compute_infer_ns,
            compute_output_ns=outcome.compute_output_ns, finished_ms=int(time.time() * 1000),
        )
