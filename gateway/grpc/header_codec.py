"""HPACK (RFC 7541) for the gateway's gRPC server: a lean decoder and the few encodings it sends.

The `hpack` library's Decoder costs ~40 µs for a block of nine indexed fields (it builds typed tuples
and logs per field); a gRPC call carries one such block, so that alone was a sixth of a call's budget.
This decoder keeps the library's static table and Huffman decoder and does the rest in a few
operations per field. Blocks made only of indexed fields (what a gRPC client sends for every call
after its first) are cached until the dynamic table next changes.

Responses never add to the peer's dynamic table: every field the server sends is a static-table
reference or a literal "without indexing", so there is no encoder state to keep in step.
"""

from __future__ import annotations

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
_STATIC_LEN = len(STATIC_TABLE)
DEFAULT_TABLE_SIZE = 4096
_ENTRY_OVERHEAD = 32  # RFC 7541 4.1
_MAX_INTEGER_BYTES = 6  # more continuation bytes than any sane size needs
_CACHE_LIMIT = 256


class HeaderError(Exception):
    """A header block that cannot be decoded: a connection error (COMPRESSION_ERROR)."""


def _integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """The integer at `pos` with an N-bit prefix (RFC 7541 5.1), and the position after it."""
    mask = (1 << prefix_bits) - 1
    try:
        value = block[pos] & mask
        pos += 1
        if value < mask:
            return value, pos
        shift = 0
        for _ in range(_MAX_INTEGER_BYTES):
            byte = block[pos]
            pos += 1
            value += (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7
    except IndexError:
        raise HeaderError("a header block ends inside an integer") from None
    raise HeaderError("an HPACK integer is too long")


def _string(block: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(block):
        raise HeaderError("a header block ends before a string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 7)
    end = pos + length
    if end > len(block):
        raise HeaderError("a header string runs past the end of its block")
    raw = block[pos:end]
    if huffman:
        try:
            raw = decode_huffman(raw)
        except Exception as exc:  # the library raises its own HPACKDecodingError
            raise HeaderError(f"invalid Huffman string: {exc}") from None
    return raw, end


class HeaderDecoder:
    """One connection's decoding context: the dynamic table the peer's encoder fills.
    `max_table_size` is what this side allows (SETTINGS_HEADER_TABLE_SIZE; 4096 by default)."""

    def __init__(self, max_table_size: int = DEFAULT_TABLE_SIZE, max_list_size: int = 1 << 16) -> None:
        self._dynamic: list[tuple[bytes, bytes]] = []  # newest first
        self._size = 0
        self._max_size = max_table_size
        self._allowed = max_table_size
        self._max_list_size = max_list_size
        self._cache: dict[bytes, list[tuple[bytes, bytes]]] = {}

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= _STATIC_LEN:
            return STATIC_TABLE[index - 1]
        i = index - _STATIC_LEN - 1
        if 0 <= i < len(self._dynamic):
            return self._dynamic[i]
        raise HeaderError(f"header table index {index} does not exist")

    def _add(self, name: bytes, value: bytes) -> None:
        self._cache.clear()  # indices shift: what was cached may now mean something else
        size = len(name) + len(value) + _ENTRY_OVERHEAD
        if size > self._max_size:  # RFC 7541 4.4: empties the table, adds nothing
            self._dynamic.clear()
            self._size = 0
            return
        self._dynamic.insert(0, (name, value))
        self._size += size
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max_size:
            name, value = self._dynamic.pop()
            self._size -= len(name) + len(value) + _ENTRY_OVERHEAD

    def _literal(self, block: bytes, pos: int, prefix_bits: int) -> tuple[tuple[bytes, bytes], int]:
        """A literal field: its name by table index (or as a string), then its value."""
        index, pos = _integer(block, pos, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = _string(block, pos)
        value, pos = _string(block, pos)
        return (name, value), pos

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The (name, value) fields of one complete header block, in order."""
        cached = self._cache.get(block)
        if cached is not None:
            return cached
        fields: list[tuple[bytes, bytes]] = []
        only_indexed = True
        listed = 0
        pos, end = 0, len(block)
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                if index == 0:
                    raise HeaderError("header table index 0")
                field = self._entry(index)
            elif byte & 0x40:  # literal with incremental indexing
                only_indexed = False
                field, pos = self._literal(block, pos, 6)
                self._add(*field)
            elif byte & 0x20:  # dynamic table size update
                only_indexed = False
                if fields:
                    raise HeaderError("a table size update after the first field of a block")
                size, pos = _integer(block, pos, 5)
                if size > self._allowed:
                    raise HeaderError(f"table size {size} exceeds the {self._allowed} allowed")
                self._max_size = size
                self._evict()
                self._cache.clear()
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                only_indexed = False
                field, pos = self._literal(block, pos, 4)
            listed += len(field[0]) + len(field[1]) + _ENTRY_OVERHEAD
            if listed > self._max_list_size:
                raise HeaderError(f"the header list exceeds {self._max_list_size} bytes")
            fields.append(field)
        if only_indexed and fields:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[block] = fields
        return fields


def _encode_integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A field as a literal without indexing, its name a static-table reference where there is one
    (RFC 7541 6.2.2); never Huffman-coded (optional for encoders)."""
    index = _STATIC_NAMES.get(name)
    head = _encode_integer(index, 4, 0x00) if index else b"\x00" + _encode_integer(len(name), 7, 0x00) + name
    return head + _encode_integer(len(value), 7, 0x00) + value


def indexed(name: bytes, value: bytes) -> bytes:
    """A field of the static table, by its index (RFC 7541 6.1)."""
    return _encode_integer(STATIC_TABLE.index((name, value)) + 1, 7, 0x80)


_STATIC_NAMES: dict[bytes, int] = {}
for _i, (_name, _) in enumerate(STATIC_TABLE, start=1):
    _STATIC_NAMES.setdefault(_name, _i)
