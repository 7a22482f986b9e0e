"""The gateway's Redis I/O: enqueue requests on model streams and the one reply reader per process.

Enqueues issued in the same event-loop turn go out as one pipeline (one round trip for many
requests). Replies come back on this gateway's own stream, read by a single task that resolves the
waiting futures by request id: no per-request subscription, no polling. Redis errors become
BrokerUnavailable here, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.envelope import ReplyEnvelope, decode_reply
from fleet.errors import BrokerUnavailable, DeadlineExceeded, QueueFull
from fleet.keys import GROUP, Keys

log = logging.getLogger(__name__)

REPLY_TTL_S = 120  # an abandoned reply stream (dead gateway) disappears after this
SWEEP_S = 0.25  # how often waiters past their timeout are failed

# A bounded lane (max_queue_size): enqueue only while fewer than ARGV[1] requests wait for a worker, in
# the same round trip as the other XADDs. "Waiting" = entries not yet delivered to a worker (the stream
# length less the group's pending count): what a worker has read ahead or is executing is bounded by
# the worker itself, as Triton's queue size excludes executing requests. Returns nil when full.
_BOUNDED_XADD = f"""
local waiting = redis.call('XLEN', KEYS[1])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], '{GROUP}')
if ok then waiting = waiting - pending[1] end
if waiting >= tonumber(ARGV[1]) then return false end
return redis.call('XADD', KEYS[1], '*', 'd', ARGV[2])
"""


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[ReplyEnvelope]
    expires_at: float  # loop time


class Broker:
    def __init__(self, client: aioredis.Redis, reader_client: aioredis.Redis, keys: Keys, gateway_id: str,
                 *, block_ms: int, request_timeout_s: float) -> None:
        self._client = client
        self._reader_client = reader_client
        self.keys = keys
        self.gateway_id = gateway_id
        self.reply_key = keys.reply(gateway_id)
        self._block_ms = block_ms
        self.timeout_s = request_timeout_s
        self._waiters: dict[str, _Waiter] = {}
        self._outbox: list[tuple[str, bytes, int, asyncio.Future[ReplyEnvelope]]] = []
        self._flushes: set[asyncio.Future[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._seq = 0

    def expires_us(self, now_us: int) -> int:
        """When a request sent at `now_us` is of no use any more: this gateway has answered 504 by then
        (its sweep runs every SWEEP_S), so a worker that still holds it drops it instead of computing."""
        return now_us + int((self.timeout_s + SWEEP_S) * 1_000_000)

    def next_id(self) -> str:
        self._seq += 1
        return f"{self.gateway_id}:{self._seq}"

    async def start(self) -> None:
        await self.ping()
        self._tasks = [asyncio.create_task(self._read_replies(), name="reply-reader"),
                       asyncio.create_task(self._sweep(), name="reply-sweeper")]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self._client.delete(self.reply_key)
        except RedisError:
            pass
        await self._client.aclose()
        await self._reader_client.aclose()

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as exc:
            raise BrokerUnavailable(f"Redis is not reachable: {exc}") from exc

    def submit(self, request_id: str, stream: str, payload: bytes,
               max_queue_size: int = 0) -> asyncio.Future[ReplyEnvelope]:
        """Enqueue payload on stream and return the future of its reply.

        The waiter is registered before the XADD is sent, so a fast reply is never missed. XADDs of one
        event-loop turn go out as one pipeline; if Redis cannot take them, their futures fail with
        BrokerUnavailable; past `max_queue_size` (> 0) waiting requests, with QueueFull at once.
        The caller must `forget(request_id)` when done (also on cancellation)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ReplyEnvelope] = loop.create_future()
        self._waiters[request_id] = _Waiter(fut, loop.time() + self.timeout_s)
        self._outbox.append((stream, payload, max_queue_size, fut))
        if len(self._outbox) == 1:
            loop.call_soon(self._start_flush)
        return fut

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    def _start_flush(self) -> None:
        task = asyncio.ensure_future(self._flush())
        self._flushes.add(task)  # keep a reference until done (the loop holds tasks weakly)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        try:
            pipe = self._client.pipeline(transaction=False)
            for stream, payload, bound, _ in batch:
                if bound > 0:
                    # EVAL, not EVALSHA: a pipeline with registered scripts costs a SCRIPT EXISTS
                    # round trip per execute; the server caches the compiled body anyway.
                    pipe.eval(_BOUNDED_XADD, 1, stream, bound, payload)
                else:
                    pipe.xadd(stream, {b"d": payload})
            results = await pipe.execute()
        except (RedisError, OSError) as exc:
            err = BrokerUnavailable(f"cannot enqueue the request: Redis is not reachable ({exc})")
            for _, _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, _, bound, fut), result in zip(batch, results, strict=True):
            if bound > 0 and result is None and not fut.done():
                fut.set_exception(QueueFull())

    async def _read_replies(self) -> None:
        # The stream must exist with its TTL before workers write to it.
        await self._touch_reply_stream()
        last_id = b"0-0"
        next_touch = time.monotonic() + REPLY_TTL_S / 4
        while not self._stopping:
            try:
                pipe = self._reader_client.pipeline(transaction=False)
                if last_id != b"0-0":
                    # Drop what was consumed, piggybacked on the next read: no extra round trip.
                    pipe.xtrim(self.reply_key, minid=last_id, approximate=False)
                pipe.xread({self.reply_key: last_id}, count=1024, block=self._block_ms)
                result = (await pipe.execute())[-1]
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("reply reader: %s; retrying", exc)
                await asyncio.sleep(0.5)
                continue
            for _, entries in result or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    for name, payload in fields.items():  # a worker batches replies: d0, d1, ...
                        if name[:1] == b"d":
                            self._deliver(payload)
            if time.monotonic() > next_touch:
                await self._touch_reply_stream()
                next_touch = time.monotonic() + REPLY_TTL_S / 4

    def _deliver(self, payload: bytes) -> None:
        try:
            reply = decode_reply(payload)
        except Exception:  # a corrupt entry must not stop the reader
            log.exception("dropping an undecodable reply")
            return
        waiter = self._waiters.pop(reply.id, None)
        if waiter is not None and not waiter.future.done():  # duplicates and late replies are dropped
            waiter.future.set_result(reply)

    async def _touch_reply_stream(self) -> None:
        try:
            pipe = self._reader_client.pipeline(transaction=False)
            # An empty stream cannot exist; add and trim a marker so EXPIRE has a key to hold.
            pipe.xadd(self.reply_key, {b"hello": b"1"}, maxlen=100000, approximate=True)
            pipe.expire(self.reply_key, REPLY_TTL_S)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("cannot refresh the reply stream: %s", exc)

    async def _sweep(self) -> None:
        """Fail requests whose reply did not come in time: one timer for all, not one per request."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            now = loop.time()
            expired = [rid for rid, w in self._waiters.items() if w.expires_at <= now]
            for rid in expired:
                waiter = self._waiters.pop(rid)
                if not waiter.future.done():
                    waiter.future.set_exception(
                        DeadlineExceeded(f"no reply from a worker within {self.timeout_s:g}s")
                    )
