"""The server side of one HTTP/2 connection (RFC 9113) as gRPC uses it, without I/O: bytes in through
`receive`, bytes out through `take_output`, streams handed to the server through `Streams`.

Why not grpc.aio: its per-call cost (~230 µs of Python and thread hand-offs per unary call, measured
in bench/RESULTS.md) made fleet's gRPC slower than its HTTP/1.1. This keeps only what a gRPC server
needs: prior-knowledge h2c, the settings exchange, HPACK decoding (header_codec.py), flow control in
both directions, CONTINUATION and padding, RST_STREAM, PING (with gRPC's keepalive and ping-strike
policy), GOAWAY, and a concurrent-stream limit. It never pushes and never initiates streams.

Errors the peer causes are ConnectionError_ (GOAWAY with the code, then close) or a reset of the one
stream (RST_STREAM), as RFC 9113 section 5.4 says.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.grpc.header_codec import HeaderDecoder, HeaderError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

# Error codes (RFC 9113 section 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB

SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
_HEAD = struct.Struct(">I")  # 24-bit length + type read as one word, then flags and stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")


class ConnectionError_(Exception):  # noqa: N801 (the builtin ConnectionError is an OSError)
    """A connection error: the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamSink(Protocol):
    """What the server attaches to each stream the peer opens."""

    def on_data(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...

    def on_reset(self) -> None: ...


@dataclass(frozen=True)
class LocalSettings:
    """What this server announces, and the keepalive / ping policy it applies (gRPC's channel args)."""

    max_concurrent_streams: int = 1024
    initial_window: int = 1 << 22  # per stream: big enough that a tensor rarely waits for a window update
    connection_window: int = 1 << 24
    max_frame_size: int = 1 << 20
    max_header_list_size: int = 1 << 16
    keepalive_time_s: float = 7200.0
    keepalive_timeout_s: float = 20.0
    keepalive_permit_without_calls: bool = False
    max_pings_without_data: int = 2
    min_recv_ping_interval_without_data_s: float = 300.0
    max_ping_strikes: int = 2


@dataclass(slots=True)
class Stream:
    id: int
    sink: StreamSink | None = None
    send_window: int = DEFAULT_WINDOW
    recv_unacked: int = 0  # received and consumed, not yet returned by a WINDOW_UPDATE
    recv_open: bool = True
    pending: bytearray = field(default_factory=bytearray)  # DATA payload waiting for a window
    pending_trailers: bytes | None = None  # sent once `pending` is out
    headers_sent: bool = False


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", (len(payload) << 8) | kind, flags, stream_id) + payload


class H2Connection:
    """`new_stream(stream_id, headers)` returns the sink of a stream the peer opened (the server answers
    through `send_*`); `now()` is the clock of the keepalive and ping policy (injected for tests)."""

    def __init__(self, settings: LocalSettings, new_stream: Callable[[int, list[tuple[bytes, bytes]]], StreamSink],
                 now: Callable[[], float]) -> None:
        self.settings = settings
        self._new_stream = new_stream
        self._now = now
        self._decoder = HeaderDecoder(max_list_size=settings.max_header_list_size)
        self._buffer = bytearray()
        self._preface_seen = False
        self._settings_seen = False
        self._out: list[bytes] = []
        self.streams: dict[int, Stream] = {}
        self.last_stream_id = 0
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._recv_window = DEFAULT_WINDOW  # the peer may send this much more on the connection
        self._recv_unacked = 0
        self._continuing: tuple[int, bytearray, bool] | None = None  # (stream, header block so far, end_stream)
        self.goaway_sent = False
        self.peer_gone = False  # the peer sent GOAWAY: no new streams, close when idle
        self.closed = False
        # Ping policy (gRPC's): strikes for pings that come too often when nothing is being sent.
        self._last_ping_recv: float | None = None
        self._ping_strikes = 0
        self._pings_without_data = 0
        self.ping_outstanding_since: float | None = None
        self.last_activity = now()
        self._announce()

    # ------------------------------------------------------------------ output

    def _announce(self) -> None:
        s = self.settings
        values = [(SETTINGS_MAX_CONCURRENT_STREAMS, s.max_concurrent_streams),
                  (SETTINGS_INITIAL_WINDOW_SIZE, s.initial_window), (SETTINGS_MAX_FRAME_SIZE, s.max_frame_size),
                  (SETTINGS_MAX_HEADER_LIST_SIZE, s.max_header_list_size), (SETTINGS_ENABLE_PUSH, 0)]
        self._out.append(frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values)))
        # The connection window starts at 65,535 whatever SETTINGS say; only an update widens it.
        if s.connection_window > DEFAULT_WINDOW:
            self._recv_window = s.connection_window
            self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(s.connection_window - DEFAULT_WINDOW)))

    def take_output(self) -> bytes:
        if not self._out:
            return b""
        out = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        return out

    @property
    def has_output(self) -> bool:
        return bool(self._out)

    def _sent_data(self) -> None:
        # gRPC's policy: the peer's pings are judged against "nothing sent lately"; sending resets it.
        self._ping_strikes = 0
        self._pings_without_data = 0
        self._last_ping_recv = None

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool = False) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # reset meanwhile: nothing to answer
        stream.headers_sent = True
        if end_stream and stream.pending:
            stream.pending_trailers = block
            return
        self._out.append(frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream_id, block))
        self._sent_data()
        if end_stream:
            self._close_send(stream)

    def send_data(self, stream_id: int, data: bytes) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if stream.pending:
            stream.pending += data
            return
        sent = self._emit_data(stream, data, 0)
        if sent < len(data):
            stream.pending += data[sent:]

    def send_response(self, stream_id: int, headers: bytes, data: bytes, trailers: bytes) -> None:
        """A whole unary answer: headers, one DATA payload, trailers; in one piece when the windows
        and the peer's frame size allow (the common case), else as send_headers/send_data/send_trailers."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        n = len(data)
        if stream.pending or n > stream.send_window or n > self._send_window or n > self._peer_max_frame:
            self.send_headers(stream_id, headers)
            self.send_data(stream_id, data)
            self.send_trailers(stream_id, trailers)
            return
        stream.send_window -= n
        self._send_window -= n
        stream.headers_sent = True
        self._out.append(b"".join((frame(HEADERS, END_HEADERS, stream_id, headers), frame(DATA, 0, stream_id, data),
                                   frame(HEADERS, END_HEADERS | END_STREAM, stream_id, trailers))))
        self._sent_data()
        self._close_send(stream)

    def send_trailers(self, stream_id: int, block: bytes) -> None:
        """The last HEADERS (END_STREAM), after whatever DATA still waits for a window."""
        self.send_headers(stream_id, block, end_stream=True)

    def _emit_data(self, stream: Stream, data: bytes | bytearray, start: int) -> int:
        """Emit DATA from data[start:] as far as the windows allow; returns the position reached."""
        pos, end = start, len(data)
        max_frame = self._peer_max_frame
        while pos < end:
            room = min(stream.send_window, self._send_window, max_frame, end - pos)
            if room <= 0:
                break
            self._out.append(frame(DATA, 0, stream.id, bytes(data[pos:pos + room])))
            stream.send_window -= room
            self._send_window -= room
            pos += room
        if pos > start:
            self._sent_data()
        return pos

    def _resume(self) -> None:
        """Windows grew: send what waited, streams in the order they were opened."""
        for stream in list(self.streams.values()):
            if self._send_window <= 0:
                return
            if stream.pending:
                sent = self._emit_data(stream, stream.pending, 0)
                del stream.pending[:sent]
            if not stream.pending and stream.pending_trailers is not None:
                block, stream.pending_trailers = stream.pending_trailers, None
                self._out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, block))
                self._close_send(stream)

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """RST_STREAM: this side abandons the stream (a deadline passed, the server stops)."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(code)))

    def _close_send(self, stream: Stream) -> None:
        if not stream.recv_open:
            self.streams.pop(stream.id, None)
        else:
            # A gRPC server that has answered ends the call: what the client still sends is not read.
            self.streams.pop(stream.id, None)
            self._out.append(frame(RST_STREAM, 0, stream.id, _U32.pack(NO_ERROR)))

    def goaway(self, code: int = NO_ERROR, message: str = "") -> None:
        if self.goaway_sent and code == NO_ERROR:
            return
        self.goaway_sent = True
        self._out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream_id, code) + message.encode()))

    def ping(self) -> None:
        """A keepalive PING (answered by an ACK; `ping_outstanding_since` until then)."""
        self.ping_outstanding_since = self._now()
        self._pings_without_data += 1
        self._out.append(frame(PING, 0, 0, b"fleetkap"))

    def keepalive_due(self) -> bool:
        """Time for a keepalive ping: keepalive_time of silence, calls (or permission) and gRPC's
        limit on pings without data in between."""
        s = self.settings
        if self.ping_outstanding_since is not None or self.goaway_sent:
            return False
        if not self.streams and not s.keepalive_permit_without_calls:
            return False
        if s.max_pings_without_data and self._pings_without_data >= s.max_pings_without_data:
            return False
        return self._now() - self.last_activity >= s.keepalive_time_s

    def keepalive_expired(self) -> bool:
        since = self.ping_outstanding_since
        return since is not None and self._now() - since >= self.settings.keepalive_timeout_s

    # ------------------------------------------------------------------ input

    def receive(self, data: bytes) -> None:
        """Process what arrived. Raises ConnectionError_ for a connection error (the caller sends
        GOAWAY and closes); stream errors are answered here (RST_STREAM)."""
        self.last_activity = self._now()
        buf = self._buffer
        buf += data
        pos = 0
        if not self._preface_seen:
            if len(buf) < len(PREFACE):
                if PREFACE[:len(buf)] != bytes(buf):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            if bytes(buf[:len(PREFACE)]) != PREFACE:
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            pos = len(PREFACE)
            self._preface_seen = True
        end = len(buf)
        max_frame = self.settings.max_frame_size
        try:
            while end - pos >= 9:
                word = _HEAD.unpack_from(buf, pos)[0]
                length, kind = word >> 8, word & 0xFF
                if length > max_frame:
                    raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes exceeds {max_frame}")
                if end - pos - 9 < length:
                    break
                flags = buf[pos + 4]
                stream_id = _U32.unpack_from(buf, pos + 5)[0] & 0x7FFFFFFF
                payload = bytes(buf[pos + 9:pos + 9 + length])
                pos += 9 + length
                self._frame(kind, flags, stream_id, payload)
        finally:
            del buf[:pos]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if not self._settings_seen:
            if kind != SETTINGS or flags & ACK:
                raise ConnectionError_(PROTOCOL_ERROR, "the connection must start with SETTINGS")
            self._settings_seen = True
        if self._continuing is not None and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == PING:
            self._ping(flags, stream_id, payload)
        elif kind == RST_STREAM:
            self._rst_stream(stream_id, payload)
        elif kind == GOAWAY:
            if stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "GOAWAY on a stream")
            self.peer_gone = True
        elif kind == PRIORITY:
            if stream_id == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                self._stream_error(stream_id, FRAME_SIZE_ERROR)
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "a client cannot push")
        # Unknown frame types are ignored (RFC 9113 4.1).

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ConnectionError_(PROTOCOL_ERROR, "padding exceeds the frame")
        return payload[1:len(payload) - payload[0]]

    def _stream_error(self, stream_id: int, code: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None and stream.sink is not None:
            stream.sink.on_reset()
        self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(code)))

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "the peer sent past the connection window")
        self._consumed(size)
        stream = self.streams.get(stream_id)
        if stream is None or not stream.recv_open:
            if stream_id > self.last_stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is None:
                # Closed (answered, reset): what was in flight is dropped; a stream we answered early is
                # reset already, anything else is STREAM_CLOSED.
                return
            self._stream_error(stream_id, STREAM_CLOSED)
            return
        data = self._unpad(flags, payload)
        stream.recv_unacked += size
        if flags & END_STREAM:
            stream.recv_open = False
        elif stream.recv_unacked >= self.settings.initial_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.recv_unacked)))
            stream.recv_unacked = 0
        sink = stream.sink
        if sink is not None:
            if data:
                sink.on_data(data)
            if flags & END_STREAM:
                sink.on_end()

    def _consumed(self, size: int) -> None:
        self._recv_unacked += size
        if self._recv_unacked >= self.settings.connection_window // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked)))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, block, bool(flags & END_STREAM))
        else:
            self._continuing = (stream_id, bytearray(block), bool(flags & END_STREAM))

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuing is None or self._continuing[0] != stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without a header block")
        _, block, end_stream = self._continuing
        block += payload
        if len(block) > 2 * self.settings.max_header_list_size:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "a header block too large")
        if flags & END_HEADERS:
            self._continuing = None
            self._header_block(stream_id, bytes(block), end_stream)

    def _header_block(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        try:
            # Always decoded, even for a stream refused below: the table must stay in step.
            headers = self._decoder.decode(block)
        except HeaderError as exc:
            raise ConnectionError_(COMPRESSION_ERROR, str(exc)) from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: the end of its messages
            if not stream.recv_open:
                self._stream_error(stream_id, STREAM_CLOSED)
                return
            if not end_stream:
                raise ConnectionError_(PROTOCOL_ERROR, "trailers without END_STREAM")
            stream.recv_open = False
            if stream.sink is not None:
                stream.sink.on_end()
            return
        if stream_id % 2 == 0 or stream_id <= self.last_stream_id:
            if stream_id % 2 == 0 or stream_id > self.last_stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, f"stream {stream_id} cannot be opened by a client")
            return  # a closed stream's late trailers: ignored
        self.last_stream_id = stream_id
        if self.goaway_sent or self.peer_gone or len(self.streams) >= self.settings.max_concurrent_streams:
            self._out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        stream = Stream(stream_id, send_window=self._peer_initial_window, recv_open=not end_stream)
        self.streams[stream_id] = stream
        stream.sink = self._new_stream(stream_id, headers)
        if end_stream and stream_id in self.streams:
            stream.sink.on_end()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "a zero connection window increment")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection window overflows")
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                return
            if increment == 0:
                self._stream_error(stream_id, PROTOCOL_ERROR)
                return
            stream.send_window += increment
            if stream.send_window > MAX_WINDOW:
                self._stream_error(stream_id, FLOW_CONTROL_ERROR)
                return
        self._resume()

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 16_777_215:
                    raise ConnectionError_(PROTOCOL_ERROR, f"an invalid max frame size {value}")
                self._peer_max_frame = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
            # The others concern what this server never does (push, index into the peer's table).
        self._out.append(frame(SETTINGS, ACK, 0))
        self._resume()

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionError_(FRAME_SIZE_ERROR, "PING of the wrong size")
        if flags & ACK:
            self.ping_outstanding_since = None
            return
        now = self._now()
        s = self.settings
        # gRPC's server policy: without calls (unless permitted) a client may ping every 2 hours; with
        # them, every min_recv_ping_interval_without_data while the server sends nothing. Past
        # max_ping_strikes too-early pings, GOAWAY ENHANCE_YOUR_CALM "too_many_pings".
        interval = s.min_recv_ping_interval_without_data_s
        if not self.streams and not s.keepalive_permit_without_calls:
            interval = max(interval, 7200.0)
        if self._last_ping_recv is not None and now - self._last_ping_recv < interval:
            self._ping_strikes += 1
            if s.max_ping_strikes and self._ping_strikes > s.max_ping_strikes:
                self.goaway(ENHANCE_YOUR_CALM, "too_many_pings")
                raise ConnectionError_(ENHANCE_YOUR_CALM, "too_many_pings")
        self._last_ping_recv = now
        self._out.append(frame(PING, ACK, 0, payload))

    def _rst_stream(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        if stream_id > self.last_stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        stream = self.streams.pop(stream_id, None)
        if stream is not None and stream.sink is not None:
            stream.sink.on_reset()
