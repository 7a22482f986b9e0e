"""Packing job items into multi-row requests and splitting the replies back, in input order.

A bulk job sends many small items; packing consecutive compatible items into one request along the
batch axis (axis 0) lets the worker's batcher see full batches. Tensors stay wire bytes throughout:
fixed-size rows are contiguous, and BYTES elements are self-framed, so packing is a byte join and
unpacking a byte split (BYTES by walking the 4-byte length prefixes). Pure functions, no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Iterable, Iterator, Sequence

from fleet import tensors
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.jobs.items import InputItem
from fleet.model_spec import ModelSpec

_LEN = struct.Struct("<I")


def signature(item: InputItem) -> Hashable:
    """What must agree for two items to share a request: input layout (less the batch dim), outputs,
    parameters. (An item may carry it already: `InputItem.key`.)"""
    layout = tuple((t.name, t.datatype, tuple(t.shape[1:])) for t in item.inputs or ())
    outputs = None if item.outputs is None else tuple(item.outputs)
    params = tuple(sorted((k, type(v).__name__, v) for k, v in item.parameters.items()))
    return layout, outputs, params


def request_batches(spec: ModelSpec, priority: int, pack_batches: int, window_rows: int) -> int:
    """How many batches' rows (max_batch_size each) a job's request holds: its `pack_batches` where the model
    runs such a request in parts (`ModelSpec.runs_in_parts`, workers/request_parts.py) and the job is on the
    bulk lane (priority 0: a level's lane keeps its bound in rows), at most half the job's window (so that
    two requests are in flight); else 1."""
    if pack_batches <= 1 or priority != 0 or not spec.runs_in_parts:
        return 1
    return max(1, min(pack_batches, window_rows // (2 * spec.max_batch_size)))


def group_items(items: Iterable[InputItem], max_rows: int) -> Iterator[list[InputItem]]:
    """Consecutive groups of compatible items with at most `max_rows` rows in all, lazily.

    An item with an error, or with more rows than `max_rows` on its own, is a group by itself; a
    group is yielded as soon as it is full, so no item waits on the next one being read.
    """
    group: list[InputItem] = []
    group_rows = 0
    group_sig: Hashable = None
    for item in items:
        if item.error is not None or max_rows <= 1 or item.rows >= max_rows:
            if group:
                yield group
                group, group_rows = [], 0
            yield [item]
            continue
        sig = item.key if item.key is not None else signature(item)
        if group and (sig != group_sig or group_rows + item.rows > max_rows):
            yield group
            group, group_rows = [], 0
        if not group:
            group_sig = sig
        group.append(item)
        group_rows += item.rows
        if group_rows == max_rows:
            yield group
            group, group_rows = [], 0
    if group:
        yield group


def pack(group: Sequence[InputItem]) -> list[WireTensor]:
    """One request's inputs: each input concatenated along axis 0; a single item's inputs as they are."""
    if not group:
        raise ValueError("cannot pack an empty group")
    columns: list[list[WireTensor]] = []
    for item in group:
        if item.inputs is None:
            raise ValueError(f"item {item.index} has no inputs ({item.error})")
        columns.append(item.inputs)
    if len(columns) == 1:
        return columns[0]
    packed: list[WireTensor] = []
    for parts in zip(*columns, strict=True):
        first = parts[0]
        if any((t.name, t.datatype, t.shape[1:]) != (first.name, first.datatype, first.shape[1:]) for t in parts):
            raise ValueError(f"cannot pack input '{first.name}': the items disagree on name, datatype or shape")
        rows = sum(t.shape[0] for t in parts)
        packed.append(WireTensor(first.name, first.datatype, (rows, *first.shape[1:]), b"".join(t.data for t in parts)))
    return packed


def _bytes_cuts(data: bytes | memoryview, elements: Sequence[int], name: str) -> list[int]:
    """Byte offsets where each piece of `elements` BYTES elements ends, walking the length prefixes."""
    view = memoryview(data)
    cuts: list[int] = []
    pos = 0
    for count in elements:
        for _ in range(count):
            if pos + 4 > len(view):
                raise InvalidInput(f"output '{name}': BYTES data ends inside a length prefix")
            (n,) = _LEN.unpack_from(view, pos)
            pos += 4 + n
            if pos > len(view):
                raise InvalidInput(f"output '{name}': a BYTES element runs past the end of the data")
        cuts.append(pos)
    if pos != len(view):
        raise InvalidInput(f"output '{name}': BYTES data holds more elements than its shape")
    return cuts


def _cuts(t: WireTensor, rows: Sequence[int]) -> list[int]:
    """Byte offsets where each piece of `t` (`rows[i]` rows along axis 0) ends; InvalidInput where `t` does
    not hold sum(rows) rows."""
    if not t.shape or t.shape[0] != sum(rows):
        raise InvalidInput(
            f"output '{t.name}' has shape {list(t.shape)}, expected {sum(rows)} rows along the batch axis"
        )
    per_row = tensors.element_count(t.shape[1:])
    if t.datatype == "BYTES":
        return _bytes_cuts(t.data, [r * per_row for r in rows], t.name)
    row_bytes = per_row * tensors.lookup(t.datatype).itemsize
    if len(t.data) != row_bytes * t.shape[0]:
        raise InvalidInput(
            f"output '{t.name}' holds {len(t.data)} bytes, its shape {list(t.shape)} needs {row_bytes * t.shape[0]}"
        )
    cuts, end = [], 0
    for r in rows:
        end += r * row_bytes
        cuts.append(end)
    return cuts


def _split(t: WireTensor, rows: Sequence[int]) -> list[WireTensor]:
    view = memoryview(t.data)
    pieces, start = [], 0
    for r, end in zip(rows, _cuts(t, rows), strict=True):
        pieces.append(WireTensor(t.name, t.datatype, (r, *t.shape[1:]), bytes(view[start:end])))
        start = end
    return pieces


def check_rows(outputs: Sequence[WireTensor], rows: Sequence[int]) -> None:
    """unpack's checks without its split: InvalidInput where an output does not hold the items' rows (a
    reply is checked as it comes, and split, if at all, as its items are written: JsonlOutput.write_reply)."""
    if len(rows) > 1:
        for t in outputs:
            _cuts(t, rows)


def unpack(outputs: Sequence[WireTensor], rows: Sequence[int]) -> list[list[WireTensor]]:
    """Split a packed reply into one output list per item (`rows[i]` rows each), in order.

    A single item gets the outputs unchanged, so a non-batching model's outputs (no batch axis)
    pass through. Raises InvalidInput when an output's first dim is not sum(rows).
    """
    if len(rows) == 1:
        return [list(outputs)]
    per_item: list[list[WireTensor]] = [[] for _ in rows]
    for t in outputs:
        for bucket, piece in zip(per_item, _split(t, rows), strict=True):
            bucket.append(piece)
    return per_item


def explode(item: InputItem) -> list[InputItem]:
    """A block of array rows (`count` > 1) as one item per row, so rows of a failed block fail alone."""
    if item.count == 1 or item.inputs is None:
        return [item]
    out = []
    for r in range(item.count):
        inputs = []
        for t in item.inputs:
            size = len(t.data) // t.shape[0]
            inputs.append(WireTensor(t.name, t.datatype, (1, *t.shape[1:]), t.data[r * size:(r + 1) * size]))
        out.append(InputItem(item.index + r, item.line + r, item.index + r + 1, inputs, item.outputs,
                             item.client_id, item.parameters))
    return out
