"""One gRPC call on one HTTP/2 stream: request metadata, length-prefixed messages (compressed or not),
the deadline, and the response (headers, messages, trailers with grpc-status), per gRPC's
PROTOCOL-HTTP2 document.

A unary call runs its handler once the client has half-closed with exactly one message; a streaming
call runs at once and is fed messages as they arrive. A call ends exactly once: answered, failed with
a status, reset by the client (nothing more is sent), or cut short by its deadline (DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import asyncio
import logging
import re
import struct
import zlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from gateway.grpc import header_codec as hc
from gateway.grpc.handlers import Method, RpcError
from gateway.grpc.status_codes import StatusCode

if TYPE_CHECKING:
    from gateway.grpc.server import GrpcConnection

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">BI")
_TIMEOUT = re.compile(rb"^(\d{1,8})([HMSmun])$")
_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
ACCEPTED_ENCODINGS = (b"identity", b"deflate", b"gzip")

_STATUS_200 = hc.indexed(b":status", b"200")
_CONTENT_TYPE = hc.literal(b"content-type", b"application/grpc")
_ACCEPT = hc.literal(b"grpc-accept-encoding", b",".join(ACCEPTED_ENCODINGS))
RESPONSE_HEADERS = _STATUS_200 + _CONTENT_TYPE + _ACCEPT
OK_TRAILERS = hc.literal(b"grpc-status", b"0")
MAX_STATUS_MESSAGE = 2048  # characters of grpc-message (gRPC C-core's default metadata limit is 8 KiB)


def _status(code: StatusCode) -> bytes:
    return str(int(code)).encode()


def percent_encode(message: str) -> bytes:
    """grpc-message's encoding: printable ASCII other than '%' as is, every other byte as %XX."""
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout ("100m", "5S", ...) in seconds; None if malformed (then there is no deadline)."""
    match = _TIMEOUT.match(value)
    if match is None:
        return None
    return int(match.group(1)) * _UNITS[match.group(2)]


def compress(data: bytes, encoding: bytes) -> bytes:
    if encoding == b"gzip":
        c = zlib.compressobj(wbits=31)
        return c.compress(data) + c.flush()
    return zlib.compress(data)  # deflate: gRPC's is zlib-wrapped


def decompress(data: bytes, encoding: bytes, limit: int) -> bytes:
    """`data` decompressed, refusing more than `limit` bytes (a zip bomb stops at the limit)."""
    if encoding not in (b"gzip", b"deflate"):
        raise RpcError(StatusCode.UNIMPLEMENTED,
                       f"Compression algorithm '{encoding.decode('latin-1')}' is not supported")
    d = zlib.decompressobj(wbits=31 if encoding == b"gzip" else 15)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise RpcError(StatusCode.INTERNAL, f"Failed to decompress the message: {exc}") from None
    if len(out) <= limit and not d.eof:
        raise RpcError(StatusCode.INTERNAL, "Failed to decompress the message: it is truncated")
    if len(out) > limit:
        raise RpcError(StatusCode.RESOURCE_EXHAUSTED,
                       f"Received message larger than max (more than {limit} bytes once decompressed)")
    return out


class Call:
    """A StreamSink (gateway/grpc/h2.py) and the handlers' CallContext."""

    __slots__ = ("_conn", "_stream_id", "_method", "_headers", "_buffer", "_messages", "_queue", "_task",
                 "_deadline", "_timer", "_ended", "_expired", "_encoding", "_response_encoding",
                 "_half_closed", "_sent_headers", "__weakref__")

    def __init__(self, conn: GrpcConnection, stream_id: int, method: Method | None,
                 headers: list[tuple[bytes, bytes]], timeout: bytes | None, encoding: bytes,
                 response_encoding: bytes | None) -> None:
        self._conn = conn
        self._stream_id = stream_id
        self._method = method
        self._headers = headers
        self._buffer = bytearray()
        self._messages: list[bytes] = []
        self._queue: asyncio.Queue[bytes | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._ended = False
        self._expired = False
        self._half_closed = False
        self._sent_headers = False
        self._encoding = encoding
        self._response_encoding = response_encoding
        seconds = None if timeout is None else parse_timeout(timeout)
        if seconds is not None:
            loop = conn.loop
            self._deadline = loop.time() + seconds
            self._timer = loop.call_at(self._deadline, self._expire)

    # ------------------------------------------------------------------ CallContext

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._conn.loop.time())

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._headers if not k.startswith(b":")]

    @property
    def authorization(self) -> bytes | None:
        for name, value in self._headers:
            if name == b"authorization":
                return value
        return None

    # ------------------------------------------------------------------ StreamSink

    def start(self) -> None:
        """Called once the call is registered: a streaming call runs now, a unary one at half-close."""
        if self._method is not None and self._method.streaming is not None:
            self._queue = asyncio.Queue()
            self._task = asyncio.ensure_future(self._run_streaming())
            self._task.add_done_callback(self._task_done)

    def on_data(self, data: bytes) -> None:
        if self._ended:
            return
        buf = self._buffer
        buf += data
        limit = self._conn.max_message_bytes
        while len(buf) >= 5:
            flag, length = _PREFIX.unpack_from(buf, 0)
            if length > limit:
                self.fail(StatusCode.RESOURCE_EXHAUSTED,
                          f"Received message larger than max ({length} vs. {limit})")
                return
            if len(buf) < 5 + length:
                return
            message = bytes(buf[5:5 + length])
            del buf[:5 + length]
            if flag & 1:
                try:
                    message = decompress(message, self._encoding, limit)
                except RpcError as exc:
                    self.fail(exc.code, exc.message)
                    return
            if self._queue is not None:
                self._queue.put_nowait(message)
            elif self._messages:  # a unary call takes one message: no need to hold more to say so
                self.fail(StatusCode.UNIMPLEMENTED, "a unary call with more than one request message")
                return
            else:
                self._messages.append(message)

    def on_end(self) -> None:
        self._half_closed = True
        if self._ended:
            return
        if self._buffer:
            self.fail(StatusCode.INTERNAL, "the request ends inside a message")
            return
        if self._method is None:
            return  # answered at start
        if self._queue is not None:
            self._queue.put_nowait(None)
            return
        if len(self._messages) != 1:
            what = "no request message" if not self._messages else "more than one request message"
            self.fail(StatusCode.UNIMPLEMENTED if self._messages else StatusCode.INTERNAL,
                      f"a unary call with {what}")
            return
        self._task = asyncio.ensure_future(self._run_unary(self._messages.pop()))
        self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step never runs its own handler: answer for it here.
        if task.cancelled():
            self._cancelled()

    def on_reset(self) -> None:
        """The client reset the stream (cancelled, or its deadline passed on its side): nothing is sent."""
        if self._ended:
            return
        self._ended = True
        self._cleanup()
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ running

    async def _run_unary(self, message: bytes) -> None:
        assert self._method is not None and self._method.unary is not None
        try:
            response = await self._method.unary(message, self)
        except RpcError as exc:
            self.fail(exc.code, exc.message)
        except asyncio.CancelledError:
            self._cancelled()
        except Exception as exc:  # never take the server down: INTERNAL, and the log says what
            log.exception("gRPC %s failed", self._method.name)
            self.fail(StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        else:
            if not self._ended:
                self._answer(response)

    def _answer(self, response: bytes) -> None:
        """The one response of a unary call and its OK status, in one write where possible."""
        limit = self._conn.max_message_bytes
        if len(response) > limit or self._response_encoding is not None:
            if self.send_message(response):
                self.finish()
            return
        self._ended = True
        self._cleanup()
        conn = self._conn
        conn.h2.send_response(self._stream_id, RESPONSE_HEADERS, _PREFIX.pack(0, len(response)) + response, OK_TRAILERS)
        conn.wrote()

    async def _run_streaming(self) -> None:
        assert self._method is not None and self._method.streaming is not None
        answers = self._method.streaming(self._requests(), self)
        try:
            async for answer in answers:
                if self._ended or not self.send_message(answer):
                    return
            self.finish()
        except RpcError as exc:
            self.fail(exc.code, exc.message)
        except asyncio.CancelledError:
            self._cancelled()
        except Exception as exc:
            log.exception("gRPC %s failed", self._method.name)
            self.fail(StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            await answers.aclose()

    async def _requests(self) -> AsyncIterator[bytes]:
        assert self._queue is not None
        while True:
            message = await self._queue.get()
            if message is None:
                return
            yield message

    def _cancelled(self) -> None:
        if self._expired:
            self.fail(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        elif not self._ended:  # the server stops and cuts the call short
            self.fail(StatusCode.UNAVAILABLE, "the server is stopping")

    def _expire(self) -> None:
        self._timer = None
        if self._ended:
            return
        self._expired = True
        if self._task is not None and not self._task.done():
            self._task.cancel()  # answered DEADLINE_EXCEEDED as the task ends
        else:
            self.fail(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def cancel(self) -> None:
        """The server stops and cannot wait any longer for this call."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        elif not self._ended:
            self.fail(StatusCode.UNAVAILABLE, "the server is stopping")

    @property
    def done(self) -> bool:
        return self._ended

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    # ------------------------------------------------------------------ answering

    def send_message(self, message: bytes) -> bool:
        """One response message (headers first, once); False if it cannot be sent (the call then ended
        with RESOURCE_EXHAUSTED: over the send limit)."""
        limit = self._conn.max_message_bytes
        if len(message) > limit:
            self.fail(StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({len(message)} vs. {limit})")
            return False
        conn = self._conn
        encoding = self._response_encoding
        if not self._sent_headers:
            self._sent_headers = True
            block = RESPONSE_HEADERS if encoding is None else RESPONSE_HEADERS + hc.literal(b"grpc-encoding", encoding)
            conn.h2.send_headers(self._stream_id, block)
        if encoding is not None:
            message = compress(message, encoding)
            conn.h2.send_data(self._stream_id, _PREFIX.pack(1, len(message)) + message)
        else:
            conn.h2.send_data(self._stream_id, _PREFIX.pack(0, len(message)) + message)
        conn.wrote()
        return True

    def finish(self) -> None:
        self._end(OK_TRAILERS)

    def fail(self, code: StatusCode, message: str) -> None:
        if len(message) > MAX_STATUS_MESSAGE:  # trailers must stay within clients' metadata limits
            message = message[:MAX_STATUS_MESSAGE] + "... (truncated)"
        self._end(hc.literal(b"grpc-status", _status(code)) + hc.literal(b"grpc-message", percent_encode(message)))

    def _end(self, trailers: bytes) -> None:
        if self._ended:
            return
        self._ended = True
        self._cleanup()
        conn = self._conn
        if not self._sent_headers:  # Trailers-Only: one HEADERS frame carries the status
            conn.h2.send_headers(self._stream_id, _STATUS_200 + _CONTENT_TYPE + trailers, end_stream=True)
        else:
            conn.h2.send_trailers(self._stream_id, trailers)
        conn.wrote()

    def _cleanup(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._conn.call_ended(self._stream_id)


def response_encoding(level: str, accept: bytes | None) -> bytes | None:
    """The compression of the responses: gRPC's choice for a compression level among what the client
    accepts (grpc-accept-encoding; low: gzip first, high: the strongest it takes, as grpc core ranks them)."""
    if level == "none" or not accept:
        return None
    accepted = [v.strip() for v in accept.split(b",")]
    ranked = [e for e in (b"gzip", b"deflate") if e in accepted]
    if not ranked:
        return None
    return {"low": ranked[0], "med": ranked[len(ranked) // 2], "high": ranked[-1]}[level]
