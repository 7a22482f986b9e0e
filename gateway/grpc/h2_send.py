"""What the gRPC server sends on one HTTP/2 connection (RFC 9113), without I/O: headers, DATA within the
peer's flow-control windows and frame size (the rest waits for WINDOW_UPDATE), trailers after the data,
RST_STREAM, GOAWAY and keepalive PINGs. gateway/grpc/h2.py adds the receiving half."""

from __future__ import annotations

import struct
from collections.abc import Callable

from gateway.grpc.h2_frames import (
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    RST_STREAM,
    U32,
    LocalSettings,
    Stream,
    frame,
)
from gateway.grpc.h2_pings import PingPolicy


class H2Sender:
    """The sending half of a connection: frames queued for the transport (`take_output`), the peer's
    windows and frame size, DATA that waits for a window, and the streams still open."""

    def __init__(self, settings: LocalSettings, now: Callable[[], float]) -> None:
        self.settings = settings
        self._now = now
        self._out: list[bytes] = []
        self.streams: dict[int, Stream] = {}
        self.last_stream_id = 0
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self.goaway_sent = False
        self._goaway_codes: set[int] = set()
        self._goaway_last: int | None = None
        self.pings = PingPolicy(settings, now)

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
        self.pings.sent_data()

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool = False) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # reset meanwhile: nothing to answer
        stream.headers_sent = True
        if end_stream and stream.pending:
            stream.pending_trailers = block
            return
        self._out.append(self._header_frames(stream_id, block, END_STREAM if end_stream else 0))
        self._sent_data()
        if end_stream:
            self._close_send(stream)

    def _header_frames(self, stream_id: int, block: bytes, flags: int) -> bytes:
        """A header block as HEADERS, then CONTINUATION frames when it exceeds the peer's frame size."""
        limit = self._peer_max_frame
        if len(block) <= limit:
            return frame(HEADERS, END_HEADERS | flags, stream_id, block)
        parts = [block[i:i + limit] for i in range(0, len(block), limit)]
        frames = [frame(HEADERS, flags, stream_id, parts[0])]
        frames += [frame(CONTINUATION, 0, stream_id, p) for p in parts[1:-1]]
        frames.append(frame(CONTINUATION, END_HEADERS, stream_id, parts[-1]))
        return b"".join(frames)

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
        limit = self._peer_max_frame
        if stream.pending or n > stream.send_window or n > self._send_window or n > limit or \
                len(headers) > limit or len(trailers) > limit:
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
                self._out.append(self._header_frames(stream.id, block, END_STREAM))
                self._close_send(stream)

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """RST_STREAM: this side abandons the stream (a deadline passed, the server stops)."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._out.append(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

    def _close_send(self, stream: Stream) -> None:
        if not stream.recv_open:
            self.streams.pop(stream.id, None)
        else:
            # A gRPC server that has answered ends the call: what the client still sends is not read.
            self.streams.pop(stream.id, None)
            self._out.append(frame(RST_STREAM, 0, stream.id, U32.pack(NO_ERROR)))

    def goaway(self, code: int = NO_ERROR, message: str = "") -> None:
        """GOAWAY: once per code (the peer backs off once per frame), with the last stream id of the
        first one (RFC 9113 6.8: it never goes up)."""
        if code in self._goaway_codes:
            return
        if self._goaway_last is None:
            self._goaway_last = self.last_stream_id
        self._goaway_codes.add(code)
        self.goaway_sent = True
        self._out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self._goaway_last, code) + message.encode()))

    def ping(self) -> None:
        """A keepalive PING (gateway/grpc/h2_pings.py says when)."""
        self.pings.pinged()
        self._out.append(frame(PING, 0, 0, b"fleetkap"))

    def keepalive_due(self) -> bool:
        return not self.goaway_sent and self.pings.keepalive_due(bool(self.streams))

    def keepalive_expired(self) -> bool:
        return self.pings.expired()
