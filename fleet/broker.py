"""Calling models through Redis: enqueue requests on model streams and the one reply reader per process.
A gateway's data plane uses it, and so does a worker whose Python models call other models (BLS,
workers/bls.py); "gateway" below stands for either caller, its id for the worker's id in a worker.

Enqueues go out as one batch per round trip (many requests in one), on connections of the broker's own
(fleet/link_pool.py): up to ENQUEUE_LINKS round trips in flight, each on its own connection;
with all of them busy, those issued meanwhile go in the next, in order. Round trips on different
connections reach Redis in any order (a sequence's next request waits for its previous one's XADD,
gateway/sequences.py). Each command's own result decides its request's fate, so one refused XADD fails
only its own caller (the others were enqueued and will be answered). Replies come back on this gateway's
own stream, read by one task (fleet/reply_reader.py). Request ids carry a nonce drawn at each start, so a
gateway restarted with the same FLEET_GATEWAY_ID never takes an old reply for a new request. Redis errors
become BrokerUnavailable here, once. The broker also keeps this process's estimate of Redis's clock
(fleet/redis_time.py), the time base of every envelope.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import uuid
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.backoff import Backoff
from fleet.cancellation import cancel_and_wait, raise_if_cancelled
from fleet.envelope import ReplyEnvelope
from fleet.errors import BrokerUnavailable, QueueFull, RequestTimeout
from fleet.keys import Keys
from fleet.lane_scripts import BOUNDED_XADD, REJECT_UNREAD
from fleet.link_pool import LinkPool
from fleet.parts import Parts
from fleet.redis_clients import unrecoverable
from fleet.redis_link import RedisLink, entry_order
from fleet.redis_time import RedisClock
from fleet.reply_reader import SWEEP_S, ReplyReader, Waiter
from fleet.stats import BatchSample, increments
from fleet.supervision import Supervisor

log = logging.getLogger(__name__)

# A request waiting for the next flush: (request id, stream, payload, max queue size, its reply's future).
_Outgoing = tuple[str, str, bytes | Parts, int, asyncio.Future[ReplyEnvelope]]

REJECT_RETRY_S = 0.005  # the request's XADD has not come back yet: look again this soon

# Enqueue round trips in flight at once. With one, a request waited in the outbox for the round trip before
# it: at `mlp` C=32 a median 155 µs, p90 528, the round trip itself 247 µs median, p90 994 (a throwaway
# probe). Each connection more lets a flush go out while earlier ones are on their way (bench/RESULTS.md,
# stop 51); with all busy, what comes meanwhile still goes in one.
ENQUEUE_LINKS = 3
# A stopping broker gives the round trips still on their way (enqueues, rejections, cancellations) this long
# to come back before it cancels them and closes their links.
STOP_FLUSHES_S = 1.0
_STOPPING = "cannot enqueue the request: the gateway is stopping"


class Broker:
    def __init__(self, client: aioredis.Redis, reader_client: aioredis.Redis, keys: Keys, gateway_id: str,
                 *, block_ms: int, request_timeout_s: float, outage_s: float = 5.0,
                 on_give_up: Callable[[str, BaseException], None] | None = None) -> None:
        self._client = client
        self._reader_client = reader_client
        # The request path's two round trips, on connections of their own: the enqueue, here, and the
        # reply read (fleet/reply_reader.py).
        self._enqueue = LinkPool(client, ENQUEUE_LINKS)
        self.keys = keys
        self.gateway_id = gateway_id
        self.reply_key = keys.reply(gateway_id)
        self.timeout_s = request_timeout_s
        self.redis_clock = RedisClock()
        self._replies = ReplyReader(client, reader_client, self.reply_key, block_ms=block_ms,
                                    timeout_s=request_timeout_s, outage_s=outage_s, redis_clock=self.redis_clock,
                                    abandoned=self._cancel_waiter, back=self._look_for_lost)
        self._waiters = self._replies.waiters
        self._outbox: list[_Outgoing] = []
        self._flushes: set[asyncio.Future[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        # Request id -> called once its XADD has come back (taken or not): a sequence's next request is
        # enqueued only then, since XADDs of different flushes may reach Redis in any order
        # (gateway/sequences.py).
        self._on_enqueued: dict[str, Callable[[], None]] = {}
        # A decoupled model's requests until flushed: as a sequence's, never enqueued twice (two runs would both
        # stream to the caller; a sequence's state would take a step twice), so never in a retried round trip.
        self._streamed: set[str] = set()
        self._seq = 0
        self._looking: asyncio.Future[None] | None = None  # the look for lost requests running (_look_for_lost)
        self._look_again, self._look_until, self.resent_requests = False, 0.0, 0  # resent: Redis had lost them
        # The loop it serves, from `start` on: looked up per request otherwise, and on Python 3.11 each lookup
        # is a getpid() system call.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._boot = uuid.uuid4().hex[:8]  # request ids are unique across restarts with a fixed gateway id
        self.supervisor = Supervisor(f"gateway {gateway_id}", on_give_up=on_give_up)

    @property
    def unclaimed_replies(self) -> int:
        """Replies nobody waited for any more (duplicates or late), dropped."""
        return self._replies.unclaimed

    def expires_us(self, enqueued_us: int) -> int:
        """When a request enqueued at `enqueued_us` (Redis's clock) is of no use any more: this gateway
        has answered 504 by then (its sweep runs every SWEEP_S), so a worker that still holds it drops it
        instead of computing."""
        return enqueued_us + int((self.timeout_s + SWEEP_S) * 1_000_000)

    def next_id(self) -> str:
        self._seq += 1
        return f"{self.gateway_id}:{self._boot}:{self._seq}"

    async def start(self) -> None:
        """Start the reply reader and the sweeper. Redis need not be up: they wait for it with backoff
        (requests meanwhile fail fast with 503), so a gateway never fails to start for want of Redis."""
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self.redis_clock.calibrate(self._client), 2.0)
        except (RedisError, OSError, TimeoutError) as exc:
            if unrecoverable(exc):  # credentials, ACL, TLS: waiting does not fix it
                raise BrokerUnavailable(f"Redis refuses this gateway: {exc}") from exc
            log.warning("Redis is not reachable yet (%s); the gateway starts and waits for it", exc)
        await self._replies.mark_start()
        self._tasks = [self.supervisor.start("reply-reader", self._replies.read),
                       self.supervisor.start("reply-sweeper", self._replies.sweep)]

    async def stop(self) -> None:
        self._stopping = self._replies.stopping = True
        await cancel_and_wait(self._tasks, f"gateway {self.gateway_id} broker")
        if self._looking is not None:  # its wait for the reader, stopped now, would never end
            await cancel_and_wait([self._looking], f"gateway {self.gateway_id} broker's look for lost requests")
        # What is still on its way ends before the links close: left running, a flush would take a link (and
        # reconnect it) after aclose. On a graceful stop their callers are answered by now. Any left fail
        # rather than wait for ever: those no flush took, those whose flush was cancelled, and those enqueued
        # whose replies nothing reads any more (the reader has stopped).
        if self._flushes:
            await asyncio.wait(set(self._flushes), timeout=STOP_FLUSHES_S)
            await cancel_and_wait(set(self._flushes), f"gateway {self.gateway_id} broker's round trips")
        stopping = BrokerUnavailable(_STOPPING)
        outbox, self._outbox = self._outbox, []
        for rid, *_, fut in outbox:
            if not fut.done():
                fut.set_exception(stopping)
            done = self._on_enqueued.pop(rid, None)
            if done is not None:
                done()  # never enqueued: a sequence's next request waits for nothing
        self._replies.fail_waiting("the gateway is stopping: no reply will be read")
        try:
            await self._client.delete(self.reply_key)
        except RedisError:
            pass
        await self._enqueue.aclose()
        await self._replies.aclose()
        await self._client.aclose()
        await self._reader_client.aclose()

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"Redis is not reachable: {exc}") from exc

    def submit(self, request_id: str, stream: str, payload: bytes | Parts, max_queue_size: int = 0, model: str = "",
               *, version: int = 0, enqueued_us: int = 0, reject_at_us: int | None = None,
               streamed: bool = False, on_enqueued: Callable[[], None] | None = None
               ) -> asyncio.Future[ReplyEnvelope]:
        """Enqueue payload on stream and return the future of its reply.

        The waiter is registered before the XADD is sent, so a fast reply is never missed. XADDs of one
        event-loop turn go out as one pipeline; if Redis cannot take them, their futures fail with
        BrokerUnavailable; past `max_queue_size` (> 0) waiting requests, with QueueFull at once.
        `reject_at_us` (Redis's clock): its queue deadline under REJECT; if no worker has read it by then,
        it is deleted and fails with RequestTimeout. The caller must `forget(request_id)` when done (also
        on cancellation). `streamed` (a decoupled model): the future gets the first reply, `later(id)`
        the ones after it until one is final; the timeout then counts from the last reply."""
        loop = self._loop or asyncio.get_running_loop()
        fut: asyncio.Future[ReplyEnvelope] = loop.create_future()
        if self._stopping:  # its links are closing or closed
            fut.set_exception(BrokerUnavailable(_STOPPING))
            return fut
        # A decoupled model's or a sequence's request is never sent again (_send_lost_again): no payload kept.
        self._waiters[request_id] = Waiter(fut, loop.time() + self.timeout_s, model, version=version,
                                           enqueued_us=enqueued_us, more=asyncio.Queue() if streamed else None,
                                           payload=None if streamed or on_enqueued is not None else payload)
        if on_enqueued is not None:
            self._on_enqueued[request_id] = on_enqueued
        if streamed:
            self._streamed.add(request_id)
        self._outbox.append((request_id, stream, payload, max_queue_size, fut))
        if len(self._outbox) == 1:
            loop.call_soon(self._start_flush)
        if reject_at_us is not None:
            now = self.redis_clock.to_redis(self.redis_clock.now_us())
            loop.call_later(max(0.0, (reject_at_us - now) / 1e6), self._reject_if_unread, request_id)
        return fut

    def _reject_if_unread(self, request_id: str) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is None or waiter.future.done() or self._stopping:
            return
        if waiter.entry is None:  # not enqueued yet (or it failed, and the caller is being told)
            asyncio.get_running_loop().call_later(REJECT_RETRY_S, self._reject_if_unread, request_id)
            return
        task = asyncio.ensure_future(self._reject_unread(request_id, waiter))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _reject_unread(self, request_id: str, waiter: Waiter) -> None:
        assert waiter.entry is not None
        stream, entry_id = waiter.entry
        now = self.redis_clock.to_redis(self.redis_clock.now_us())
        sample = BatchSample(version=waiter.version, batch_size=0, requests_ok=0, requests_failed=1,
                             request_ns_ok=0, request_ns_failed=max(0, now - waiter.enqueued_us) * 1000, queue_ns=0,
                             compute_input_ns=0, compute_infer_ns=0, compute_output_ns=0,
                             finished_ms=now // 1000, requests_rejected=1)
        args: list[bytes | str | int] = [entry_id]
        for name, delta in increments(sample).items():
            args += [name, delta]
        try:
            deleted = await self._client.eval(REJECT_UNREAD, 2, stream, self.keys.stats(waiter.model), *args)
        except (RedisError, OSError) as exc:
            log.debug("rejecting %s at its deadline failed: %s (a worker will)", request_id, exc)
            return
        if deleted and self._waiters.pop(request_id, None) is waiter and not waiter.future.done():
            waiter.future.set_exception(RequestTimeout())

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    def after_enqueue(self, request_id: str, call: Callable[[], None]) -> None:
        """`call` once the request's XADD has come back: now if it has (or it asked for nothing), else
        left to its flush, which calls what `submit` was given as `on_enqueued` (the same `call`). A
        sequence's caller that goes away releases its next request so: flushes on other connections
        would otherwise let that one reach Redis first."""
        if request_id not in self._on_enqueued:
            call()

    def later(self, request_id: str) -> asyncio.Queue[ReplyEnvelope]:
        """The replies after the first of a `streamed` request (call before its first reply is used)."""
        waiter = self._waiters.get(request_id)
        if waiter is None or waiter.more is None:
            raise KeyError(f"{request_id} is not a streamed request in flight")
        return waiter.more

    def cancel(self, request_id: str) -> None:
        """The caller went away (disconnected, or timed out): delete the request from its stream if no
        worker has read it yet, and tell the workers to drop it if one holds it queued. Best effort,
        in the background: the caller is not kept waiting for it."""
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            self._cancel_waiter(request_id, waiter)

    def _cancel_waiter(self, request_id: str, waiter: Waiter) -> None:
        if waiter.entry is None or self._stopping:
            return
        task = asyncio.ensure_future(self._cancel(request_id, waiter.model, *waiter.entry))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _cancel(self, request_id: str, model: str, stream: str, entry_id: bytes) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.xdel(stream, entry_id)
            pipe.publish(self.keys.cancel(), json.dumps([model, request_id]))
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.debug("cancelling %s failed: %s", request_id, exc)

    def _look_for_lost(self) -> None:
        """The reply reader's connection is new: look for requests Redis lost (below), one look at a time."""
        if self._stopping:
            return
        self._look_until = asyncio.get_running_loop().time() + self.timeout_s  # what waits now has timed out by then
        if self._looking is not None:
            self._look_again = True
            return
        self._looking = asyncio.ensure_future(self._looks())

    async def _looks(self) -> None:
        backoff = Backoff()
        try:
            while True:
                self._look_again = False
                if await self._send_lost_again(quiet=backoff.attempt > 0):
                    backoff.reset()
                elif asyncio.get_running_loop().time() < self._look_until:
                    # Redis failed it (away, loading): again after a backoff, as long as what waits now may wait.
                    self._look_again = True
                    await asyncio.sleep(backoff.next_delay())
                if not self._look_again or self._stopping:
                    return
        finally:
            self._looking = None

    async def _send_lost_again(self, quiet: bool = False) -> bool:
        """Send again the requests Redis lost with writes it had acknowledged (an AOF replayed short of its end,
        a failover to a replica that lagged): their entries are gone, no reply came, and their callers would
        wait for their timeout (504). An entry is also gone once a worker has answered it
        (the reply is written before the entry is deleted, workers/acks.py), or when its deadline rejected it:
        so the entries are looked up first, and those gone count as lost only if no reply has come by the time
        the reader has read past a marker written after that. Sent again in their first order, unbounded (each
        was accepted). One a worker had started before its delivery was lost too is computed twice (the second
        reply dropped); so a decoupled model's request (replies would interleave) and a sequence's (its state
        would take a step twice) keep no payload. False if Redis failed the lookup (`quiet`: not logged)."""
        waiting = [(rid, w, w.entry) for rid, w in self._waiters.items()
                   if w.entry is not None and w.payload is not None and not w.future.done()]
        if not waiting:
            return True
        try:
            pipe = self._client.pipeline(transaction=False)
            for *_, (stream, entry_id) in waiting:
                pipe.xrange(stream, entry_id, entry_id, count=1)
            found = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise_if_cancelled()
            (log.debug if quiet else log.warning)("cannot look for requests Redis lost: %s (looking again)", exc)
            return False
        gone = [(rid, w, entry) for (rid, w, entry), entries in zip(waiting, found, strict=True) if not entries]
        del waiting, found  # the waiters answered meanwhile are not held through the wait below
        if not gone:
            return True
        if not await self._replies.caught_up(self.timeout_s):
            return False
        lost = sorted(((rid, w, entry) for rid, w, entry in gone
                       if self._waiters.get(rid) is w and not w.future.done() and w.entry == entry),
                      key=lambda lost: entry_order(lost[2][1]))
        if not lost or self._stopping:
            return True
        log.warning("%d requests waiting for replies are no longer in Redis, which lost writes it had acknowledged "
                    "(a restart or a failover); sending them again", len(lost))
        start = not self._outbox
        self.resent_requests += len(lost)
        for rid, w, (stream, _) in lost:
            assert w.payload is not None
            w.entry = None  # enqueued anew: its new entry is what a cancel deletes
            self._outbox.append((rid, stream, w.payload, 0, w.future))
        if start:
            self._start_flush()
        return True

    def _enqueued_once(self, batch: list[_Outgoing]) -> bool:
        """Whether `batch` holds a decoupled model's or a sequence's request (`_streamed`, `_on_enqueued`)."""
        once, streamed = self._on_enqueued, self._streamed  # (two empty collections for the usual flush)
        return bool(once or streamed) and any(rid in once or rid in streamed for rid, *_ in batch)

    def _start_flush(self) -> None:
        if self._stopping:
            return  # `stop` fails what the outbox holds
        # Its own context: started by whichever request came first, it carries every request's writes.
        task = (self._loop or asyncio.get_running_loop()).create_task(self._flush(), context=contextvars.Context())
        self._flushes.add(task)  # keep a reference until done (the loop holds tasks weakly)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        # The batch is taken once a link is idle: with all busy, what comes meanwhile goes in one.
        try:
            link = await self._enqueue.take()
        except asyncio.CancelledError:
            # This flush was the outbox's: a request added meanwhile started none (`submit` starts one when
            # the outbox was empty), so another takes them.
            if self._outbox and not self._stopping:
                asyncio.get_running_loop().call_soon(self._start_flush)
            raise
        batch: list[_Outgoing] = []
        try:
            batch, self._outbox = self._outbox, []
            if batch:
                await self._flush_batch(link, batch)
        finally:
            self._enqueue.give(link)
            if self._streamed:  # enqueued: no retry of this flush can send them again now
                self._streamed.difference_update(rid for rid, *_ in batch)
            if self._on_enqueued:  # only sequence requests ask (the usual flush looks up nothing)
                for rid, *_ in batch:
                    done = self._on_enqueued.pop(rid, None)
                    if done is not None:
                        done()

    async def _flush_batch(self, link: RedisLink, batch: list[_Outgoing]) -> None:
        try:
            # EVAL, not EVALSHA: the server caches the compiled body, and a script it lost (a restart) would
            # cost a NOSCRIPT round trip.
            results = await link.execute([
                ("EVAL", BOUNDED_XADD, 1, stream, bound, payload) if bound > 0 else ("XADD", stream, "*", "d", payload)
                for _, stream, payload, bound, _ in batch], once=self._enqueued_once(batch))
        except (RedisError, OSError, asyncio.CancelledError) as exc:
            # Cancelled: the broker is stopping (`stop`), and whether Redis took them is unknown.
            err = BrokerUnavailable(_STOPPING if isinstance(exc, asyncio.CancelledError) else
                                    f"cannot enqueue the request: Redis is not reachable ({exc})")
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._replies.redis_back()  # Redis took these (the reply reader may still be backing off)
        for (rid, stream, _, bound, fut), result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                # This XADD alone was refused (out of memory, a wrong-type key): only its caller fails;
                # the others of the pipeline were enqueued and will be answered.
                if not fut.done():
                    fut.set_exception(BrokerUnavailable(f"cannot enqueue the request: Redis refused it ({result})"))
                continue
            if bound > 0 and result is None:
                if not fut.done():
                    fut.set_exception(QueueFull())
                continue
            waiter = self._waiters.get(rid)
            if waiter is not None:
                waiter.entry = (stream, result)
