"""Calling models through Redis: enqueue requests on model streams and the one reply reader per process.
A gateway's data plane uses it, and so does a worker whose Python models call other models (BLS,
workers/bls.py); "gateway" below stands for either caller, its id for the worker's id in a worker.

Enqueues go out as one batch per round trip (many requests in one), one round trip at a time on a
connection of the broker's own (fleet/redis_link.py): those issued while one is in flight go in the next,
in order; each command's own result decides its request's fate, so one refused XADD fails only its own
caller (the others were enqueued and will be answered). Replies come back on this gateway's own
stream, read by a single task that resolves the waiting futures by request id: no per-request
subscription, no polling. Request ids carry a nonce drawn at each start, so a gateway restarted with
the same FLEET_GATEWAY_ID never takes an old reply for a new request; its reader starts after a marker
it writes at start. Redis errors become BrokerUnavailable here, once. The broker also keeps this
process's estimate of Redis's clock (fleet/redis_time.py), the time base of every envelope.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.backoff import Backoff
from fleet.cancellation import cancel_and_wait, raise_if_cancelled
from fleet.envelope import ReplyEnvelope, readable_reply
from fleet.errors import BrokerUnavailable, DeadlineExceeded, QueueFull, RequestTimeout
from fleet.keys import Keys
from fleet.lane_scripts import BOUNDED_XADD, REJECT_UNREAD
from fleet.parts import Parts
from fleet.redis_clients import unrecoverable
from fleet.redis_link import Command, RedisLink, raise_first
from fleet.redis_time import RedisClock
from fleet.stats import BatchSample, increments
from fleet.supervision import Supervisor
from fleet.trace_points import REPLY_RECEIVED

log = logging.getLogger(__name__)

# A request waiting for the next flush: (request id, stream, payload, max queue size, its reply's future).
_Outgoing = tuple[str, str, bytes | Parts, int, asyncio.Future[ReplyEnvelope]]

REPLY_TTL_S = 120  # an abandoned reply stream (dead gateway) disappears after this
SWEEP_S = 0.25  # how often waiters past their timeout are failed
CLOCK_SAMPLE_EVERY = 8  # sweeps between two samples of Redis's clock (2 s)

REJECT_RETRY_S = 0.005  # the request's XADD has not come back yet: look again this soon


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[ReplyEnvelope]
    expires_at: float  # loop time
    model: str = ""
    entry: tuple[str, bytes] | None = None  # (stream, entry id) once enqueued: what a cancel deletes
    version: int = 0
    enqueued_us: int = 0  # Redis's clock
    # A decoupled model's request: `future` gets the first reply, this queue each later one, until the
    # final one (which retires the waiter). None for the usual one reply.
    more: asyncio.Queue[ReplyEnvelope] | None = None


class Broker:
    def __init__(self, client: aioredis.Redis, reader_client: aioredis.Redis, keys: Keys, gateway_id: str,
                 *, block_ms: int, request_timeout_s: float, outage_s: float = 5.0,
                 on_give_up: Callable[[str, BaseException], None] | None = None) -> None:
        self._client = client
        self._reader_client = reader_client
        # The request path's two round trips, each on a connection of its own: enqueue and reply read.
        self._enqueue = RedisLink(client)
        self._replies = RedisLink(reader_client)
        self._enqueue_lock = asyncio.Lock()
        self.keys = keys
        self.gateway_id = gateway_id
        self.reply_key = keys.reply(gateway_id)
        self._block_ms = block_ms
        self.timeout_s = request_timeout_s
        self.outage_s = outage_s
        self._down_since: float | None = None  # loop time Redis was first seen unreachable, if it is now
        self.unclaimed_replies = 0  # replies nobody waited for any more: duplicates or late; dropped
        self._redis_back = asyncio.Event()  # an enqueue worked while the reply reader was backing off
        self._waiters: dict[str, _Waiter] = {}
        self._outbox: list[_Outgoing] = []
        self._flushes: set[asyncio.Future[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._start_id: bytes | None = None  # the reply stream's marker written by start()
        # Request id -> called once its XADD has come back (taken or not): a sequence's next request is
        # enqueued only then, since XADDs of different flushes may reach Redis in any order
        # (gateway/sequences.py).
        self._on_enqueued: dict[str, Callable[[], None]] = {}
        self._seq = 0
        self._boot = uuid.uuid4().hex[:8]  # request ids are unique across restarts with a fixed gateway id
        self.redis_clock = RedisClock()
        self.supervisor = Supervisor(f"gateway {gateway_id}", on_give_up=on_give_up)

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
        try:
            await asyncio.wait_for(self.redis_clock.calibrate(self._client), 2.0)
        except (RedisError, OSError, TimeoutError) as exc:
            if unrecoverable(exc):  # credentials, ACL, TLS: waiting does not fix it
                raise BrokerUnavailable(f"Redis refuses this gateway: {exc}") from exc
            log.warning("Redis is not reachable yet (%s); the gateway starts and waits for it", exc)
        # The marker the reader starts after is written before start() returns: a request submitted at
        # once (a worker's first BLS call starts its broker on demand) must not have its first reply
        # land before the marker, where the reader would skip it.
        try:
            self._start_id = await asyncio.wait_for(self._touch_reply_stream(), 2.0)
        except TimeoutError:
            self._start_id = None
        self._tasks = [self.supervisor.start("reply-reader", self._read_replies),
                       self.supervisor.start("reply-sweeper", self._sweep)]

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._tasks, f"gateway {self.gateway_id} broker")
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
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ReplyEnvelope] = loop.create_future()
        self._waiters[request_id] = _Waiter(fut, loop.time() + self.timeout_s, model, version=version,
                                            enqueued_us=enqueued_us, more=asyncio.Queue() if streamed else None)
        if on_enqueued is not None:
            self._on_enqueued[request_id] = on_enqueued
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

    async def _reject_unread(self, request_id: str, waiter: _Waiter) -> None:
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

    def _cancel_waiter(self, request_id: str, waiter: _Waiter) -> None:
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

    def _start_flush(self) -> None:
        # Its own context: started by whichever request came first, it carries every request's writes.
        task = asyncio.get_running_loop().create_task(self._flush(), context=contextvars.Context())
        self._flushes.add(task)  # keep a reference until done (the loop holds tasks weakly)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        # The batch is taken once the previous round trip is back: what came meanwhile goes in one.
        async with self._enqueue_lock:
            batch, self._outbox = self._outbox, []
            if not batch:
                return
            try:
                await self._flush_batch(batch)
            finally:
                if self._on_enqueued:  # only sequence requests ask (the usual flush looks up nothing)
                    for rid, *_ in batch:
                        done = self._on_enqueued.pop(rid, None)
                        if done is not None:
                            done()

    async def _flush_batch(self, batch: list[_Outgoing]) -> None:
        try:
            # EVAL, not EVALSHA: the server caches the compiled body, and a script it lost (a restart) would
            # cost a NOSCRIPT round trip.
            results = await self._enqueue.execute([
                ("EVAL", BOUNDED_XADD, 1, stream, bound, payload) if bound > 0 else ("XADD", stream, "*", "d", payload)
                for _, stream, payload, bound, _ in batch])
        except (RedisError, OSError) as exc:
            err = BrokerUnavailable(f"cannot enqueue the request: Redis is not reachable ({exc})")
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        if self._down_since is not None:
            self._down_since = None  # Redis took these: it is back (the reply reader may still be waiting)
            self._redis_back.set()
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

    async def _read_replies(self) -> None:
        # The stream must exist with its TTL before workers write to it. Reading starts after the marker
        # written now: what is older was written for an earlier process with this gateway id (its ids
        # carry another nonce, so it could never be taken for a reply of ours; it is just skipped). If
        # Redis is away at start, from the beginning: a reply must never be missed.
        last_id = self._start_id or await self._touch_reply_stream() or b"0-0"
        self._start_id = None  # a restarted reader starts after a new marker
        next_touch = time.monotonic() + REPLY_TTL_S / 4
        backoff = Backoff()
        loop = asyncio.get_running_loop()
        while not self._stopping:
            try:
                commands: list[Command] = []
                if last_id != b"0-0":
                    # Drop what was consumed, piggybacked on the next read: no extra round trip.
                    commands.append(("XTRIM", self.reply_key, "MINID", last_id))
                commands.append(("XREAD", "COUNT", 1024, "BLOCK", self._block_ms, "STREAMS", self.reply_key, last_id))
                *_, result = raise_first(await self._replies.execute(commands, block_ms=self._block_ms))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                if self._down_since is None:
                    self._down_since = loop.time()
                delay = backoff.next_delay()
                log.warning("reply reader: %s; retrying in %.2f s", exc, delay)
                self._redis_back.clear()
                try:
                    async with asyncio.timeout(delay):
                        await self._redis_back.wait()
                except TimeoutError:
                    pass
                continue
            if backoff.attempt:
                log.warning("reply reader: reading replies again")
                self._down_since = None
                backoff.reset()
            for _, entries in result or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    for i in range(0, len(fields or ()) - 1, 2):  # a worker batches replies: d0, d1, ...
                        if fields[i][:1] == b"d":
                            self._deliver(fields[i + 1])
            if result:
                # Let the callers answered now write their responses before the next read is written (it
                # wakes Valkey, 40-95 µs on this VM, which would otherwise sit in a lone request's path):
                # one turn for their handlers, one for the writes they leave to the end of their turn (the
                # gRPC server's frames, gateway/grpc/server.py).
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            if time.monotonic() > next_touch:
                await self._touch_reply_stream()
                next_touch = time.monotonic() + REPLY_TTL_S / 4

    def _deliver(self, payload: bytes) -> None:
        reply = readable_reply(payload, "a reply")  # a corrupt entry must not stop the reader
        if reply is None:
            return
        if reply.trace is not None:
            reply.trace[REPLY_RECEIVED] = self.redis_clock.now_ns()
        waiter = self._waiters.get(reply.id)
        if waiter is not None and waiter.more is not None:
            if reply.final:
                self._waiters.pop(reply.id, None)
            else:
                waiter.expires_at = asyncio.get_running_loop().time() + self.timeout_s
            if not waiter.future.done():
                waiter.future.set_result(reply)
            else:
                waiter.more.put_nowait(reply)
            return
        waiter = self._waiters.pop(reply.id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(reply)
        else:
            self.unclaimed_replies += 1  # a duplicate or a late reply: dropped

    async def _touch_reply_stream(self) -> bytes | None:
        """Add a marker entry and refresh the TTL; returns the marker's id (None if Redis is away)."""
        try:
            pipe = self._reader_client.pipeline(transaction=False)
            # An empty stream cannot exist; add and trim a marker so EXPIRE has a key to hold.
            pipe.xadd(self.reply_key, {b"hello": b"1"}, maxlen=100000, approximate=True)
            pipe.expire(self.reply_key, REPLY_TTL_S)
            marker, _ = await pipe.execute()
            return bytes(marker)
        except (RedisError, OSError) as exc:
            log.warning("cannot refresh the reply stream: %s", exc)
            return None

    async def _reachable(self) -> bool:
        try:
            async with asyncio.timeout(1.0):
                await self._client.ping()
            return True
        except (RedisError, OSError, TimeoutError):
            raise_if_cancelled()
            return False

    async def _sweep(self) -> None:
        """Fail requests whose reply did not come in time: one timer for all, not one per request."""
        loop = asyncio.get_running_loop()
        sweeps = 0
        while True:
            await asyncio.sleep(SWEEP_S)
            sweeps += 1
            if sweeps % CLOCK_SAMPLE_EVERY == 0 and self._down_since is None:
                try:
                    async with asyncio.timeout(1.0):
                        await self.redis_clock.sample(self._client)
                except (RedisError, OSError, TimeoutError):
                    raise_if_cancelled()
                    # The reader notices an outage; the last estimate stays.
            now = loop.time()
            down_s = None if self._down_since is None else now - self._down_since
            if down_s is not None and down_s > self.outage_s and await self._reachable():
                self._down_since = down_s = None  # back, and the reply reader is about to notice
                self._redis_back.set()
            if down_s is not None and down_s > self.outage_s:
                # Redis has been away too long: fail what waits now (503, retry elsewhere) instead of
                # holding every caller to its full timeout.
                expired = list(self._waiters)
            else:
                expired = [rid for rid, w in self._waiters.items() if w.expires_at <= now]
            for rid in expired:
                waiter = self._waiters.pop(rid)
                if waiter.future.done():
                    if waiter.more is not None:  # a stream that stopped short of its final reply
                        waiter.more.put_nowait(ReplyEnvelope(
                            id=rid, model_version=waiter.version, error_code="DEADLINE_EXCEEDED",
                            error_message=f"no further response from a worker within {self.timeout_s:g}s"))
                        self._cancel_waiter(rid, waiter)
                    continue
                if down_s is not None:
                    err: Exception = BrokerUnavailable(
                        f"Redis has been unreachable for {down_s:.1f}s; the request may not have been served")
                else:
                    err = DeadlineExceeded(f"no reply from a worker within {self.timeout_s:g}s")
                    self._cancel_waiter(rid, waiter)  # not computed, if no worker has started it
                waiter.future.set_exception(err)
