"""Length-prefixed msgpack frames over a pipe: the Python backend's worker <-> stub channel."""

from __future__ import annotations

import struct
from typing import IO, Any

import msgpack

LENGTH = struct.Struct("<I")  # each frame's length, before it


class PipeClosed(EOFError):
    pass


def write_frame(out: IO[bytes], message: Any) -> None:
    write_packed(out, pack(message))


def pack(message: Any) -> bytes:
    payload: bytes = msgpack.packb(message, use_bin_type=True)
    return payload


def write_packed(out: IO[bytes], payload: bytes) -> None:
    """A frame of a message `pack`ed already."""
    out.write(LENGTH.pack(len(payload)))
    out.write(payload)
    out.flush()


def _read_exactly(inp: IO[bytes], n: int) -> bytes:
    chunks: list[bytes] = []
    while n:
        chunk = inp.read(n)
        if not chunk:
            raise PipeClosed("the other end closed the pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(inp: IO[bytes]) -> Any:
    (n,) = LENGTH.unpack(_read_exactly(inp, 4))
    return msgpack.unpackb(_read_exactly(inp, n), raw=False)
