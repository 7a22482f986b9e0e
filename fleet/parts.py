"""One value made of several buffers, written one after another and never joined on the way: an
envelope's msgpack head followed by its tensors' bytes (fleet/envelope.py), written by a Redis link as
one argument of a command (fleet/redis_link.py) straight from those buffers."""

from __future__ import annotations


class Parts(tuple[bytes | memoryview, ...]):
    """The buffers of one value, in order. A memoryview among them is byte-formatted, 1-D and contiguous
    (`byte_view`), so its length is its size in bytes and a socket takes it as it is."""

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self)

    def join(self) -> bytes:
        return b"".join(self)


def byte_view(data: bytes | memoryview) -> bytes | memoryview:
    """`data` as bytes or a 1-D byte view of the same memory (one copy only where it is not contiguous)."""
    if type(data) is bytes or (data.format == "B" and data.ndim == 1 and data.c_contiguous):  # type: ignore[union-attr]
        return data
    return data.cast("B") if data.c_contiguous else bytes(data)  # type: ignore[union-attr]
