"""A Redis connection of its own for the request path: a batch of commands written at once and their
replies read in order, on a connection redis-py opens and the link then reads and writes itself.

A round trip through redis-py's pipeline cost the client ~125 µs of CPU here, against ~35 µs for the same
commands through a link, and ~25 µs for a bare exchange (bench/redis_client.py).
The difference is the pipeline object, the pool's get and release, the retry wrapper, the observability
hooks, the response callbacks, per-reply reads, and the 5 s `socket_timeout` redis-py 8 sets by default,
which puts every send through `asyncio.wait_for` (a task and a timer on Python 3.11). The gateway's enqueue
and reply read and the worker's read and reply write are one round trip each per batch, so they go through
links.

- Commands are packed by hiredis (C), their arguments bytes, memoryview, str, int or float, as redis-py
  takes them; an argument of 32 KiB or more (a tensor's envelope) is written from its own buffer instead
  (the rest of the command packed around it, the same bytes; on uvloop one writev, no copy), and so is an
  argument given as `Parts` (fleet/parts.py: an envelope's head and its tensors' bytes, one bulk string
  never joined). The link keeps a reference to it until it is sent: a caller must not change it meanwhile.
- The connection is made by redis-py with the client's pool settings (the URL's AUTH/ACL user, TLS, unix
  socket; its handshake) but is not in the pool: it is the link's alone, opened on first use. The link
  then writes the commands on its stream and reads the socket itself (a protocol of its own in place of
  redis-py's StreamReader), parsing the replies with a hiredis reader of its own.
- One round trip at a time (callers that batch gather while one is in flight; fleet/link_pool.py keeps a
  few links for a caller that lets a round trip go out while another is on its way). A round trip has one
  deadline, `timeout_s` plus the BLOCK of a blocking read, in place of redis-py's per-send and per-read
  socket timeout (`_Deadline`). Past it, on a connection error, or when the caller is cancelled, the
  connection is closed (its unread replies would otherwise answer the next commands) and the next round
  trip opens another. A reused connection that fails with a connection error (Redis restarted while it
  sat idle, or the connection dropped mid-round-trip) is replaced and the round trip tried once more, as
  redis-py's retry does: as the caller's `resend` says, if it gives one (commands that may have run
  already, marked so). The error raised is redis-py's (ConnectionError,
  TimeoutError: both RedisError), as every caller handles already.
- Replies are Redis's own (RESP2, bytes), without redis-py's response callbacks: an XREAD entry is
  `[id, [field, value, ...]]` (`entry_field` reads one field). An error reply is that command's result, as
  redis-py's parser makes it (a ResponseError, as `execute(raise_on_error=False)` gives it), except the
  ones that say Redis is not serving (LOADING: a ConnectionError), which are raised, as redis-py does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fleet.parts import LONG_BUFFER, Parts

__all__ = ["DEFAULT_TIMEOUT_S", "Command", "RedisLink", "entry_field", "entry_order", "raise_first"]

# A Redis that has not answered a round trip in this long is taken for gone (redis-py's own default
# socket timeout, which the link's connection no longer has).
DEFAULT_TIMEOUT_S = 5.0

Command = Sequence[bytes | memoryview | Parts | str | int | float]
# The buffer a link's socket is read into, then fed to hiredis (whose own buffer grows as a reply needs):
# libuv's own read size. A worker has a few links per model it serves.
_READ_BYTES = 1 << 16
# An argument this long is written from its own buffer (a socket writev) instead of being copied into the
# packed command and then into the round trip's buffer: two copies fewer of a tensor's envelope.
_BIG_ARG = LONG_BUFFER


class _ClosedWhileIdle(RedisConnectionError):
    """The connection was found closed before anything was written on it: nothing of the round trip ran."""


class RedisLink:
    def __init__(self, client: aioredis.Redis, timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_connect: Callable[[int], None] | None = None) -> None:
        self._conn = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        self._conn.socket_timeout = None  # the round trip's one deadline instead
        self._lock = asyncio.Lock()
        self.timeout_s = timeout_s
        # The link writes and reads the connection's streams itself, past redis-py's per-command layers,
        # parsing with a reader of its own, new with each connection.
        self._parser = hiredis.Reader()
        self._replies: _Replies | None = None
        self._deadline = _Deadline()
        # Called with the count of connections made so far each time one is, before its first command: a
        # new one after the first may reach a Redis restarted, or another after a failover.
        self._on_connect = on_connect
        self.connects = 0

    async def execute(self, commands: Sequence[Command], block_ms: int = 0,
                      resend: Callable[[], Sequence[Command]] | None = None, once: bool = False) -> list[Any]:
        """Each command's reply in order (a ResponseError for an error reply). `block_ms`: the longest BLOCK
        among them, added to the deadline. `resend`: what to send instead if the round trip is sent again
        (the same commands, in the same order, marked as possibly run already). `once`: the commands must
        not run twice, so a round trip is sent again only where nothing of it was written."""
        if not commands:
            return []
        deadline_s = self.timeout_s + block_ms / 1000
        packed = [_pack(c) for c in commands]
        async with self._lock:
            reused = self._conn.is_connected
            try:
                return await self._round_trip(packed, len(commands), deadline_s)
            except RedisConnectionError as exc:
                # A reused connection that failed (Redis closed it while it sat idle, or it dropped
                # mid-round-trip): once more on a new one, as redis-py's own retry does. Commands may
                # then run twice if the first attempt reached Redis before it went away, as with
                # redis-py: a request enqueued twice is computed twice and answered once (replies are
                # by id); a batch's statistics go again as copies (`resend`), which count once
                # (fleet/stats.py).
                if not reused or (once and not isinstance(exc, _ClosedWhileIdle)):
                    raise
                if resend is not None:
                    packed = [_pack(c) for c in resend()]
                return await self._round_trip(packed, len(commands), deadline_s)

    async def _round_trip(self, packed: list[bytes | list[Buffer]], count: int, deadline_s: float) -> list[Any]:
        """Write, then read `count` replies; on any failure the connection is closed (what is unread on it
        would answer the next commands) and the error raised, a timeout as redis-py's TimeoutError."""
        conn = self._conn
        deadline = self._deadline
        try:
            if not conn.is_connected:
                async with asyncio.timeout(deadline_s):  # rare: the first round trip, or after a failure
                    await conn.connect_check_health(check_health=False)  # AUTH, SELECT, TLS: redis-py's
                self.connects += 1
                if self._on_connect is not None:
                    self._on_connect(self.connects)
                # redis-py's own mapping of error replies to its exceptions, and its error for a garbled
                # stream (what its hiredis parser passes too): callers handle RedisError.
                self._parser = hiredis.Reader(protocolError=InvalidResponse, replyError=BaseParser.parse_error)
            writer = conn._writer
            assert writer is not None, "connected above"
            replies = self._replies
            if replies is None or replies.writer is not writer:  # a new connection: read by the link from now on
                replies = self._replies = _Replies.attach(writer, self._parser)
            if replies.ended or writer.transport.is_closing():  # Redis closed it while it sat idle
                raise _ClosedWhileIdle("Connection closed by server.")
            deadline.start(deadline_s, writer.transport, replies.loop)
            try:
                if all(isinstance(p, bytes) for p in packed):
                    writer.write(b"".join(packed) if len(packed) > 1 else packed[0])  # type: ignore[arg-type]
                else:  # long arguments as their own buffers, one writev
                    writer.writelines([b for p in packed for b in ((p,) if isinstance(p, bytes) else p)])
                return await self._read(replies, count)
            finally:
                deadline.stop()
        except TimeoutError:
            await conn.disconnect(nowait=True)
            raise RedisTimeoutError(f"Redis did not answer within {deadline_s:g}s") from None
        except OSError as exc:  # a reset, a broken pipe: as redis-py words a failed socket
            await conn.disconnect(nowait=True)
            if deadline.expired:
                raise RedisTimeoutError(f"Redis did not answer within {deadline_s:g}s") from None
            raise RedisConnectionError(f"Error while talking to Redis: {exc}") from None
        except BaseException:
            await conn.disconnect(nowait=True)
            raise

    async def _read(self, replies: _Replies, count: int) -> list[Any]:
        try:
            got = await replies.next(count)
        except _Closed as closed:
            if self._deadline.expired:  # it closed the connection: that is the timeout
                raise TimeoutError from None
            if closed.args and closed.args[0] is not None:  # a reset: as redis-py words a failed socket
                raise RedisConnectionError(f"Error while talking to Redis: {closed.args[0]}") from None
            raise RedisConnectionError("Connection closed by server.") from None
        for reply in got:
            if isinstance(reply, RedisConnectionError):
                raise reply  # LOADING and the like: Redis is not serving (redis-py raises these too)
        return got

    async def aclose(self) -> None:
        await self._conn.disconnect()


Buffer = bytes | memoryview


class _Closed(Exception):
    """The connection ended while a round trip waited for its replies (args: the socket's error, if any)."""


class _Replies(asyncio.BufferedProtocol):
    """What reads the link's connection once redis-py has opened it: the socket is read straight into one
    buffer and fed to the hiredis reader, and a round trip's replies are handed over once all have come.

    Through redis-py's StreamReader, each byte of a reply was copied twice more (into the reader's buffer,
    then out of it) and each read was a coroutine's wake-up; 588 KiB replies (an image) made that visible.
    redis-py's own protocol is told when the connection ends, so its disconnect() sees the close."""

    def __init__(self, writer: asyncio.StreamWriter, parser: hiredis.Reader) -> None:
        self.writer = writer
        self.loop = asyncio.get_running_loop()  # (looked up once: on Python 3.11 each lookup is a getpid())
        self._parser = parser
        self._streams: asyncio.BaseProtocol = writer.transport.get_protocol()
        self._buffer = memoryview(bytearray(_READ_BYTES))
        self._got: list[Any] = []
        self._count = 0
        self._waiter: asyncio.Future[list[Any]] | None = None
        self._failed: BaseException | None = None  # the connection ended, or its bytes were not RESP

    @classmethod
    def attach(cls, writer: asyncio.StreamWriter, parser: hiredis.Reader) -> _Replies:
        replies = cls(writer, parser)
        writer.transport.set_protocol(replies)
        return replies

    async def next(self, count: int) -> list[Any]:
        """The next `count` replies (raises _Closed if the connection ends first)."""
        self._got, self._count = [], count
        self._collect()
        if len(self._got) < count:
            if self._failed is not None:
                raise self._failed
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        got, self._got = self._got, []  # not held past the round trip (an idle link would keep its payloads)
        return got

    def _collect(self) -> None:
        got, parser = self._got, self._parser
        try:
            while len(got) < self._count:
                reply = parser.gets()
                if reply is False:
                    return
                got.append(reply)
        except Exception as exc:  # a garbled stream: redis-py's InvalidResponse
            self._fail(exc)
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(got)

    def _fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._parser.feed(self._buffer[:nbytes])  # type: ignore[arg-type]  # (any buffer: hiredis copies it)
        if self._waiter is not None:
            self._collect()

    @property
    def ended(self) -> bool:
        """Whether Redis closed the connection (or its bytes were not RESP): no more replies will come."""
        return self._failed is not None

    def eof_received(self) -> bool:
        self._fail(_Closed())
        return False  # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(_Closed(exc))
        self._streams.connection_lost(exc)

    def pause_writing(self) -> None:
        self._streams.pause_writing()

    def resume_writing(self) -> None:
        self._streams.resume_writing()


def _long(arg: object) -> bool:
    """Whether `arg` is written from its own buffer (its size in bytes: a view's elements may be wider)."""
    t = type(arg)
    if t is bytes:
        return len(arg) >= _BIG_ARG  # type: ignore[arg-type]
    return t is memoryview and arg.nbytes >= _BIG_ARG  # type: ignore[attr-defined]


def _pack(command: Command) -> bytes | list[Buffer]:
    """A command in RESP: packed by hiredis (C: the same bytes as redis-py's, at a seventh of its cost), or,
    with an argument of _BIG_ARG bytes or more, as a list of buffers in which that argument is itself."""
    # Inlined, not any(_long(a) ...): per command on the request path, where that doubled hiredis's cost.
    for arg in command:
        t = type(arg)
        if (t is bytes and len(arg) >= _BIG_ARG) or (t is memoryview and arg.nbytes >= _BIG_ARG) or t is Parts:  # type: ignore[arg-type,union-attr]
            break
    else:
        # (hiredis's stub types the argument as a 1-tuple; any length is taken.)
        packed: bytes = hiredis.pack_command(command if isinstance(command, tuple) else tuple(command))  # type: ignore[arg-type]
        return packed
    pieces: list[Buffer] = []
    head = [b"*%d\r\n" % len(command)]
    for arg in command:
        if type(arg) is Parts:  # one bulk string from several buffers (fleet/parts.py: bytes or byte views)
            head.append(b"$%d\r\n" % arg.nbytes)
            pieces += [b"".join(head), *arg]
            head = [b"\r\n"]
            continue
        if _long(arg):
            if isinstance(arg, memoryview) and (arg.format != "B" or arg.ndim != 1 or not arg.c_contiguous):
                # bytes, as the socket takes them (a view that is not C-contiguous is copied)
                arg = arg.cast("B") if arg.c_contiguous else bytes(arg)
            head.append(b"$%d\r\n" % len(arg))  # type: ignore[arg-type]
            pieces += [b"".join(head), arg]  # type: ignore[list-item]
            head = [b"\r\n"]
            continue
        if isinstance(arg, memoryview):
            arg = bytes(arg)
        elif isinstance(arg, str):
            arg = arg.encode()
        elif type(arg) is int:
            arg = b"%d" % arg
        elif type(arg) is float:
            arg = repr(arg).encode()  # as redis-py's encoder and hiredis write a float
        elif not isinstance(arg, bytes):
            raise TypeError(f"a Redis command's arguments are str, int, float or bytes, not {type(arg).__name__}")
        head.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    pieces.append(b"".join(head))
    return pieces


class _Deadline:
    """The deadline of a link's round trip, on one timer that outlives round trips.

    A timer per round trip (asyncio.timeout, a libuv timer armed and closed) cost ~10 µs of a round trip's
    ~45 here. This one fires at the deadline it was armed for; finding the round trip then in flight due
    later (a later one), it re-arms for that: a busy link re-arms about once per timeout, an idle one not
    at all. Past the deadline it aborts the connection, so the read waiting on it ends (as end of stream)
    and the link reports a timeout.
    """

    __slots__ = ("_loop", "_timer", "_at", "_transport", "expired")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None  # the timer's (a link outlives no loop, but a test's may)
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0
        self._transport: asyncio.WriteTransport | None = None  # of the round trip in flight
        self.expired = False

    def start(self, seconds: float, transport: asyncio.WriteTransport, loop: asyncio.AbstractEventLoop) -> None:
        self._at = at = loop.time() + seconds
        self._transport = transport
        self.expired = False
        if self._timer is None or self._timer.when() > at or self._loop is not loop:
            # None armed, one armed for later than this, or one on another loop (which will never fire).
            if self._timer is not None:
                self._timer.cancel()
            self._arm(loop, at)

    def stop(self) -> None:
        self._transport = None

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self._loop = loop
        self._timer = loop.call_at(at, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        transport = self._transport
        if transport is None:
            return  # nothing in flight: disarmed until the next round trip
        if loop.time() < self._at:
            self._arm(loop, self._at)
            return
        self.expired = True
        transport.abort()


def raise_first(replies: list[Any]) -> list[Any]:
    """`replies`, once none is an error reply (the first one is raised): as redis-py's `execute()`."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


def entry_order(entry_id: bytes) -> tuple[int, int]:
    """A stream entry's place in its stream (its id's two numbers)."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


def entry_field(fields: list[bytes] | None, name: bytes) -> bytes | None:
    """Field `name` of a stream entry's raw field list (None for an entry deleted since it was delivered)."""
    if fields:
        for i in range(0, len(fields) - 1, 2):
            if fields[i] == name:
                return fields[i + 1]
    return None
