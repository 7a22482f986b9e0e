"""Datatype tables, BYTES (de)serialisation and errors of the `triton_python_backend_utils` shim.
Re-exported by triton_python_backend_utils; models never import this module directly."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from fleet.tensors import deserialize_bytes, serialize_bytes

# --- datatypes ----------------------------------------------------------------------------------
# TRITONSERVER_DataType: (enum value, protocol name, numpy type). BF16 has no numpy type: fleet
# widens it to float32 (fleet.datatypes), so that is what a BF16 tensor holds here.

_DTYPES: list[tuple[int, str, Any]] = [
    (1, "BOOL", np.bool_),
    (2, "UINT8", np.uint8),
    (3, "UINT16", np.uint16),
    (4, "UINT32", np.uint32),
    (5, "UINT64", np.uint64),
    (6, "INT8", np.int8),
    (7, "INT16", np.int16),
    (8, "INT32", np.int32),
    (9, "INT64", np.int64),
    (10, "FP16", np.float16),
    (11, "FP32", np.float32),
    (12, "FP64", np.float64),
    (13, "BYTES", np.object_),
    (14, "BF16", np.float32),
]
TYPE_INVALID = 0
_TO_NUMPY = {code: np_type for code, _, np_type in _DTYPES}
_TO_NAME = {code: name for code, name, _ in _DTYPES}
_FROM_NAME = {name: code for code, name, _ in _DTYPES}
_FROM_NUMPY = {np.dtype(np_type): code for code, _, np_type in _DTYPES[:12]}

# Same table as Triton's (TYPE_BOOL maps to Python's bool there too).
TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """numpy type for a config data_type such as "TYPE_FP32"; KeyError if unknown."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    """numpy type for a TRITONSERVER_DataType value (None if unknown; BF16 -> float32)."""
    return _TO_NUMPY.get(int(data_type))


def numpy_to_triton_type(data_type: Any) -> int | None:
    """TRITONSERVER_DataType value for a numpy dtype or type (object/bytes/str -> BYTES)."""
    try:
        dt = np.dtype(data_type)
    except TypeError:
        return None
    if dt.kind in ("O", "S", "U"):
        return 13
    return _FROM_NUMPY.get(dt)


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | None:
    """Flatten a BYTES array (C order) to <u32 LE length><bytes> elements; None for other dtypes."""
    if input_tensor.dtype.kind not in ("O", "S", "U"):
        return None
    return serialize_bytes(input_tensor)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Inverse of serialize_byte_tensor: a 1-D object array of bytes."""
    return deserialize_bytes(encoded_tensor)


# --- errors -------------------------------------------------------------------------------------


class _ErrorCode(enum.IntEnum):
    # TRITONSERVER_Error_Code; the names are fleet's ErrorCode values.
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TritonError:
    """An error to put in an InferenceResponse; the code maps to an HTTP status (protocol §1.13)."""

    UNKNOWN = _ErrorCode.UNKNOWN
    INTERNAL = _ErrorCode.INTERNAL
    NOT_FOUND = _ErrorCode.NOT_FOUND
    INVALID_ARG = _ErrorCode.INVALID_ARG
    UNAVAILABLE = _ErrorCode.UNAVAILABLE
    UNSUPPORTED = _ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = _ErrorCode.ALREADY_EXISTS
    CANCELLED = _ErrorCode.CANCELLED

    def __init__(self, message: str, code: int = _ErrorCode.INTERNAL) -> None:
        self._message = message
        self._code = _ErrorCode(code)

    def message(self) -> str:
        return self._message

    def code(self) -> _ErrorCode:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code=TritonError.{self._code.name})"


class TritonModelException(Exception):
    """Raised for fatal model errors and BLS failures."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self._message = message

    def message(self) -> str:
        return self._message
