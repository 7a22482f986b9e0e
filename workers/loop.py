"""The driver of one model on one worker: feeds the schedulers (batching.scheduler, one per version) events
from custody and the instances, carries out their actions, and supervises its own tasks. No policy of
its own: what to batch, stage, expire or release is the scheduler's; which messages are held, refreshed,
claimed and acknowledged is custody's.

Tasks (each under fleet.supervision: logged and restarted with backoff if it dies, the model
unadvertised meanwhile, the worker exits for its supervisor if one keeps dying): one reader per lane,
the driver, keepalive, claims, the statistics fold, the watchdog. The driver itself never waits on
Redis: replies are written by custody in the background, so a Redis error can never stop scheduling.

The requests it holds, and how their times (in Redis's clock) become the scheduler's: workers/held.py.
How the schedulers' actions reach the instances, and the instances' events the schedulers:
workers/dispatch.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import replace

from redis.exceptions import RedisError

from batching.holding import Holding, MessageId
from batching.plan import Batch
from batching.policy import Pending
from batching.scheduler import Scheduler
from batching.sequences import Admit, Refuse, Verdict
from fleet.admission import bulk_lane, lane_count, lane_policy
from fleet.backoff import Backoff
from fleet.cancellation import cancel_and_wait, raise_if_cancelled
from fleet.clock import Clock
from fleet.envelope import decode_request, encode_request, error_reply
from fleet.errors import InvalidInput, ModelNotReady, RequestTimeout
from fleet.llm_spec import is_llm
from fleet.model_spec import ModelSpec
from fleet.redis_link import entry_order
from fleet.redis_time import RedisClock
from fleet.supervision import Supervisor
from fleet.trace_points import WORKER_READ
from workers.consumer import StreamConsumer
from workers.custody import Answer, Custody, LiveWorkers
from workers.dispatch import Dispatch
from workers.execute import BatchOutcome
from workers.held import HeldRequest, HeldRequests, enqueue_times, pending_for, stamp_replies
from workers.inline import Neighbours
from workers.instance import Instance
from workers.loop_config import DEFAULT_LOOP_CONFIG, LoopConfig, policy_for, preserves_ordering, scheduler_config
from workers.samples import batch_sample, rejected_samples
from workers.sequence_driver import Sequences
from workers.sequence_tensors import SequenceTensors
from workers.wakeup import Wakeup
from workers.watchdog import HungHandler, Watchdog

log = logging.getLogger(__name__)

# The longest admitted requests wait for `_top_up`'s read before the driver starts them anyway (its round
# trip takes ~0.1 ms; this only bounds a Redis that stalls).
TOP_UP_WAIT_S = 0.005


class ModelLoop:
    """One model's driver on this worker; `instances` maps each loaded version to its instances."""

    def __init__(self, spec: ModelSpec, instances: dict[int, list[Instance]], consumer: StreamConsumer,
                 clock: Clock, redis_clock: RedisClock, config: LoopConfig = DEFAULT_LOOP_CONFIG, *,
                 on_hung: HungHandler | None = None, on_health: Callable[[], None] | None = None,
                 on_give_up: Callable[[str, BaseException], None] | None = None,
                 live_workers: LiveWorkers | None = None, sequence_tensors: SequenceTensors | None = None,
                 neighbours: Neighbours | None = None) -> None:
        self.spec = spec
        self.instances = instances
        self.clock = clock
        self.redis_clock = redis_clock
        self.config = config
        self.bulk_lane = bulk_lane(spec)
        assert len(consumer.streams) == lane_count(spec), "consumer built for another lane count"
        policy = policy_for(spec, config.aging_us)
        self.schedulers = {v: Scheduler(scheduler_config(spec, policy, len(insts), config,
                                                         any(i.backend.host_bound for i in insts)))
                           for v, insts in instances.items()}
        self._sequences = Sequences(spec, {v: len(insts) for v, insts in instances.items()}, sequence_tensors)
        n_instances = sum(len(i) for i in instances.values())
        per_batch = max(1, spec.max_batch_size) if policy.dynamic else 1
        self.holding = Holding(self.bulk_lane + 1, per_batch, per_batch * n_instances * config.read_ahead_batches)
        self.custody = Custody(consumer, self.holding, config.custody, admit=self.admit, lost=self._lost,
                               released=self._freed, verified=self.wake, live_workers=live_workers)
        self.watchdog = Watchdog(spec.name, [i for insts in instances.values() for i in insts], config.watchdog_s,
                                 on_hung=on_hung, on_health=on_health)
        self.supervisor = Supervisor(f"model '{spec.name}'", on_give_up=on_give_up)
        self._on_health = on_health or (lambda: None)
        self._preserve_ordering = preserves_ordering(spec)
        self._delay_lanes = frozenset(lane for lane in range(self.bulk_lane)
                                      if lane_policy(spec, lane).delay_on_timeout)
        self._held = HeldRequests()
        self._wake = Wakeup(spec.name)
        # The worker's other model loops, which share its event loop (workers/inline.py).
        self._neighbours = neighbours if neighbours is not None else Neighbours()
        self._dispatch = Dispatch(spec, instances, self.schedulers, self._sequences, self._held, self.custody, clock,
                                  redis_clock, bulk_lane=self.bulk_lane, lane_aware=is_llm(spec), wake=self._wake.set,
                                  expired=self._expire, dropped=self._drop, released=self._release,
                                  neighbours_hold=functools.partial(self._neighbours.others_hold, self.holding))
        # Where reading a flush whole can make one batch of what would be two on one instance (`_top_up`): with
        # several instances the first request's lone batch leaves the others free for the rest.
        self._tops_up = per_batch > 1 and self._dispatch.sole
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

    def queued_by_lane(self) -> dict[int, dict[int, int]]:
        """Per version and lane: requests waiting here for an instance (Triton's pending count)."""
        return {v: s.queued_by_lane() for v, s in self.schedulers.items()}

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        await self.consumer.join_when_reachable()
        sup = self.supervisor
        claims = sup.start("claims", self.custody.claim_abandoned)
        background = [sup.start("keepalive", self.custody.keep_alive), claims, sup.start("watchdog", self.watchdog.run),
                      sup.start("statistics", self.custody.fold_statistics)]
        readers = [sup.start(f"reader-{lane}", functools.partial(self._read, lane))
                   for lane in range(self.bulk_lane + 1)]
        driver = sup.start("driver", self._drive)
        if self.watchdog.guard_inline():
            self._dispatch.inline_max_ns = self.config.inline_max_us * 1000
        try:
            self._neighbours.add(self.holding)  # (removed below however this ends)
            await asyncio.gather(*readers)  # they return once stopping
            # Claims too, before the driver's last look: one landing after it would be held, uncomputed, for ever
            # (cancelled mid-flight, what Redis gave this worker stays pending, for another to claim).
            await cancel_and_wait([claims], f"model '{self.spec.name}': claims")
            self._readers_done = True
            self._wake.set()
            await driver  # returns once everything read is answered
            await self.custody.drained()
            await background[0]  # keepalive: ends once nothing is held
        finally:
            self._neighbours.remove(self.holding)
            await cancel_and_wait([*background, *readers, driver], f"model '{self.spec.name}'")
            self._wake.close()
            self.watchdog.unguard()

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
        loop = asyncio.get_running_loop()
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
            if messages:  # one clock reading and one wake-up for all that one read brought
                now = self.clock.now_us()
                busy = self._tops_up and (self.holding.rows() > 0 or not self._dispatch.one_at_a_time)
                try:
                    for message, payload in messages:
                        self._admit(message, payload, now)
                    if busy and not self._stopping:
                        await self._top_up(lane, loop)
                finally:  # (those admitted before one that raised are scheduled all the same)
                    self._wake.set()

    async def _top_up(self, lane: int, loop: asyncio.AbstractEventLoop) -> None:
        """Under load, what came after a blocking read's first message, read before the driver batches.

        A blocking XREADGROUP is answered as soon as one message is there: under load, the first of a
        gateway's flush (Redis serves the blocked read after that flush's first XADD). Its answer then waits
        in the socket while the loop is busy, and more requests arrive in the stream meanwhile. Batched at
        once, the driver would start the idle instance on that first message alone and the rest would wait
        for the next batch: at `mlp` C=32 45 % of the batches were one request (bench/RESULTS.md, stop 52).
        So unless the model's clients send one at a time (its last batches were lone requests, and it holds
        nothing else: at C=1 this read would find nothing and cost a round trip), one read more, answered at
        once with what the stream has, comes into the same step of the driver (a model that batches, on one
        instance: `_tops_up`). Should Redis stall, the driver starts what is admitted after TOP_UP_WAIT_S.
        A read that fails leaves what Redis may have delivered to it pending: claimed after the claim
        timeout, as for a blocking read whose answer is lost. Not counted as a failed read (`reading`): the
        next blocking read says whether reading works."""
        room = self.holding.room(lane)
        if room <= 0:
            return
        later = loop.call_later(TOP_UP_WAIT_S, self._wake.set)
        try:
            more = await self.consumer.read(lane, self.holding.messages_to_read(lane, room), None)
        except (RedisError, OSError) as exc:
            raise_if_cancelled()
            log.debug("%s: reading more of lane %d failed: %s", self.spec.name, lane, exc)
            return
        finally:
            later.cancel()
        now = self.clock.now_us()
        for message, payload in more:
            self._admit(message, payload, now)

    def admit(self, message: MessageId, payload: bytes | None) -> None:
        """Take a message into custody and its request into its version's scheduler."""
        self._admit(message, payload, self.clock.now_us())
        self._wake.set()

    def _admit(self, message: MessageId, payload: bytes | None, now: int) -> None:
        """`admit` read at `now`; the driver is woken by the caller."""
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
            reply = error_reply(env, ModelNotReady(self._retired or
                                                   f"model '{env.model}' version {env.version} is not loaded here"))
            self.custody.finish([Answer(message, env.reply_to, reply)])
            return
        pending = pending_for(message, env, rows, self.spec.batch_key(env.inputs), message[0] in self._delay_lanes,
                              self.redis_clock.to_local, now)
        if env.trace is not None:
            env.trace[WORKER_READ] = self.redis_clock.now_ns()
        self._held.add(HeldRequest(message, env, env.version, pending))
        verdict = self._sequences.arrive(env.version, pending.request_id, env, now)
        if verdict is not None:
            self._sequence_verdicts(env.version, [verdict], now)
        else:
            scheduler.arrive(pending, entry_order(message[1]), now)

    def _sequence_verdicts(self, version: int, verdicts: list[Verdict], now: int) -> None:
        """Carry out the gate's verdicts: schedule on the sequence's instance, or answer the error."""
        for verdict in verdicts:
            held = self._held[verdict.request_id]
            if isinstance(verdict, Admit):
                held.pending = replace(held.pending, instance=verdict.instance)
                self.schedulers[version].arrive(held.pending, entry_order(held.message[1]), now)
            elif isinstance(verdict, Refuse):
                self._held.forget((held.pending,))
                reply = error_reply(held.env, InvalidInput(verdict.message))
                self.custody.finish([Answer(held.message, held.env.reply_to, reply)], ordered=True)

    def _sequences_done(self, held: list[HeldRequest], states: list[object] | None, now: int) -> None:
        """These requests are answered: their sequences keep the state they left and move on."""
        for i, h in enumerate(held):
            state = None if states is None else states[i]
            self._sequence_verdicts(h.version, self._sequences.finished(h.version, h.pending.request_id, state, now),
                                    now)

    def cancel(self, request_ids: set[str]) -> None:
        """Callers went away (disconnected, or the gateway gave up): drop their requests if not started."""
        self._cancel(self._held.of_callers(request_ids))

    def _lost(self, messages: list[MessageId]) -> None:
        """Another worker claimed these (this one stalled): drop those not started, never ack them."""
        self._cancel(self._held.mark_lost(messages))

    def _cancel(self, by_version: dict[int, set[str]]) -> None:
        for version, ids in by_version.items():
            self.schedulers[version].cancel(ids)
        if by_version:
            self._wake.set()

    # ------------------------------------------------------------------ the driver

    async def _drive(self) -> None:
        while True:
            self._wake.clear()
            if not self.custody.fresh():
                # This process stalled (or Redis was away) past half the claim timeout: another worker may
                # own some of what it holds now. Start nothing until a keepalive round has said which.
                self.custody.verify_soon()
                if self._readers_done and not self._held and not any(s.busy() for s in self.schedulers.values()):
                    return
                await self._wake.wait(None)
                continue
            now = self.clock.now_us()
            wake: int | None = None
            for version, scheduler in self.schedulers.items():
                plan = scheduler.step(now)
                for action in plan.actions:
                    self._dispatch.apply(version, scheduler, action, now)
                if plan.wake_at_us is not None:
                    wake = plan.wake_at_us if wake is None else min(wake, plan.wake_at_us)
            idle_at = self._sequences.release_idle(now)
            if idle_at is not None:
                wake = idle_at if wake is None else min(wake, idle_at)
            # Again at once only if carrying out the plans changed what a step would decide; an event
            # meanwhile that woke the driver is kept (cleared above), so the wait below ends at once.
            if any(s.changed for s in self.schedulers.values()):
                continue
            if self._readers_done and not self._held and not any(s.busy() for s in self.schedulers.values()):
                return
            # From now, not from the round's start: carrying out the plans took time.
            await self._wake.wait(None if wake is None else (wake - self.clock.now_us()) / 1e6)

    # ------------------------------------------------------------------ answering

    def _expire(self, items: tuple[Pending, ...], now: int) -> None:
        traced = self._held.traced
        held = self._held.forget(items)
        replies = [error_reply(h.env, RequestTimeout()) for h in held]
        if traced:
            stamp_replies(held, replies, None, self.redis_clock.now_ns())
        answers = [Answer(h.message, h.env.reply_to, reply) for h, reply in zip(held, replies, strict=True)]
        samples = rejected_samples([h.env for h in held], enqueue_times(held, self.redis_clock), now)
        self.custody.finish(answers, samples, ordered=self._sequences.active)
        if self._sequences.active:
            self._sequences_done(held, None, now)

    def _drop(self, items: tuple[Pending, ...]) -> None:
        held = self._held.forget(items)
        lost = [h.message for h in held if h.lost]
        self.custody.release(lost)  # another worker owns these now: released, never acknowledged
        self.custody.finish([], [], [h.message for h in held if h.message not in lost])
        if self._sequences.active:
            self._sequences_done(held, None, self.clock.now_us())

    def _release(self, version: int, batch: Batch, result: BatchOutcome | BaseException, started_us: int) -> None:
        traced = self._held.traced
        held = self._held.forget(batch.items)
        if isinstance(result, BaseException):
            # run_batch never raises; an error here is a bug in the instance plumbing. The messages stay
            # pending (released, not acknowledged) and are claimed and computed again.
            log.error("%s: batch of %d failed outside the model: %r", self.spec.name, len(held), result)
            self.custody.release([h.message for h in held])
            if self._sequences.active:
                self._sequences_done(held, None, self.clock.now_us())
            return
        sample = batch_sample(version, held, result, self.redis_clock.offset_us, started_us, self.clock.now_us())
        if traced:
            stamp_replies(held, result.replies, result, self.redis_clock.now_ns())
        poisoned = set(result.poisoned)
        answers = [Answer(h.message, h.env.reply_to, reply,
                          park=reply.error_message if i in poisoned else None,
                          payload=encode_request(h.env) if i in poisoned else None)
                   for i, (h, reply) in enumerate(zip(held, result.replies, strict=True))]
        # A sequence's replies must reach its caller in the order its requests ran (a gRPC stream answers
        # in the order replies arrive): its next request may finish while this write is still in flight.
        self.custody.finish(answers, [sample], ordered=self._preserve_ordering or self._sequences.active)
        if self._sequences.active:
            states = [None if not reply.ok else state
                      for reply, state in zip(result.replies, result.states or [None] * len(held), strict=True)]
            self._sequences_done(held, states, self.clock.now_us())
