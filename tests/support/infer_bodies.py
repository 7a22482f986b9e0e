"""Reading infer requests and responses the way a strict client would, independently of fleet's codec:
strict JSON (no NaN/Infinity tokens, UTF-8 only), Triton's binary tensor framing, and the inputs of a
request body, so tests can compute what a model must have answered."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

NUMPY = {"BOOL": "?", "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "<i1",
         "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def strict_json(raw: bytes) -> Any:
    """Parse `raw` as RFC 8259 JSON: UTF-8 text, no NaN/Infinity. Raises ValueError otherwise."""
    return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)


def _bytes_elements(raw: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        out.append(raw[pos + 4: pos + 4 + n])
        pos += 4 + n
    assert pos == len(raw), "BYTES framing overruns its buffer"
    return out


def _array(datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    if datatype == "BYTES":
        arr = np.empty(len(_bytes_elements(raw)), dtype=object)
        arr[:] = _bytes_elements(raw)
        return arr.reshape(shape)
    if datatype == "BF16":
        return (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4").reshape(shape)
    return np.frombuffer(raw, NUMPY[datatype]).reshape(shape)


def _flat(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    for item in data:
        out.extend(_flat(item))
    return out


def _from_json(datatype: str, shape: list[int], data: Any) -> np.ndarray:
    flat = _flat(data)
    if datatype == "BYTES":
        arr = np.empty(len(flat), dtype=object)
        arr[:] = [s.encode() for s in flat]
        return arr.reshape(shape)
    return np.array(flat, dtype="<f4" if datatype == "BF16" else NUMPY[datatype]).reshape(shape)


def _tensors(doc: Mapping[str, Any], key: str, tail: bytes) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    offset = 0
    for t in doc.get(key) or []:
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is None:
            out[t["name"]] = _from_json(t["datatype"], t["shape"], t["data"])
        else:
            out[t["name"]] = _array(t["datatype"], t["shape"], tail[offset: offset + size])
            offset += size
    assert offset == len(tail), "binary data left over"
    return out


def split(body: bytes, header_length: str | None) -> tuple[Any, bytes]:
    n = len(body) if header_length is None else int(header_length)
    return strict_json(body[:n]), body[n:]


def response_outputs(headers: Mapping[str, str], body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the response's JSON header, its outputs by name, JSON or binary)."""
    doc, tail = split(body, headers.get("inference-header-content-length"))
    return doc, _tensors(doc, "outputs", tail)


def request_inputs(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the request's JSON header, its inputs by name) of a request the server accepted."""
    doc, tail = split(body, header_length)
    return doc, _tensors(doc, "inputs", tail)
