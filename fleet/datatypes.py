"""The protocol datatypes (KServe v2 / Triton) and how each maps to config names and numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Datatype:
    name: str  # protocol name, e.g. "FP32"
    config_name: str  # config.pbtxt name, e.g. "TYPE_FP32"
    itemsize: int  # bytes per element on the wire; 0 = variable (BYTES)
    numpy: np.dtype  # what the model sees; BF16 is widened to float32, BYTES is object


_ALL = [
    Datatype("BOOL", "TYPE_BOOL", 1, np.dtype(np.bool_)),
    Datatype("UINT8", "TYPE_UINT8", 1, np.dtype("<u1")),
    Datatype("UINT16", "TYPE_UINT16", 2, np.dtype("<u2")),
    Datatype("UINT32", "TYPE_UINT32", 4, np.dtype("<u4")),
    Datatype("UINT64", "TYPE_UINT64", 8, np.dtype("<u8")),
    Datatype("INT8", "TYPE_INT8", 1, np.dtype("<i1")),
    Datatype("INT16", "TYPE_INT16", 2, np.dtype("<i2")),
    Datatype("INT32", "TYPE_INT32", 4, np.dtype("<i4")),
    Datatype("INT64", "TYPE_INT64", 8, np.dtype("<i8")),
    Datatype("FP16", "TYPE_FP16", 2, np.dtype("<f2")),
    Datatype("FP32", "TYPE_FP32", 4, np.dtype("<f4")),
    Datatype("FP64", "TYPE_FP64", 8, np.dtype("<f8")),
    Datatype("BF16", "TYPE_BF16", 2, np.dtype("<f4")),
    Datatype("BYTES", "TYPE_STRING", 0, np.dtype(np.object_)),
]

BY_NAME: dict[str, Datatype] = {d.name: d for d in _ALL}
BY_CONFIG: dict[str, Datatype] = {d.config_name: d for d in _ALL}


def from_config(config_name: str) -> Datatype:
    return BY_CONFIG[config_name]


def from_numpy(dtype: np.dtype) -> Datatype:
    """The protocol datatype for a numpy dtype (object/bytes/str arrays are BYTES)."""
    if dtype.kind in ("O", "S", "U"):
        return BY_NAME["BYTES"]
    for d in _ALL:
        if d.name != "BF16" and d.numpy == dtype.newbyteorder("<"):
            return d
    raise ValueError(f"no protocol datatype for numpy dtype {dtype}")
