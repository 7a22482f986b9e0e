"""`reshape` on model inputs and outputs, as Triton's core applies it for every backend.

A client sends and receives tensors shaped by the config's `dims`; the model takes and produces them
shaped by `reshape`. The bytes never change (row-major either way): only the shape does. Variable-size
dimensions carry over in order: the first -1 of one shape takes the value of the first -1 of the other
(Triton's InferenceRequest::Normalize for inputs, InferenceResponse::Output::Reshape for outputs).
config_checks.py has already checked that dims and reshape agree (element counts, -1 chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

from fleet.config_checks import WILDCARD_DIM


def _fill(pattern: Sequence[int], variable: list[int]) -> tuple[int, ...] | None:
    values = iter(variable)
    out = []
    for d in pattern:
        if d == WILDCARD_DIM:
            v = next(values, None)
            if v is None:
                return None
            out.append(v)
        else:
            out.append(d)
    return tuple(out) if next(values, None) is None else None


def model_shape(dims: Sequence[int], reshape: Sequence[int], shape: Sequence[int],
                batched: bool) -> tuple[int, ...]:
    """The shape the model gets for an input the client sent with `shape` (already checked against
    `dims` by the gateway)."""
    lead = tuple(shape[:1]) if batched else ()
    rest = shape[1:] if batched else shape
    variable = [s for d, s in zip(dims, rest, strict=False) if d == WILDCARD_DIM]
    out = _fill(reshape, variable)
    assert out is not None, "config_checks validated dims against reshape"
    return lead + out


def client_shape(dims: Sequence[int], reshape: Sequence[int], shape: Sequence[int],
                 batched: bool) -> tuple[int, ...] | None:
    """The shape the client gets for an output the model produced with `shape`; None if `shape` does
    not fit the reshape (a model bug, answered INTERNAL)."""
    lead = tuple(shape[:1]) if batched and len(shape) > 0 else ()
    rest = shape[len(lead):]
    if len(rest) != len(reshape) or any(d != WILDCARD_DIM and d != r for d, r in zip(reshape, rest, strict=True)):
        return None
    out = _fill(dims, [r for d, r in zip(reshape, rest, strict=True) if d == WILDCARD_DIM])
    return None if out is None else lead + out
