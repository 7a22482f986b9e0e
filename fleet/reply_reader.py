"""The reply side of a broker (fleet/broker.py): the callers waiting for a reply, the one task per process
that reads replies off the process's own stream and resolves their futures by request id (no
per-request subscription, no polling), and the sweep that fails callers whose reply did not come in
time, or all of them once Redis has been away too long.

The reader starts after a marker written at start: what is older was written for an earlier process with
the same id (its request ids carry another nonce, so it could never be taken for a reply of ours)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.backoff import Backoff
from fleet.cancellation import raise_if_cancelled
from fleet.envelope import ReplyEnvelope, readable_reply
from fleet.errors import BrokerUnavailable, DeadlineExceeded
from fleet.parts import Parts
from fleet.redis_link import Command, RedisLink, entry_order, raise_first
from fleet.redis_time import RedisClock
from fleet.trace_points import REPLY_RECEIVED

log = logging.getLogger(__name__)

REPLY_TTL_S = 120  # an abandoned reply stream (dead gateway) disappears after this
SWEEP_S = 0.25  # how often waiters past their timeout are failed
CLOCK_SAMPLE_EVERY = 8  # sweeps between two samples of Redis's clock (2 s)


@dataclass(slots=True)
class Waiter:
    future: asyncio.Future[ReplyEnvelope]
    expires_at: float  # loop time
    model: str = ""
    entry: tuple[str, bytes] | None = None  # (stream, entry id) once enqueued: what a cancel deletes
    version: int = 0
    enqueued_us: int = 0  # Redis's clock
    # A decoupled model's request: `future` gets the first reply, this queue each later one, until the
    # final one (which retires the waiter). None for the usual one reply.
    more: asyncio.Queue[ReplyEnvelope] | None = None
    # What was enqueued, kept until the reply: sent again if Redis lost it (Broker._send_lost_again).
    payload: bytes | Parts | None = None


# A waiter the sweep gave up on whose request may still sit unread in its stream: the broker deletes it.
Abandoned = Callable[[str, Waiter], None]


class ReplyReader:
    def __init__(self, client: aioredis.Redis, reader_client: aioredis.Redis, reply_key: str, *, block_ms: int,
                 timeout_s: float, outage_s: float, redis_clock: RedisClock, abandoned: Abandoned,
                 back: Callable[[], None] | None = None) -> None:
        self._client = client  # pings and clock samples, off the reply read's own connection
        self._reader_client = reader_client
        # The request path's reply read, on a connection of its own.
        self._link = RedisLink(reader_client, on_connect=self._connected)
        self.reply_key = reply_key
        self._block_ms = block_ms
        self.timeout_s = timeout_s
        self.outage_s = outage_s
        self._redis_clock = redis_clock
        self._abandoned = abandoned
        self.waiters: dict[str, Waiter] = {}
        self.unclaimed = 0  # replies nobody waited for any more: duplicates or late; dropped
        self._down_since: float | None = None  # loop time Redis was first seen unreachable, if it is now
        self._back = asyncio.Event()  # an enqueue worked while the reader was backing off
        self._start_id: bytes | None = None  # the reply stream's marker written by mark_start()
        self._back_again = back  # called when the reader's connection is made anew
        # Markers written by caught_up(), each with what is told once the reader has read past it.
        self._marks: list[tuple[tuple[int, int], asyncio.Future[None]]] = []
        self._last_read = b"0-0"  # the id of the last entry the reader has read
        self.stopping = False

    def _connected(self, connects: int) -> None:
        # A new connection after the first (an outage, or Redis back within the round trip): it may reach a
        # Redis restarted, or another after a failover, either of which may have lost acknowledged writes.
        if connects > 1 and self._back_again is not None:
            self._back_again()

    def redis_back(self) -> None:
        """Redis took an enqueue: it is back, whatever the reader (maybe still backing off) thinks."""
        if self._down_since is not None:
            self._down_since = None
            self._back.set()

    async def mark_start(self) -> None:
        """Write the marker the reader starts after, before any request can be submitted: a request
        submitted at once (a worker's first BLS call starts its broker on demand) must not have its first
        reply land before the marker, where the reader would skip it."""
        try:
            self._start_id = await asyncio.wait_for(self._touch(), 2.0)
        except TimeoutError:
            self._start_id = None

    async def read(self) -> None:
        # The stream must exist with its TTL before workers write to it. Reading starts after the marker
        # written now: what is older was written for an earlier process with this gateway id (its ids
        # carry another nonce, so it could never be taken for a reply of ours; it is just skipped). If
        # Redis is away at start, from the beginning: a reply must never be missed.
        last_id = self._start_id or await self._touch() or b"0-0"
        self._start_id = None  # a restarted reader starts after a new marker
        next_touch = time.monotonic() + REPLY_TTL_S / 4
        backoff = Backoff()
        loop = asyncio.get_running_loop()
        while not self.stopping:
            try:
                commands: list[Command] = []
                if last_id != b"0-0":
                    # Drop what was consumed, piggybacked on the next read: no extra round trip.
                    commands.append(("XTRIM", self.reply_key, "MINID", last_id))
                commands.append(("XREAD", "COUNT", 1024, "BLOCK", self._block_ms, "STREAMS", self.reply_key, last_id))
                *_, result = raise_first(await self._link.execute(commands, block_ms=self._block_ms))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                if self._down_since is None:
                    self._down_since = loop.time()
                delay = backoff.next_delay()
                log.warning("reply reader: %s; retrying in %.2f s", exc, delay)
                self._back.clear()
                try:
                    async with asyncio.timeout(delay):
                        await self._back.wait()
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
            self._last_read = last_id
            if self._marks and result:
                self._passed()
            if result:
                # Let the callers answered now write their responses before the next read is written (it
                # wakes Valkey, 40-95 µs on this VM, which would otherwise sit in a lone request's path):
                # one turn for their handlers, one for the writes they leave to the end of their turn (the
                # gRPC server's frames, gateway/grpc/server.py).
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            if time.monotonic() > next_touch:
                await self._touch()
                next_touch = time.monotonic() + REPLY_TTL_S / 4

    def _deliver(self, payload: bytes) -> None:
        reply = readable_reply(payload, "a reply")  # a corrupt entry must not stop the reader
        if reply is None:
            return
        if reply.trace is not None:
            reply.trace[REPLY_RECEIVED] = self._redis_clock.now_ns()
        waiter = self.waiters.get(reply.id)
        if waiter is not None and waiter.more is not None:
            if reply.final:
                self.waiters.pop(reply.id, None)
            else:
                waiter.expires_at = asyncio.get_running_loop().time() + self.timeout_s
            if not waiter.future.done():
                waiter.future.set_result(reply)
            else:
                waiter.more.put_nowait(reply)
            return
        waiter = self.waiters.pop(reply.id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(reply)
        else:
            self.unclaimed += 1  # a duplicate or a late reply: dropped

    async def caught_up(self, timeout_s: float) -> bool:
        """Whether the reader has read every reply written before this call, within `timeout_s`: a marker is
        added to the reply stream and waited for. False if Redis is away or the reader is not there in time."""
        marker = await self._touch()
        if marker is None:
            return False
        mark: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._marks.append((entry_order(marker), mark))
        self._passed()  # the reader may have read it before the XADD's own reply came back
        try:
            async with asyncio.timeout(timeout_s):
                await mark
            return True
        except TimeoutError:
            return False
        finally:
            self._marks = [(m, f) for m, f in self._marks if f is not mark]

    def _passed(self) -> None:
        last = entry_order(self._last_read)
        for marker, mark in self._marks:
            if marker <= last and not mark.done():
                mark.set_result(None)

    async def _touch(self) -> bytes | None:
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

    async def sweep(self) -> None:
        """Fail requests whose reply did not come in time: one timer for all, not one per request."""
        loop = asyncio.get_running_loop()
        sweeps = 0
        while True:
            await asyncio.sleep(SWEEP_S)
            sweeps += 1
            if sweeps % CLOCK_SAMPLE_EVERY == 0 and self._down_since is None:
                try:
                    async with asyncio.timeout(1.0):
                        await self._redis_clock.sample(self._client)
                except (RedisError, OSError, TimeoutError):
                    raise_if_cancelled()
                    # The reader notices an outage; the last estimate stays.
            now = loop.time()
            down_s = None if self._down_since is None else now - self._down_since
            if down_s is not None and down_s > self.outage_s and await self._reachable():
                self._down_since = down_s = None  # back, and the reply reader is about to notice
                self._back.set()
            if down_s is not None and down_s > self.outage_s:
                # Redis has been away too long: fail what waits now (503, retry elsewhere) instead of
                # holding every caller to its full timeout.
                expired = list(self.waiters)
            else:
                expired = [rid for rid, w in self.waiters.items() if w.expires_at <= now]
            for rid in expired:
                waiter = self.waiters.pop(rid)
                if waiter.future.done():
                    if waiter.more is not None:  # a stream that stopped short of its final reply
                        waiter.more.put_nowait(ReplyEnvelope(
                            id=rid, model_version=waiter.version, error_code="DEADLINE_EXCEEDED",
                            error_message=f"no further response from a worker within {self.timeout_s:g}s"))
                        self._abandoned(rid, waiter)
                    continue
                if down_s is not None:
                    err: Exception = BrokerUnavailable(
                        f"Redis has been unreachable for {down_s:.1f}s; the request may not have been served")
                else:
                    err = DeadlineExceeded(f"no reply from a worker within {self.timeout_s:g}s")
                    self._abandoned(rid, waiter)  # not computed, if no worker has started it
                waiter.future.set_exception(err)

    def fail_waiting(self, message: str) -> None:
        """Answer every request still waiting with UNAVAILABLE `message`: the reader has stopped, so nothing
        else would (a stream past its first reply gets it as its last response)."""
        for rid in list(self.waiters):
            waiter = self.waiters.pop(rid)
            if not waiter.future.done():
                waiter.future.set_exception(BrokerUnavailable(message))
            elif waiter.more is not None:
                waiter.more.put_nowait(ReplyEnvelope(id=rid, model_version=waiter.version,
                                                     error_code=BrokerUnavailable.code.value, error_message=message))

    async def aclose(self) -> None:
        await self._link.aclose()
