"""fleet/redis_link.py's command packing: a command with a long argument, written as a list of buffers with
that argument itself among them, is byte for byte what hiredis packs (redis-py's RESP)."""

from __future__ import annotations

import hiredis
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.redis_link import _BIG_ARG, _pack

small = st.one_of(st.binary(max_size=40), st.text(max_size=20), st.integers(-(2**63), 2**63 - 1),
                  st.floats(allow_nan=False, allow_infinity=False))
big = st.integers(_BIG_ARG, _BIG_ARG + 300).map(lambda n: bytes(range(256)) * (n // 256) + b"x" * (n % 256))
arg = st.one_of(small, big, big.map(lambda b: memoryview(b)), st.binary(max_size=40).map(lambda b: memoryview(b)))


@settings(max_examples=200, deadline=None)
@given(st.lists(arg, min_size=1, max_size=8))
def test_packed_pieces_are_hiredis_bytes(command: list[object]) -> None:
    packed = _pack(command)  # type: ignore[arg-type]
    reference = hiredis.pack_command(tuple(command))  # type: ignore[arg-type]
    long_args = [a for a in command if isinstance(a, (bytes, memoryview)) and len(a) >= _BIG_ARG]
    if not long_args:
        assert packed == reference
        return
    assert isinstance(packed, list) and b"".join(packed) == reference
    # each long argument is one of the pieces, the very object (not a copy)
    assert all(any(p is a for p in packed) for a in long_args)


def test_a_command_of_small_arguments_stays_one_hiredis_buffer() -> None:
    command = ("XADD", "k", "*", "f", b"v" * (_BIG_ARG - 1))
    assert _pack(command) == hiredis.pack_command(command)  # type: ignore[arg-type]


def test_a_long_view_of_wider_elements_or_several_dimensions_is_written_as_its_bytes() -> None:
    import array

    import numpy as np
    wide = memoryview(array.array("f", range(_BIG_ARG)))  # len() counts floats; its size is 4x that
    grid = memoryview(np.arange(_BIG_ARG, dtype=np.int16).reshape(2, -1))
    strided = memoryview(np.arange(2 * _BIG_ARG, dtype=np.uint8)[::2])  # not contiguous: copied
    for view in (wide, grid, strided):
        packed = _pack(("SET", "k", view))
        assert isinstance(packed, list)
        assert b"".join(packed) == hiredis.pack_command(("SET", "k", view.tobytes()))


def test_arguments_hiredis_refuses_are_refused() -> None:
    import pytest
    for bad in (True, 1.5j, None):
        with pytest.raises(TypeError):
            _pack(("SET", b"x" * _BIG_ARG, bad))  # type: ignore[arg-type]

