"""HTTP/2's wire vocabulary (RFC 9113) for the gRPC server: frame types, flags, error and settings codes,
frame encoding, what this server announces, a stream's state, and the connection error
(gateway/grpc/h2_send.py and h2.py use them)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Protocol

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
HEAD = struct.Struct(">I")  # 24-bit length + type read as one word, then flags and stream id
U32 = struct.Struct(">I")
SETTING = struct.Struct(">HI")


class ConnectionError_(Exception):  # noqa: N801 (the builtin ConnectionError is an OSError)
    """A connection error: the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


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


class StreamSink(Protocol):
    """What the server attaches to each stream the peer opens."""

    def on_data(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...

    def on_reset(self) -> None: ...


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
