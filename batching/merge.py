"""Merge the inputs of a dispatched batch into batch tensors, and split the outputs back per request.

``merge`` and ``split`` are inverses along axis 0 (the batch axis): request i owns the rows
``[sum(rows[:i]), sum(rows[:i+1]))`` of every batch tensor. Both work for numeric dtypes and for
numpy object arrays (Triton BYTES). Pure: no I/O, no clock, no framework imports.

Ragged batching (protocol.md §3.6, Triton's ragged_batching.md): inputs named in ``merge``'s
``ragged`` are concatenated as 1-D tensors of all their elements, in request order, whatever their
shapes; ``batch_input_parts`` builds the `batch_input` tensors that tell a model where each request's
elements are; ``scatter`` cuts a `batch_output` (BATCH_SCATTER_WITH_INPUT_SHAPE) back into per-request
shapes.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from fleet.model_spec import BatchInputKind

__all__ = ["batch_input_parts", "merge", "scatter", "split"]


def merge(
    requests: Sequence[Mapping[str, np.ndarray]], ragged: Collection[str] = frozenset()
) -> dict[str, np.ndarray]:
    """Concatenate each named input along axis 0, in request order.

    Every request must supply the same input names, each tensor must have a batch axis (ndim >= 1)
    and tensors of one name must share dtype and trailing shape; otherwise ValueError. Silent dtype
    promotion is refused because it would hand the model a dtype its config never declared (only
    fixed-width ``S``/``U`` arrays of different widths are allowed, since widening them is lossless).
    Inputs named in ``ragged`` may differ in shape: each becomes the 1-D concatenation of every
    request's elements in row-major order (Triton's framework backends take ragged inputs that way).
    A single request is returned as a new dict holding the very same arrays (no copy; ragged ones as
    1-D views). Raises ValueError if ``requests`` is empty.
    """
    if not requests:
        raise ValueError("merge() needs at least one request")
    first = requests[0]
    names = set(first)
    for index, request in enumerate(requests):
        if set(request) != names:
            raise ValueError(
                f"request {index} has inputs {sorted(request)}, request 0 has {sorted(names)}"
            )
        for name, array in request.items():
            _check_batch_axis(name, array)
    if len(requests) == 1:
        # Batch of one: the arrays already are the batch tensors, so skip the copy.
        return {name: array.reshape(-1) if name in ragged else array for name, array in first.items()}
    return {
        name: _concatenate(name, [request[name].reshape(-1) if name in ragged else request[name]
                                  for request in requests])
        for name in first
    }


def batch_input_parts(
    kind: BatchInputKind, dtype: np.dtype, shapes: Sequence[Sequence[int]]
) -> list[np.ndarray]:
    """Each request's part of one `batch_input` tensor, given the shape of its source input in every
    request of the batch (batch dim first). Concatenated along axis 0 the parts are the tensor Triton's
    backends build for the whole batch (backend_input_collector ProcessBatchInput); each part alone is
    what model_config.proto describes per request. With counts c_i = elements of request i's source:

    * ELEMENT_COUNT: ``[c_i]``; the batch tensor has shape [requests].
    * ACCUMULATED_ELEMENT_COUNT: ``[c_0 + ... + c_i]``, the end offset of request i's elements.
    * ACCUMULATED_ELEMENT_COUNT_WITH_ZERO: the same, with a leading 0 in the first part: shape
      [requests + 1], request i's elements are ``[t[i], t[i + 1])``.
    * MAX_ELEMENT_COUNT_AS_SHAPE: the first part has shape ``[max c_i]``, the others ``[0]`` (the
      shape is the information; Triton leaves the data uninitialised, here it is zeros).
    * ITEM_SHAPE: one row per batch item, the source's shape without the batch dim: request i's part
      has shape [rows_i, ndim - 1].
    * ITEM_SHAPE_FLATTEN: the same, flattened: shape [rows_i * (ndim - 1)].

    Raises ValueError for an empty batch or a source without a batch dim (ITEM_SHAPE kinds).
    """
    if not shapes:
        raise ValueError("a batch input needs at least one request")
    counts = [math.prod(shape) for shape in shapes]
    if kind in (BatchInputKind.ELEMENT_COUNT, BatchInputKind.ACCUMULATED_ELEMENT_COUNT,
                BatchInputKind.ACCUMULATED_ELEMENT_COUNT_WITH_ZERO):
        values = np.cumsum(counts) if kind != BatchInputKind.ELEMENT_COUNT else np.asarray(counts)
        parts = [values[i:i + 1].astype(dtype) for i in range(len(shapes))]
        if kind == BatchInputKind.ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
            parts[0] = np.concatenate([np.zeros(1, dtype), parts[0]])
        return parts
    if kind == BatchInputKind.MAX_ELEMENT_COUNT_AS_SHAPE:
        return [np.zeros(max(counts) if i == 0 else 0, dtype) for i in range(len(shapes))]
    parts = []
    for shape in shapes:
        if len(shape) == 0:
            raise ValueError(f"{kind.value} needs a source input with a batch dim, got shape {list(shape)}")
        items = np.tile(np.asarray(shape[1:], dtype), (shape[0], 1))  # [rows, ndim - 1]
        parts.append(items.reshape(-1) if kind == BatchInputKind.ITEM_SHAPE_FLATTEN else items)
    return parts


def scatter(output: np.ndarray, shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Cut a batch output into one tensor per request of the given shapes: request i gets the next
    ``prod(shapes[i])`` elements in row-major order (Triton's BATCH_SCATTER_WITH_INPUT_SHAPE), as
    views. Raises ValueError unless the shapes account for exactly the output's elements."""
    counts = [math.prod(shape) for shape in shapes]
    if any(d < 0 for shape in shapes for d in shape) or sum(counts) != output.size:
        raise ValueError(f"cannot scatter an output of {output.size} elements into shapes "
                         f"{[list(s) for s in shapes]}")
    flat = output.reshape(-1)
    parts, start = [], 0
    for shape, count in zip(shapes, counts, strict=True):
        parts.append(flat[start:start + count].reshape(tuple(shape)))
        start += count
    return parts


def split(outputs: Mapping[str, np.ndarray], rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Cut each batch output back into per-request views along axis 0.

    Returns one dict per entry of ``rows``, in order; result i maps every output name to rows
    ``[sum(rows[:i]), sum(rows[:i+1]))`` of that output, as a view (no copy). Raises ValueError if a
    row count is negative, or an output has no batch axis or a first dim other than ``sum(rows)``.
    """
    if any(count < 0 for count in rows):
        raise ValueError(f"row counts must be >= 0, got {list(rows)}")
    total = sum(rows)
    for name, array in outputs.items():
        _check_batch_axis(name, array)
        if array.shape[0] != total:
            raise ValueError(
                f"output {name!r} has {array.shape[0]} rows, the batch has {total} ({list(rows)})"
            )
    results: list[dict[str, np.ndarray]] = []
    start = 0
    for count in rows:
        stop = start + count
        # Basic slicing returns views, so a batch's outputs are never copied per request.
        results.append({name: array[start:stop] for name, array in outputs.items()})
        start = stop
    return results


def _check_batch_axis(name: str, array: np.ndarray) -> None:
    if array.ndim == 0:
        raise ValueError(f"tensor {name!r} is a scalar; it has no batch axis to merge or split on")


def _concatenate(name: str, arrays: list[np.ndarray]) -> np.ndarray:
    # Fixed-width byte/str arrays of different widths widen losslessly, so only their kind must agree.
    kinds = {array.dtype.kind if array.dtype.kind in "SU" else array.dtype.str for array in arrays}
    if len(kinds) > 1:
        dtypes = sorted({str(array.dtype) for array in arrays})
        raise ValueError(f"input {name!r} has mixed dtypes {dtypes}")
    trailing = {array.shape[1:] for array in arrays}
    if len(trailing) > 1:
        raise ValueError(f"input {name!r} has mismatched non-batch shapes {sorted(trailing)}")
    return np.concatenate(arrays, axis=0)
