"""Custody: the messages one worker holds of one model, from XREADGROUP to XACK.

The worker's part in "no request is lost":
- Read-ahead is bounded (batching.holding): a worker holds at most what it will soon run.
- Keepalive: every message held (queued, staged or executing) is refreshed each `keepalive_s`, but
  only while this worker still owns it (a Lua check and XCLAIM JUSTID: no delivery counted). A
  message another worker claimed after this one stalled is reported `lost` and dropped here if not
  started. Keepalive runs until the last held message is acknowledged, past stop().
- Claim: what a dead worker left pending is taken over after the claim timeout (fleet/claims.py),
  resuming each lane from the last cursor, with exact delivery counts, even when this worker is
  saturated (one batch past its bound): orphans are older than anything new in their lane, and the
  scheduler serves them first. Past `max_deliveries` a message is poison: dead-lettered, its caller
  told.
- Ack after reply: a message is acknowledged and deleted only once its reply is written (each XADD's
  own result is checked: a reply Redis refused keeps its message pending). Writing is retried with
  backoff for up to `finish_retry_s`; after that the messages stay pending, are no longer refreshed,
  and another worker (or this one) claims and recomputes them.
- Dead consumers (workers gone for good, holding nothing) are removed from the group.

At-least-once, exactly-one-reply: a message is computed again only if its worker died or stalled past
the claim timeout while holding it; the gateway and the job runner keep the first reply per request id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from batching.holding import Holding, MessageId
from fleet.backoff import Backoff
from fleet.cancellation import raise_if_cancelled
from fleet.claims import ClaimTimeout
from fleet.envelope import ReplyEnvelope, decode_request
from fleet.errors import InvalidInput
from fleet.stats import CLAIMED, FOLD_CHUNK, REDELIVERED, BatchSample, fold_delay, logged_batches
from workers.acks import Acks
from workers.consumer import Letter, StreamConsumer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CustodyConfig:
    claim_idle_ms: int = 0  # 0: derived from observed execution time
    claim_min_ms: int = 3000
    keepalive_s: float = 1.0
    claim_interval_s: float = 1.0
    max_deliveries: int = 3
    finish_retry_s: float = 30.0
    # A reader failing this long makes the model unadvertised (it cannot read its streams).
    read_failure_s: float = 2.0
    # A consumer idle this long, holding nothing, whose worker has no heartbeat, is removed.
    dead_consumer_idle_s: float = 300.0

    @property
    def prune_interval_s(self) -> float:
        return min(30.0, self.dead_consumer_idle_s / 2)


@dataclass(frozen=True, slots=True)
class Answer:
    """One reply to write for a held message; `park` (a reason) also dead-letters the message, in the
    same round trip as the reply and ahead of it (so its caller, told, finds it parked)."""

    message: MessageId
    reply_to: str
    reply: ReplyEnvelope
    park: str | None = None
    payload: bytes | None = None  # kept with a parked message, for `fleet dead-letters --replay`


Admit = Callable[[MessageId, bytes | None], None]
Lost = Callable[[list[MessageId]], None]
Released = Callable[[], None]
Verified = Callable[[], None]
LiveWorkers = Callable[[], Awaitable[set[str]]]


class Custody:
    def __init__(self, consumer: StreamConsumer, holding: Holding, config: CustodyConfig, *,
                 admit: Admit, lost: Lost, released: Released, verified: Verified | None = None,
                 live_workers: LiveWorkers | None = None) -> None:
        self.consumer = consumer
        self.holding = holding
        self.config = config
        self.claim_timeout = ClaimTimeout(floor_ms=config.claim_min_ms, fixed_ms=config.claim_idle_ms)
        self._admit = admit
        self._lost = lost
        self._released = released  # room was made in the holding: readers may read again
        self._verified = verified or (lambda: None)  # custody confirmed (after it had gone stale)
        # When this worker last knew it owned everything it holds (a keepalive round, or holding nothing).
        # Past half the shortest claim timeout, another worker may have claimed its messages (it stalled):
        # nothing more is started until a keepalive round says which are still its own.
        self.verified_at = time.monotonic()
        floor_ms = min(config.claim_min_ms, config.claim_idle_ms) if config.claim_idle_ms > 0 else config.claim_min_ms
        self.stale_after_s = floor_ms / 2000
        self._refresh_now = asyncio.Event()
        self._live_workers = live_workers
        self._stopping = False
        self._finishing: set[asyncio.Task[None]] = set()
        self._last_written: asyncio.Future[None] | None = None  # preserve_ordering: the last ordered write
        self._acks = Acks(consumer, config.finish_retry_s, self.release)
        self._read_failing_since: float | None = None

    @property
    def model(self) -> str:
        return self.consumer.model

    # ------------------------------------------------------------------ reading

    @property
    def reading(self) -> bool:
        """False while reads have been failing for longer than `read_failure_s` (the model's streams
        cannot be read: Redis away, a refused ACL, a lost group being re-created)."""
        since = self._read_failing_since
        return since is None or time.monotonic() - since < self.config.read_failure_s

    async def read(self, lane: int, room: int, block_ms: int) -> list[tuple[MessageId, bytes | None]]:
        """New messages of `lane`, as many as `room` rows allow; Redis errors propagate (the reader backs
        off), and are remembered for `reading`."""
        try:
            messages = await self.consumer.read(lane, self.holding.messages_to_read(lane, room), block_ms)
        except (RedisError, OSError):
            if self._read_failing_since is None:
                self._read_failing_since = time.monotonic()
            raise
        self._read_failing_since = None
        return messages

    def stop(self) -> None:
        """Nothing new is read; keepalive and finishing go on until everything held is answered."""
        self._stopping = True

    # ------------------------------------------------------------------ answering

    def finish(self, answers: Sequence[Answer], samples: Sequence[BatchSample] = (),
               acks: Sequence[MessageId] = (), *, ordered: bool = False) -> None:
        """Write `answers` (parking those to park, with their replies) and count `samples`, then ack what
        got a reply, and `acks` (no reply needed); in the background, retried, so a Redis error never
        reaches the caller. `ordered`: written only after every earlier ordered finish has written its
        replies (preserve_ordering: finishes run concurrently, on several connections, so a later one
        could otherwise reach Redis first)."""
        after = self._last_written if ordered else None
        written: asyncio.Future[None] | None = None
        if ordered:
            written = self._last_written = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._finish(list(answers), list(samples), list(acks), after, written))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, answers: list[Answer], samples: list[BatchSample], acks: list[MessageId],
                      after: asyncio.Future[None] | None, written: asyncio.Future[None] | None) -> None:
        handed: list[MessageId] = []  # released once acknowledged (workers/acks.py), not here
        try:
            if after is not None and not after.done():
                await asyncio.wait([after])
            replied = await self._write(answers, samples, written)
            if replied is None:
                return  # given up: the messages stay pending, to be claimed and computed again
            handed = acks + [a.message for a in replied]
            self._acks.add(handed)
            self.holding.answered(handed)  # room for the next reads now, not once acknowledged
            self._released()
        finally:
            if written is not None and not written.done():
                written.set_result(None)
            done = set(handed)
            self.release([m for m in [a.message for a in answers] + acks if m not in done])

    async def _write(self, answers: list[Answer], samples: list[BatchSample],
                     written: asyncio.Future[None] | None = None) -> list[Answer] | None:
        """Write the replies, park the answers to park and count the samples, retried with backoff for up
        to finish_retry_s; carries the acknowledgements waiting for a ride (workers/acks.py). `written` is
        set once every reply is out (an ordered finish waits for no letter or count). Returns the answers
        written (and parked, if to be), or None if Redis refused a reply for too long."""
        backoff = Backoff()
        give_up_at = time.monotonic() + self.config.finish_retry_s
        to_write, done = answers, []
        to_park = [a for a in answers if a.park is not None]  # each parked once, however often its reply is retried
        counts = logged_batches(samples)  # the same tokens in every retry
        copies = False  # every attempt after the first follows a failure: it may have counted them already
        while to_write or counts or to_park:
            carried = self._acks.take()
            try:
                w = await self.consumer.write([(a.reply_to, a.reply) for a in to_write], counts,
                                              [m for ms, _ in carried for m in ms],
                                              [Letter(a.message, a.park or "", a.payload) for a in to_park],
                                              copies=copies)
            except BaseException as exc:
                self._acks.settle(carried, False)  # (cancelled, or a bug: the ride's acks go on all the same)
                if not isinstance(exc, (RedisError, OSError)):
                    raise
                # The connection failed: Redis may have run some or all of the write. Replies written
                # twice are dropped by the gateway, letters are at least once; counts go again as copies,
                # which the fold counts only if their first did not land (fleet/stats.py).
                error: BaseException | None = exc
            else:
                self._acks.settle(carried, w.acked)
                done += [a for i, a in enumerate(to_write) if i in w.replies]
                to_write = [a for i, a in enumerate(to_write) if i not in w.replies]
                to_park = [a for i, a in enumerate(to_park) if i not in w.letters]
                # Refused counts never landed, but the link may have sent them twice on its own.
                counts = list(w.uncounted)
                error = w.error if (to_write or counts or to_park) else None
            copies = True
            if not to_write and written is not None and not written.done():
                written.set_result(None)
            if error is None:
                continue
            if time.monotonic() > give_up_at:
                if to_write:
                    log.error("%s: %d replies could not be written for %.0f s (%s); their messages stay pending "
                              "and will be claimed and computed again", self.model, len(to_write),
                              self.config.finish_retry_s, error)
                    return None
                # Every reply is out: what is acknowledged now is not computed again. A message Redis would
                # not park stays pending, to be claimed and parked again (its caller has its answer).
                log.error("%s: %d dead letters and %d batch counts could not be written for %.0f s (%s); those "
                          "messages stay pending", self.model, len(to_park), len(counts),
                          self.config.finish_retry_s, error)
                unparked = {a.message for a in to_park}
                return [a for a in done if a.message not in unparked]
            delay = backoff.next_delay()
            log.warning("%s: writing replies failed (%s); retrying in %.2f s", self.model, error, delay)
            await asyncio.sleep(delay)
        return done

    async def _retrying(self, what: str, call: Callable[[], Awaitable[None]]) -> None:
        backoff = Backoff()
        give_up_at = time.monotonic() + self.config.finish_retry_s
        while True:
            try:
                await call()
                return
            except (RedisError, OSError) as exc:
                if time.monotonic() > give_up_at:
                    log.error("%s: %s failed for %.0f s: %s", self.model, what, self.config.finish_retry_s, exc)
                    return
                await asyncio.sleep(backoff.next_delay())

    def release(self, messages: Sequence[MessageId]) -> None:
        """No longer held (answered, or left pending for another worker to claim): room for new reads."""
        self.holding.release(messages)
        self._released()
        if self._stopping and not self.holding.held():  # keepalive may end: now, not a keepalive_s later
            self._refresh_now.set()

    async def drained(self) -> None:
        """Until every background finish is done."""
        while self._finishing:
            await asyncio.gather(*list(self._finishing), return_exceptions=True)

    # ------------------------------------------------------------------ keepalive and claims

    def fresh(self) -> bool:
        """Whether custody was confirmed recently enough that nothing held can have been claimed away.
        Read from instance threads too (a float read)."""
        return time.monotonic() - self.verified_at < self.stale_after_s

    def verify_soon(self) -> None:
        """Run a keepalive round now (custody went stale: the loop waits for it before starting more)."""
        self._refresh_now.set()

    async def keep_alive(self) -> None:
        """Refresh what this worker holds, every keepalive_s (or at once when asked), until it holds
        nothing and is stopping: answered messages too, until their acknowledgements are sent (a worker
        that closed its connections first would leave them pending, to be claimed and computed again)."""
        backoff = Backoff()
        while not (self._stopping and not self.holding.held() and not self._finishing):
            try:
                async with asyncio.timeout(self.config.keepalive_s):
                    await self._refresh_now.wait()
            except TimeoutError:
                pass
            self._refresh_now.clear()
            started = time.monotonic()
            held = self.holding.by_lane()
            if not held:
                self._confirm(started)
                continue
            try:
                lost = await self.consumer.keep(held)
                backoff.reset()
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                log.warning("%s: refreshing held messages failed: %s", self.model, exc)
                await asyncio.sleep(backoff.next_delay())
                continue
            # Answered meanwhile: not lost. Their acknowledgement rides on a reply write (workers/acks.py)
            # and may have deleted them before this round ran, while they stay held until its result is
            # read; a reply written is never lost anyway (whoever claims it computes a duplicate the
            # gateway drops).
            lost = self.holding.unanswered(lost)
            if lost:
                log.warning("%s: %d held messages are no longer this worker's (another claimed them after this "
                            "one stalled past the claim timeout, or Redis lost their delivery in a restart or "
                            "failover); dropping those not started", self.model, len(lost))
                self._lost(lost)
            self._confirm(started)

    def _confirm(self, as_of: float) -> None:
        stale = not self.fresh()
        self.verified_at = as_of
        if stale:
            self._verified()

    async def claim_abandoned(self) -> None:
        backoff = Backoff()
        next_prune = time.monotonic() + self.config.prune_interval_s
        while not self._stopping:
            await asyncio.sleep(self.config.claim_interval_s)
            room = self.holding.claim_room()
            try:
                if room > 0 and not self._stopping:
                    await self._claim(room)
                if time.monotonic() > next_prune:
                    next_prune = time.monotonic() + self.config.prune_interval_s
                    await self._prune()
                backoff.reset()
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                log.warning("%s: claiming abandoned messages failed: %s", self.model, exc)
                await asyncio.sleep(backoff.next_delay())

    async def fold_statistics(self) -> None:
        """Fold the model's statistics log into its hash a chunk at a time, as often as it grows, so that
        it stays short when nobody reads the statistics and no fold holds Redis long (fleet/stats.py)."""
        delay, last = 0.0, time.monotonic()  # at once: a log a stopped worker left
        while not self._stopping:
            await asyncio.sleep(delay)
            now = time.monotonic()
            try:
                folded = await self.consumer.fold_stats(FOLD_CHUNK)
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                log.debug("%s: folding the statistics log failed: %s", self.model, exc)
                folded = 0  # tried again after fleet/stats.py FOLD_IDLE_S
            delay, last = fold_delay(folded, now - last, FOLD_CHUNK), now

    async def _claim(self, room: int) -> None:
        claimed = await self.consumer.claim(self.claim_timeout.idle_ms, self.holding.messages_to_read(0, room))
        taken = [c for c in claimed if c.message not in self.holding]  # else ours all along (a refresh came late)
        again = 0
        for c in taken:
            if c.deliveries > self.config.max_deliveries:
                self.give_up(c.message, c.payload, f"the request was delivered {c.deliveries} times without "
                                                   "completing; moved to the dead letters")
            else:
                log.warning("%s: claimed %r after another worker left it (delivery %d)", self.model, c.message,
                            c.deliveries)
                self._admit(c.message, c.payload)
                again += 1
        if taken:
            try:  # after admitting: a count Redis refuses is lost, never the claimed messages' turn
                await self.consumer.count({CLAIMED: len(taken), REDELIVERED: again})
            except (RedisError, OSError) as exc:
                log.debug("%s: claims not counted: %s", self.model, exc)

    async def _prune(self) -> None:
        if self._live_workers is None:
            return
        idle_ms = int(self.config.dead_consumer_idle_s * 1000)
        removed = await self.consumer.prune_consumers(await self._live_workers(), idle_ms)
        if removed:
            log.info("%s: removed %d consumers of workers gone for good: %s", self.model, len(removed),
                     ", ".join(removed))

    def give_up(self, message: MessageId, payload: bytes | None, reason: str) -> None:
        """A message that keeps killing its workers or instances: dead-letter it and tell its caller."""
        log.error("%s: %r: %s", self.model, message, reason)
        try:
            env = decode_request(payload) if payload else None
        except InvalidInput:
            env = None
        if env is None:
            self.park_unreadable(message, reason, payload)
            return
        self.holding.hold(message, 1)
        reply = ReplyEnvelope(id=env.id, model_version=env.version, error_code="INTERNAL", error_message=reason)
        self.finish([Answer(message, env.reply_to, reply, park=reason, payload=payload)], [])

    def park_unreadable(self, message: MessageId, reason: str, payload: bytes | None) -> None:
        """A message that is not a request envelope: dead-letter it (there is nobody to reply to)."""
        self.holding.hold(message, 1)
        task = asyncio.ensure_future(self._park_unreadable(message, reason, payload))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _park_unreadable(self, message: MessageId, reason: str, payload: bytes | None) -> None:
        try:
            await self._retrying(f"dead-lettering {message!r}",
                                 functools.partial(self.consumer.dead_letter, Letter(message, reason, payload)))
        finally:
            self.release([message])
