"""A tensor's JSON `data` (KServe v2) <-> its wire bytes (fleet.tensors), for every datatype.

Input (`pack_json`): `data` is either flat (row-major, the element count of the shape) or nested exactly
as the shape; anything ragged, of the wrong JSON type, or out of the datatype's range is an InvalidInput
that names the input and what is wrong with it. The common case costs one type check pass and one numpy
conversion: nothing is walked element by element in Python beyond that.

Output (`json_data`): only what JSON carries unaltered is written as JSON. NaN and infinities are no JSON
numbers, and bytes that are not UTF-8 are no JSON string (replacing them would silently change the data),
so such an output is an InvalidInput telling the client to request that output as binary, where every
bit passes (Triton answers the same way for outputs JSON cannot carry, e.g. FP16: INVALID_ARG, "use the
binary data format for output"). The finiteness check is one vectorized pass over float outputs, and only
on the JSON path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fleet import tensors
from fleet.datatypes import Datatype
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput

# _pack_numbers casts JSON numbers without np.errstate and tells an overflow by the inf it leaves; numpy's
# "overflow encountered in cast" warning for it is not news then (filtered for this module's calls only).
warnings.filterwarnings("ignore", message="overflow encountered in cast", category=RuntimeWarning,
                        module=__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1
_BF16_MAX = float.fromhex("0x1.fep+127")  # BF16's largest finite value (bits 0x7F7F): 3.3895313892515355e+38

# JSON values that are never a number element; bool is an int to Python, not to a tensor of numbers.
_NOT_A_NUMBER = (bool, str, list, dict, type(None))
_NUMBER_TYPES = frozenset({int, float})
_ASK_BINARY = ('request it as binary data instead ("parameters": {"binary_data": true} in its "outputs" '
               'entry, or "binary_data_output": true for every output)')


def _nesting_error(name: str, shape: Sequence[int], count: int) -> InvalidInput:
    return InvalidInput(f"input '{name}': 'data' must be a flat list of {count} elements or nested exactly as "
                        f"its shape {list(shape)}")


def _elements(data: Any, shape: Sequence[int], name: str) -> list[Any]:
    """The row-major elements of `data`: flat as sent, or flattened level by level while checking that each
    level has exactly the length its shape dim says (Triton's reader would flatten `[[1, 2, 3], [4]]` for
    shape [4]; a ragged nesting is almost always a client bug, so it is refused). A list left among the
    elements (flat data with a nested part, or nested deeper than the shape) is caught by the type checks."""
    if not isinstance(data, list):
        return [data]  # a lone scalar: Triton takes it for a one-element tensor
    if not data or not isinstance(data[0], list):
        return data
    level: list[Any] = [data]
    for n in shape:
        below: list[Any] = []
        for item in level:
            if not isinstance(item, list) or len(item) != n:
                raise _nesting_error(name, shape, tensors.element_count(shape))
            below.extend(item)
        level = below
    return level


def _first_bad(flat: list[Any], ok: Callable[[Any], bool]) -> tuple[int, Any]:
    """The failure path only: which element broke a check that the fast path ran with any()."""
    return next((i, v) for i, v in enumerate(flat) if not ok(v))


def _type_error(name: str, shape: Sequence[int], flat: list[Any], ok: Callable[[Any], bool],
                expects: str) -> InvalidInput:
    i, v = _first_bad(flat, ok)
    if isinstance(v, list):
        return _nesting_error(name, shape, len(flat))
    got = "null" if v is None else "a boolean" if isinstance(v, bool) else \
        "an object" if isinstance(v, dict) else "a string" if isinstance(v, str) else \
        "a number with a fraction or exponent" if isinstance(v, float) else "a number"
    return InvalidInput(f"input '{name}': element {i} of 'data' is {got}; {expects}")


def _pack_bytes(flat: list[Any], name: str, shape: Sequence[int]) -> bytes:
    if any(not isinstance(v, str) for v in flat):
        raise _type_error(name, shape, flat, lambda v: isinstance(v, str), "BYTES elements are JSON strings")
    try:
        encoded = [v.encode() for v in flat]
    except UnicodeEncodeError:
        # JSON can spell a lone surrogate (\ud800), which is no Unicode text and has no UTF-8 form.
        i, _ = _first_bad(flat, lambda v: not any("\ud800" <= c <= "\udfff" for c in v))
        raise InvalidInput(f"input '{name}': element {i} of 'data' holds a lone surrogate escape (\\ud800 to "
                           f"\\udfff), which is not text; send bytes that are not text as binary data") from None
    arr = np.empty(len(encoded), dtype=np.object_)
    arr[:] = encoded
    return tensors.serialize_bytes(arr)


def _pack_numbers(flat: list[Any], dt: Datatype, name: str, shape: Sequence[int]) -> bytes:
    # The elements' types in one pass in C (a generator over isinstance was most of a JSONL job line's
    # parsing); JSON numbers are exactly int and float (bool is its own type here).
    kinds = set(map(type, flat))
    if not kinds <= _NUMBER_TYPES:
        raise _type_error(name, shape, flat, lambda v: not isinstance(v, _NOT_A_NUMBER),
                          f"{dt.name} elements are JSON numbers")
    if dt.numpy.kind in "iu" and float in kinds:
        raise _type_error(name, shape, flat, lambda v: not isinstance(v, float),
                          f"{dt.name} elements are JSON integers")
    try:
        # No np.errstate here (~2.5 of the ~17 µs 256 floats took; bench/RESULTS.md, stop 69): an integer out
        # of range raises OverflowError anyway, and a float out of range (1e39 as FP32) becomes inf, which the
        # finiteness check below catches (its warning is filtered, above; where warnings are errors, as in the
        # tests, that overflow comes as RuntimeWarning instead).
        arr = np.array(flat, dtype=dt.numpy)
    except (OverflowError, FloatingPointError, ValueError, TypeError):  # (FloatingPointError: a caller's errstate)
        raise _range_error(name, dt) from None
    except RuntimeWarning as exc:
        if "overflow" not in str(exc):
            raise
        raise _range_error(name, dt) from None
    if dt.numpy.kind == "f" and not np.isfinite(arr).all():
        try:  # the failure path only: which it was, a value past the datatype's range or one infinite already
            with np.errstate(over="raise", invalid="raise"):
                np.array(flat, dtype=dt.numpy)
        except FloatingPointError:
            raise _range_error(name, dt) from None
        # 1e400: json made it inf already
        raise InvalidInput(f"input '{name}': 'data' must be finite numbers (1e400 is infinite as a double)")
    if dt.name == "BF16":  # cast to float32 above, then rounded to BF16, whose range is a little narrower
        bits = tensors.float32_to_bf16(arr)
        if ((bits & 0x7FFF) == 0x7F80).any():  # rounded to infinity (FP32's 3.4e38, say)
            raise _range_error(name, dt)
        return bits.tobytes()
    return tensors.to_bytes(arr, dt)


def _range_error(name: str, dt: Datatype) -> InvalidInput:
    if dt.numpy.kind in "iu":
        kind, bounds = "integers", f"{np.iinfo(dt.numpy).min} to {np.iinfo(dt.numpy).max}"
    else:
        top = _BF16_MAX if dt.name == "BF16" else float(np.finfo(dt.numpy).max)  # (BF16 is float32 to numpy)
        kind, bounds = "finite numbers", f"{-top} to {top}"
    return InvalidInput(f"input '{name}': 'data' holds a value outside the range of {dt.name}; its elements "
                        f"must be {kind} from {bounds}")


def pack_json(data: Any, dt: Datatype, shape: Sequence[int], name: str) -> bytes:
    """The wire bytes of input `name`'s JSON `data` as datatype `dt` of `shape` (row-major); raises
    InvalidInput when the data does not have the shape's element count, nests otherwise than the shape, or
    holds an element that is not of `dt`'s JSON type or not within its range."""
    count = tensors.element_count(shape)
    flat = _elements(data, shape, name)
    if len(flat) != count:
        raise InvalidInput(f"unexpected number of elements for input '{name}': got {len(flat)}, expected {count}")
    if dt.name == "BYTES":
        return _pack_bytes(flat, name, shape)
    if dt.name == "BOOL":
        if any(not isinstance(v, bool) for v in flat):
            raise _type_error(name, shape, flat, lambda v: isinstance(v, bool), "BOOL elements are JSON booleans")
        return np.array(flat, dtype=np.bool_).tobytes()
    return _pack_numbers(flat, dt, name, shape)


def json_data(t: WireTensor, dt: Datatype) -> list[Any]:
    """Output `t` as a flat JSON `data` list; raises InvalidInput (asking for binary output) for NaN or
    infinite floats and for BYTES elements that are not UTF-8 text, which JSON cannot carry unaltered."""
    arr = tensors.from_bytes(t.data, dt, t.shape).reshape(-1)
    if dt.name == "BYTES":
        try:
            return [v.decode() for v in arr]
        except UnicodeDecodeError:
            i, _ = _first_bad(list(arr), _is_utf8)
            raise InvalidInput(f"output '{t.name}': element {i} is not UTF-8 text, which a JSON string cannot "
                               f"carry unaltered; {_ASK_BINARY}") from None
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise _not_finite(t.name)
    values: list[Any] = arr.tolist()
    return values


def json_array(t: WireTensor, dt: Datatype) -> np.ndarray | list[str]:
    """json_data's values for orjson (OPT_SERIALIZE_NUMPY), with the same refusals: numbers stay a numpy
    array, which orjson writes in one pass, float32 in the shortest form that reads back to the same value
    ("0.1", not json's "0.10000000149011612"); FP16 and BF16 go as float32 (exact)."""
    if dt.name == "BYTES":
        return json_data(t, dt)
    return _json_numbers(tensors.from_bytes(t.data, dt, t.shape).reshape(-1), t.name)


def json_rows(t: WireTensor, dt: Datatype) -> np.ndarray:
    """json_array's values of a number output with a batch axis, one row per index of that axis (so that
    the rows of each request packed into it are a slice: a bulk job's reply; fleet/jobs/jsonl_output.py), with
    json_array's refusals for the whole of it."""
    return _json_numbers(tensors.from_bytes(t.data, dt, t.shape).reshape(t.shape[0], -1), t.name)


def _json_numbers(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise _not_finite(name)
        if arr.dtype.itemsize < 4:
            arr = arr.astype(np.float32)
    return np.ascontiguousarray(arr)


def _not_finite(name: str) -> InvalidInput:
    return InvalidInput(f"output '{name}' holds NaN or infinity, which JSON cannot represent; {_ASK_BINARY}")


def _is_utf8(v: bytes) -> bool:
    try:
        v.decode()
    except UnicodeDecodeError:
        return False
    return True
