"""The server side of one HTTP/2 connection (RFC 9113) as gRPC uses it, without I/O: bytes in through
`receive`, bytes out through `take_output` (the sending half is gateway/grpc/h2_send.py), each stream the
peer opens handed to the server's `new_stream`.

Why not grpc.aio: its per-call cost (~230 µs of Python and thread hand-offs per unary call, measured
in bench/RESULTS.md) made fleet's gRPC slower than its HTTP/1.1. This keeps only what a gRPC server
needs: prior-knowledge h2c, the settings exchange, HPACK decoding (header_codec.py), flow control in
both directions, CONTINUATION and padding, RST_STREAM, PING (with gRPC's keepalive and ping-strike
policy), GOAWAY, and a concurrent-stream limit. It never pushes and never initiates streams.

Errors the peer causes are ConnectionError_ (GOAWAY with the code, then close) or a reset of the one
stream (RST_STREAM), as RFC 9113 section 5.4 says.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.grpc.h2_frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEAD,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTING,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    U32,
    WINDOW_UPDATE,
    ConnectionError_,
    LocalSettings,
    Stream,
    StreamSink,
    frame,
)
from gateway.grpc.h2_send import H2Sender
from gateway.grpc.header_codec import HeaderDecoder, HeaderError


class H2Connection(H2Sender):
    """`new_stream(stream_id, headers)` returns the sink of a stream the peer opened (the server answers
    through `send_*`); `now()` is the clock of the keepalive and ping policy (injected for tests)."""

    def __init__(self, settings: LocalSettings, new_stream: Callable[[int, list[tuple[bytes, bytes]]], StreamSink],
                 now: Callable[[], float]) -> None:
        super().__init__(settings, now)
        self._new_stream = new_stream
        self._decoder = HeaderDecoder(max_list_size=settings.max_header_list_size)
        self._buffer = bytearray()
        self._preface_seen = False
        self._settings_seen = False
        self._recv_window = DEFAULT_WINDOW  # the peer may send this much more on the connection
        self._recv_unacked = 0
        self._continuing: tuple[int, bytearray, bool] | None = None  # (stream, header block so far, end_stream)
        self.peer_gone = False  # the peer sent GOAWAY: no new streams, close when idle
        self._announce()

    def _announce(self) -> None:
        s = self.settings
        values = [(SETTINGS_MAX_CONCURRENT_STREAMS, s.max_concurrent_streams),
                  (SETTINGS_INITIAL_WINDOW_SIZE, s.initial_window), (SETTINGS_MAX_FRAME_SIZE, s.max_frame_size),
                  (SETTINGS_MAX_HEADER_LIST_SIZE, s.max_header_list_size), (SETTINGS_ENABLE_PUSH, 0)]
        self._out.append(frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in values)))
        # The connection window starts at 65,535 whatever SETTINGS say; only an update widens it.
        if s.connection_window > DEFAULT_WINDOW:
            self._recv_window = s.connection_window
            self._out.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(s.connection_window - DEFAULT_WINDOW)))

    # ------------------------------------------------------------------ input

    def receive(self, data: bytes) -> None:
        """Process what arrived. Raises ConnectionError_ for a connection error (the caller sends
        GOAWAY and closes); stream errors are answered here (RST_STREAM)."""
        self.pings.received()
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
                word = HEAD.unpack_from(buf, pos)[0]
                length, kind = word >> 8, word & 0xFF
                if length > max_frame:
                    raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes exceeds {max_frame}")
                if end - pos - 9 < length:
                    break
                flags = buf[pos + 4]
                stream_id = U32.unpack_from(buf, pos + 5)[0] & 0x7FFFFFFF
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
        self._out.append(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

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
            self._out.append(frame(WINDOW_UPDATE, 0, stream_id, U32.pack(stream.recv_unacked)))
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
            self._out.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(self._recv_unacked)))
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
            self._out.append(frame(RST_STREAM, 0, stream_id, U32.pack(REFUSED_STREAM)))
            return
        stream = Stream(stream_id, send_window=self._peer_initial_window, recv_open=not end_stream)
        self.streams[stream_id] = stream
        stream.sink = self._new_stream(stream_id, headers)
        if end_stream and stream_id in self.streams:
            stream.sink.on_end()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
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
            key, value = SETTING.unpack_from(payload, offset)
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
            self.pings.acknowledged()
            return
        if not self.pings.peer_ping_allowed(bool(self.streams)):
            self.goaway(ENHANCE_YOUR_CALM, "too_many_pings")
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too_many_pings")
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
