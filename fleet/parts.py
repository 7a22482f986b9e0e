"""One value made of several buffers, written one after another and never joined on the way: an
envelope's msgpack head followed by its tensors' bytes (fleet/envelope.py), written by a Redis link as
one argument of a command (fleet/redis_link.py) straight from those buffers."""

from __future__ import annotations

from collections.abc import Iterable

# A buffer this long is written from itself (a socket writev) rather than copied into a bigger one: the
# Redis link's long arguments, an envelope's out-of-band tensors, a long HTTP body's outputs. Below it,
# a copy costs less than another buffer in the writev.
LONG_BUFFER = 1 << 15


class Parts(tuple[bytes | memoryview, ...]):
    """The buffers of one value, in order. A memoryview among them should be byte-formatted, 1-D and
    contiguous (`byte_view`), as a socket takes it."""

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return total_bytes(self)

    def join(self) -> bytes:
        return b"".join(self)


def total_bytes(buffers: Iterable[bytes | memoryview]) -> int:
    """The bytes `buffers` hold: a view's size in bytes, not its length in elements, since what a RESP bulk
    length or a content-length says must be what is written."""
    return sum(p.nbytes if type(p) is memoryview else len(p) for p in buffers)


def joined(value: bytes | Parts) -> bytes:
    """`value` as one bytes, for a writer that takes nothing else (redis-py, gzip, ASGI)."""
    return value.join() if isinstance(value, Parts) else value


def byte_view(data: bytes | memoryview) -> bytes | memoryview:
    """`data` as bytes or a 1-D byte view of the same memory (one copy only where it is not contiguous)."""
    if type(data) is bytes:
        return data
    view = data if type(data) is memoryview else memoryview(data)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    # (an empty view of another shape cannot be cast)
    return view.cast("B") if view.c_contiguous and view.nbytes else bytes(view)
