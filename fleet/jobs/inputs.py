"""Bulk-job input files: JSONL requests or .npy/.npz arrays, streamed as validated items.

Every reader yields `InputItem`s in file order from a resume cursor (the index and offset of the next
unread item), so an interrupted job restarts where it stopped without rereading what it sent. Nothing
here loads a whole file: JSONL is read line by line (jsonl_input.py), .npy is memory-mapped, and .npz members are read
row by row from the zip stream. A line that cannot be sent becomes an item with `error` set, so the
runner records it as failed in order; a file that cannot be read at all raises InvalidInput at open.
A JSONL line longer than the job's line limit is such an item too: it is skipped in bounded chunks,
never held whole, so one huge line costs the job worker no more memory than a line at the limit.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import IO, Protocol

import numpy as np

from fleet import tensors
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.jobs.items import InputItem
from fleet.jobs.jsonl_input import DEFAULT_MAX_LINE_BYTES, JsonlInput
from fleet.model_spec import ModelSpec, TensorSpec

log = logging.getLogger(__name__)

JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
ARRAY_SUFFIXES = frozenset({".npy", ".npz"})


class JobInput(Protocol):
    """What the runner reads: a count for progress, then items from a resume cursor."""

    kind: str  # "jsonl" or "array"

    def count(self) -> int: ...

    def read(self, start_index: int = 0, start_offset: int = 0, block_rows: int = 1) -> Iterator[InputItem]:
        """Items from a resume cursor. Array inputs of a batching model with `block_rows` > 1 yield blocks
        of up to that many consecutive rows as one item (`count` = rows): a bulk job then pays per batch,
        not per row. JSONL ignores it (each line is its own request)."""
        ...

    def close(self) -> None: ...


def open_input(path: Path, spec: ModelSpec, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
               parse_processes: int | None = 0) -> JobInput:
    """Pick the reader by suffix; raises InvalidInput for a missing file or an unknown format.
    `max_line_bytes` bounds one JSONL line (without its newline); a longer line is an item with `error`.
    `parse_processes`: JSONL lines parsed by that many forked processes (None: by this host's cores)."""
    suffix = path.suffix.lower()
    if suffix not in JSONL_SUFFIXES | ARRAY_SUFFIXES:
        raise InvalidInput(
            f"unsupported job input '{path.name}': expected .jsonl/.ndjson/.json requests or .npy/.npz arrays"
        )
    if not path.is_file():
        raise InvalidInput(f"job input '{path}' does not exist or is not a file")
    if suffix == ".npy":
        return NpyInput(path, spec)
    if suffix == ".npz":
        return NpzInput(path, spec)
    return JsonlInput(path, spec, max_line_bytes, parse_processes)


# ---------------------------------------------------------------- arrays


@dataclass(frozen=True, slots=True)
class _Column:
    """A model input fed from one array: the on-disk layout and how a row becomes a tensor."""

    spec: TensorSpec
    shape: tuple[int, ...]  # the whole array: items first
    dtype: np.dtype  # on disk

    @property
    def row_bytes(self) -> int:
        return prod(self.shape[1:]) * self.dtype.itemsize

    def block_tensor(self, block: np.ndarray, raw: bytes | None = None) -> WireTensor:
        """The wire tensor of consecutive rows [k, *dims] (batching models only)."""
        dt = self.spec.datatype
        if raw is not None and self.dtype == dt.numpy and dt.name != "BF16":
            data = raw
        else:
            data = tensors.to_bytes(np.ascontiguousarray(block), dt)
        return WireTensor(self.spec.name, dt.name, (block.shape[0], *self.shape[1:]), data)

    def tensor(self, row: np.ndarray, batched: bool, raw: bytes | None = None) -> WireTensor:
        """The wire tensor of one row; `raw` (the row's bytes on disk) is reused when no cast is needed."""
        dt = self.spec.datatype
        if raw is not None and self.dtype == dt.numpy and dt.name != "BF16":
            data = raw
        else:
            data = tensors.to_bytes(row, dt)
        shape = (1, *self.shape[1:]) if batched else self.shape[1:]
        return WireTensor(self.spec.name, dt.name, shape, data)


def _column(spec: ModelSpec, ts: TensorSpec, shape: tuple[int, ...], dtype: np.dtype, source: str) -> _Column:
    """Check an array against its config input at open, so a bad file fails before anything is sent."""
    if ts.datatype.name == "BYTES":
        raise InvalidInput(f"{source}: input '{ts.name}' is BYTES; array files do not carry strings, use JSONL")
    if dtype.hasobject or dtype.kind in "SUVM" or dtype.fields is not None:
        raise InvalidInput(f"{source}: array dtype {dtype} is not a numeric type")
    dims = ts.dims
    ok = len(shape) == len(dims) + 1 and all(d == -1 or d == s for d, s in zip(dims, shape[1:], strict=True))
    if not ok:
        raise InvalidInput(
            f"{source}: array shape {list(shape)} does not match input '{ts.name}' of model '{spec.name}': "
            f"expected [{', '.join(['N', *map(str, dims)])}]"
        )
    target = ts.datatype.numpy
    if dtype != target and not np.can_cast(dtype, target, "same_kind"):
        raise InvalidInput(
            f"{source}: array dtype {dtype} cannot be cast to {ts.datatype.name} for input '{ts.name}'"
        )
    return _Column(ts, shape, dtype)


def _array_rows(start_index: int, start_offset: int) -> int:
    """The first row to read: array cursors carry the row in both fields (offset may be 0)."""
    if start_offset not in (0, start_index):
        raise ValueError(f"array resume cursor mismatch: index {start_index}, offset {start_offset}")
    return start_index


class NpyInput:
    """A single-input model fed from one memory-mapped .npy; row i is item i."""

    kind = "array"

    def __init__(self, path: Path, spec: ModelSpec) -> None:
        self.path = path
        self._batched = spec.max_batch_size > 0
        ts = _single_input(spec, path.name)
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise InvalidInput(f"cannot read '{path.name}' as a .npy array: {exc}") from exc
        if not isinstance(array, np.ndarray):
            raise InvalidInput(f"'{path.name}' is not a .npy array")
        if array.ndim == 0:
            raise InvalidInput(f"'{path.name}' holds a scalar; its first axis must index the items")
        self._column = _column(spec, ts, tuple(array.shape), array.dtype, path.name)
        self._array: np.ndarray | None = array

    def count(self) -> int:
        return self._column.shape[0]

    def read(self, start_index: int = 0, start_offset: int = 0, block_rows: int = 1) -> Iterator[InputItem]:
        array = self._array
        if array is None:
            raise ValueError("read() after close()")
        first, total = _array_rows(start_index, start_offset), self.count()
        if block_rows > 1 and self._batched:
            for start in range(first, total, block_rows):
                stop = min(total, start + block_rows)
                block = np.ascontiguousarray(array[start:stop])
                yield InputItem(start, start, stop, [self._column.block_tensor(block, block.tobytes())],
                                rows=stop - start, count=stop - start)
            return
        for row in range(first, total):
            yield InputItem(row, row, row + 1, [self._column.tensor(array[row], self._batched)])

    def close(self) -> None:
        self._array = None  # drops the memory map


def _single_input(spec: ModelSpec, source: str) -> TensorSpec:
    """The input a .npy feeds: the only input, or the only required one."""
    if len(spec.inputs) == 1:
        return spec.inputs[0]
    required = [t for t in spec.inputs if not t.optional]
    if len(required) == 1:
        return required[0]
    names = [t.name for t in spec.inputs]
    raise InvalidInput(f"{source}: a .npy feeds one input, model '{spec.name}' has inputs {names}; use .npz")


@dataclass(frozen=True, slots=True)
class _Member:
    """One .npz member: where its rows start in the (decompressed) member stream."""

    zip_name: str
    data_start: int
    column: _Column


def _read_member_header(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, source: str
) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data start) from the .npy header, checked against the member's size."""
    with zf.open(info) as fp:
        try:
            version = np.lib.format.read_magic(fp)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
            else:
                raise InvalidInput(f"{source}: member '{info.filename}' has unsupported .npy version {version}")
        except ValueError as exc:
            raise InvalidInput(f"{source}: member '{info.filename}' is not a .npy array: {exc}") from exc
        data_start = fp.tell()
    if fortran:
        raise InvalidInput(f"{source}: member '{info.filename}' is Fortran-ordered; save it C-ordered")
    if dtype.hasobject:
        raise InvalidInput(f"{source}: member '{info.filename}' holds Python objects")
    if len(shape) == 0:
        raise InvalidInput(f"{source}: member '{info.filename}' is a scalar; its first axis must index the items")
    if info.file_size != data_start + prod(shape) * dtype.itemsize:
        raise InvalidInput(f"{source}: member '{info.filename}' is truncated or has trailing data")
    return shape, dtype, data_start


class NpzInput:
    """Named arrays, one per model input, streamed row by row from the zip (stored or deflated)."""

    kind = "array"

    def __init__(self, path: Path, spec: ModelSpec) -> None:
        self.path = path
        self._batched = spec.max_batch_size > 0
        try:
            with zipfile.ZipFile(path) as zf:
                found = self._scan(zf, spec)
        except (OSError, zipfile.BadZipFile, EOFError) as exc:
            raise InvalidInput(f"cannot read '{path.name}' as a .npz archive: {exc}") from exc
        self._members = [found[t.name] for t in spec.inputs if t.name in found]  # config order
        counts = {m.column.shape[0] for m in self._members}
        if len(counts) != 1:
            sizes = {m.column.spec.name: m.column.shape[0] for m in self._members}
            raise InvalidInput(f"{path.name}: arrays must all have the same first dimension, got {sizes}")
        self._count = counts.pop()

    def _scan(self, zf: zipfile.ZipFile, spec: ModelSpec) -> dict[str, _Member]:
        source = self.path.name
        found: dict[str, _Member] = {}
        for info in zf.infolist():
            key = info.filename.removesuffix(".npy")
            ts = spec.input(key)
            if ts is None or key == info.filename:
                names = [t.name for t in spec.inputs]
                raise InvalidInput(f"{source}: '{info.filename}' is not an input of model '{spec.name}' {names}")
            shape, dtype, data_start = _read_member_header(zf, info, source)
            found[key] = _Member(info.filename, data_start, _column(spec, ts, shape, dtype, source))
        missing = [t.name for t in spec.inputs if not t.optional and t.name not in found]
        if missing:
            raise InvalidInput(f"{source}: missing arrays for inputs {missing} of model '{spec.name}'")
        if not found:
            raise InvalidInput(f"{source}: the archive holds no arrays")
        return found

    def count(self) -> int:
        return self._count

    def read(self, start_index: int = 0, start_offset: int = 0, block_rows: int = 1) -> Iterator[InputItem]:
        start = _array_rows(start_index, start_offset)
        blocks = block_rows if block_rows > 1 and self._batched else 0
        with zipfile.ZipFile(self.path) as zf, ExitStack() as stack:
            streams: list[IO[bytes]] = []
            for m in self._members:
                fp = stack.enter_context(zf.open(m.zip_name))
                fp.seek(m.data_start + start * m.column.row_bytes)  # deflated members: read and discard
                streams.append(fp)
            if blocks:
                for first in range(start, self._count, blocks):
                    k = min(self._count, first + blocks) - first
                    inputs = [self._block(m, fp, k) for m, fp in zip(self._members, streams, strict=True)]
                    yield InputItem(first, first, first + k, inputs, rows=k, count=k)
                return
            for row in range(start, self._count):
                inputs = [self._row(m, fp) for m, fp in zip(self._members, streams, strict=True)]
                yield InputItem(row, row, row + 1, inputs)

    def _block(self, member: _Member, fp: IO[bytes], k: int) -> WireTensor:
        col = member.column
        raw = _read_exact(fp, k * col.row_bytes, self.path.name)
        return col.block_tensor(np.frombuffer(raw, dtype=col.dtype).reshape((k, *col.shape[1:])), raw)

    def _row(self, member: _Member, fp: IO[bytes]) -> WireTensor:
        col = member.column
        raw = _read_exact(fp, col.row_bytes, self.path.name)
        row = np.frombuffer(raw, dtype=col.dtype).reshape(col.shape[1:])
        return col.tensor(row, self._batched, raw)

    def close(self) -> None:
        """Nothing held open: each read() owns its zip handle."""


def _read_exact(fp: IO[bytes], n: int, source: str) -> bytes:
    """Exactly n bytes from a member stream (a stream may return short reads)."""
    parts: list[bytes] = []
    left = n
    while left > 0:
        chunk = fp.read(left)
        if not chunk:
            raise InvalidInput(f"{source}: unexpected end of array data")
        parts.append(chunk)
        left -= len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)
