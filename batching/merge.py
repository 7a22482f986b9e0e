"""Merge the inputs of a dispatched batch into batch tensors, and split the outputs back per request.

``merge`` and ``split`` are inverses along axis 0 (the batch axis): request i owns the rows
``[sum(rows[:i]), sum(rows[:i+1]))`` of every batch tensor. Both work for numeric dtypes and for
numpy object arrays (Triton BYTES). Pure: no I/O, no clock, no framework imports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["merge", "split"]


def merge(requests: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate each named input along axis 0, in request order.

    Every request must supply the same input names, each tensor must have a batch axis (ndim >= 1)
    and tensors of one name must share dtype and trailing shape; otherwise ValueError. Silent dtype
    promotion is refused because it would hand the model a dtype its config never declared (only
    fixed-width ``S``/``U`` arrays of different widths are allowed, since widening them is lossless).
    A single request is returned as a new dict holding the very same arrays (no copy).
    Raises ValueError if ``requests`` is empty.
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
        return dict(first)
    return {name: _concatenate(name, [request[name] for request in requests]) for name in first}


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
