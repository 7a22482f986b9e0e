"""Infer request parsing and response rendering: KServe v2 JSON plus Triton's binary tensor extension.

Shared by the gateway (HTTP /infer) and the bulk-job runner (a JSON Lines job's line is exactly an
/infer body; its output line is exactly the /infer response's data), so both read and write the one
format the same way. Pure: fleet and numpy only.

`parse_infer` turns an HTTP body into envelope tensors, checked against the model config so a bad
request never reaches a worker. Binary inputs are sliced out of the body as bytes (no Python lists);
JSON `data` is packed once with numpy. `render_infer` does the reverse for the reply.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleet import tensors
from fleet.datatypes import Datatype
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput, Unsupported
from fleet.model_config import ModelSpec, TensorSpec

# Request-level parameters with a meaning to the server; the rest pass through to the model.
RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output", "headers"}
)


MAX_ID_CHARS = 1024  # echoed in the response and carried through Redis: bounded


@dataclass(slots=True)
class ParsedInfer:
    client_id: str
    inputs: list[WireTensor]
    outputs: list[str] | None  # requested names; None = every output
    binary_outputs: frozenset[str]  # listed outputs with binary_data true
    binary_default: bool  # outputs not listed (no outputs array): binary_data_output
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    timeout_us: int = 0

    def is_binary(self, name: str) -> bool:
        return name in self.binary_outputs if self.outputs is not None else self.binary_default


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body as sent before `encoding`; at most `limit` bytes, so a small compressed body cannot
    expand into gigabytes in this process (a "zip bomb")."""
    if not encoding or encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidInput(f"unsupported Content-Encoding '{encoding}'")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit)
        if inflater.unconsumed_tail:
            raise InvalidInput(f"the decompressed request body exceeds the limit of {limit} bytes")
        out += inflater.flush()
    except zlib.error as exc:
        raise InvalidInput(f"failed to decompress request body ({encoding}): {exc}") from exc
    if not inflater.eof:
        raise InvalidInput(f"failed to decompress request body ({encoding}): truncated stream")
    return out


def response_encoding(accept_encoding: str | None) -> str | None:
    """The compression to answer with, from Accept-Encoding: Triton picks the best q-value among
    identity, gzip and deflate. None = identity (also when nothing acceptable is offered)."""
    if not accept_encoding:
        return None
    best, best_q = None, 0.0
    for item in accept_encoding.split(","):
        token, _, params = item.strip().partition(";")
        q = 1.0
        params = params.strip()
        if params.startswith("q="):
            try:
                q = float(params[2:])
            except ValueError:
                continue
        token = token.strip().lower()
        if token in ("gzip", "deflate", "identity") and q > best_q:
            best, best_q = token, q
    return None if best == "identity" else best


def compress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.compress(body, compresslevel=6)
    return zlib.compress(body)  # "deflate" means the zlib format, as Triton and tritonclient use it


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON header, binary tail) as framed by Inference-Header-Content-Length."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        n = int(header_length)
    except ValueError as exc:
        raise InvalidInput(f"invalid Inference-Header-Content-Length '{header_length}'") from exc
    if n < 0 or n > len(body):
        raise InvalidInput(f"Inference-Header-Content-Length {n} is outside the body of {len(body)} bytes")
    if n == 0:
        raise Unsupported("raw binary requests (Inference-Header-Content-Length: 0) are not supported")
    view = memoryview(body)
    return bytes(view[:n]), view[n:]


def _no_constants(name: str) -> Any:
    # NaN and Infinity are not JSON; Triton's parser refuses them too.
    raise ValueError(f"{name} is not valid JSON")


def _load_json(header: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(header, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"failed to parse the request JSON buffer: {exc}") from exc
    except RecursionError as exc:
        raise InvalidInput("failed to parse the request JSON buffer: nested too deeply") from exc
    if not isinstance(doc, dict):
        raise InvalidInput("the request JSON must be an object")
    return doc


def _flatten(data: Any, out: list[Any]) -> None:
    if isinstance(data, list):
        for item in data:
            _flatten(item, out)
    else:
        out.append(data)


def json_to_bytes(data: Any, dt: Datatype, count: int, name: str) -> bytes:
    """Pack JSON `data` (nested or flat, row-major) as wire bytes of `dt`, checking the element count."""
    flat: list[Any] = []
    _flatten(data, flat)
    if len(flat) != count:
        raise InvalidInput(f"unexpected number of elements for input '{name}': got {len(flat)}, expected {count}")
    try:
        if dt.name == "BYTES":
            for v in flat:
                if not isinstance(v, str):
                    raise InvalidInput(f"input '{name}' of type BYTES expects JSON strings")
            arr = np.empty(count, dtype=np.object_)
            arr[:] = [v.encode() for v in flat]
            return tensors.to_bytes(arr, dt)
        if dt.name == "BOOL":
            if any(not isinstance(v, bool) for v in flat):
                raise InvalidInput(f"input '{name}' of type BOOL expects JSON booleans")
            return np.array(flat, dtype=np.bool_).tobytes()
        if any(isinstance(v, (bool, str)) or v is None for v in flat):
            raise InvalidInput(f"input '{name}' of type {dt.name} expects JSON numbers")
        if dt.numpy.kind in "iu" and any(isinstance(v, float) for v in flat):
            raise InvalidInput(f"input '{name}' of type {dt.name} expects JSON integers")
        with np.errstate(over="raise", invalid="raise"):  # 1e39 as FP32 would silently become inf
            arr = np.array(flat, dtype=dt.numpy)
        if dt.numpy.kind == "f" and not np.isfinite(arr).all():  # 1e400: json made it inf already
            raise InvalidInput(f"input '{name}': data must be finite numbers")
        return tensors.to_bytes(arr, dt)
    except (OverflowError, ValueError, TypeError, FloatingPointError) as exc:
        raise InvalidInput(f"input '{name}': data does not fit {dt.name} as a finite number: {exc}") from exc


def _check_shape(spec: ModelSpec, ts: TensorSpec, shape: list[int]) -> None:
    dims = list(ts.dims)
    body = shape[1:] if spec.max_batch_size > 0 else shape
    ok = len(body) == len(dims) and all(d == -1 or d == s for d, s in zip(dims, body, strict=True))
    if not ok:
        want = ([-1] if spec.max_batch_size > 0 else []) + dims
        raise InvalidInput(
            f"unexpected shape for input '{ts.name}' for model '{spec.name}'. Expected {want}, got {shape}"
        )


def _parse_shape(raw: Any, name: str) -> list[int]:
    if not isinstance(raw, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in raw):
        raise InvalidInput(f"input '{name}': shape must be a list of non-negative integers")
    return raw


def _parse_inputs(doc: dict[str, Any], spec: ModelSpec, binary: memoryview) -> list[WireTensor]:
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("the request must have a non-empty 'inputs' array")
    out: list[WireTensor] = []
    offset = 0
    batch: int | None = None
    for raw in raw_inputs:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidInput("each input needs a 'name'")
        name = raw["name"]
        ts = spec.input(name)
        if ts is None:
            raise InvalidInput(f"unexpected inference input '{name}' for model '{spec.name}'")
        if any(t.name == name for t in out):
            raise InvalidInput(f"input '{name}' is given more than once")
        datatype = raw.get("datatype")
        if datatype != ts.datatype.name:
            raise InvalidInput(
                f"inference input '{name}' data-type is '{datatype}', but model '{spec.name}' "
                f"expects '{ts.datatype.name}'"
            )
        shape = _parse_shape(raw.get("shape"), name)
        _check_shape(spec, ts, shape)
        if spec.max_batch_size > 0:
            if not shape or shape[0] < 1:
                raise InvalidInput(f"input '{name}': the batch dimension must be at least 1")
            if batch is None:
                batch = shape[0]
            elif shape[0] != batch:
                raise InvalidInput("all inputs must have the same batch size")
        params = raw.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"input '{name}': parameters must be an object")
        if "shared_memory_region" in params:
            raise Unsupported("shared memory inputs are not supported by fleet")
        has_data = "data" in raw
        has_binary = "binary_data_size" in params
        if has_data == has_binary:
            raise InvalidInput(f"input '{name}' must set exactly one of 'data' and 'binary_data_size'")
        count = tensors.element_count(shape)
        if has_binary:
            size = params["binary_data_size"]
            if not isinstance(size, int) or size < 0:
                raise InvalidInput(f"input '{name}': binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise InvalidInput(f"unexpected end of binary data for input '{name}'")
            data = bytes(binary[offset : offset + size])
            offset += size
            if ts.datatype.name == "BYTES":
                tensors.deserialize_bytes(data, count)  # checks the framing; the worker decodes again
            elif size != count * ts.datatype.itemsize:
                raise InvalidInput(
                    f"unexpected total byte size {size} for input '{name}', expecting "
                    f"{count * ts.datatype.itemsize}"
                )
        else:
            data = json_to_bytes(raw["data"], ts.datatype, count, name)
        out.append(WireTensor(name, ts.datatype.name, tuple(shape), data))
    if offset != len(binary):
        raise InvalidInput(f"unexpected additional input data for model '{spec.name}'")
    given = {t.name for t in out}
    missing = [t.name for t in spec.inputs if not t.optional and t.name not in given]
    if missing:
        raise InvalidInput(f"expected {len(spec.inputs)} inputs but got {len(out)} inputs for model "
                           f"'{spec.name}'; missing {missing}")
    if spec.max_batch_size > 0 and batch is not None and batch > spec.max_batch_size:
        raise InvalidInput(
            f"inference request batch-size must be <= {spec.max_batch_size} for '{spec.name}'"
        )
    return out


def _check_text(value: str, what: str) -> None:
    """JSON's \\uD800-style escapes can spell lone surrogates: valid JSON, but no UTF-8 text, so they could
    not be forwarded to a worker (msgpack carries UTF-8 only)."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} is not valid UTF-8 text: {exc.reason}") from exc


def _parse_parameters(doc: dict[str, Any], spec: ModelSpec) -> tuple[dict[str, Any], int, int, bool]:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("request 'parameters' must be an object")
    passthrough: dict[str, Any] = {}
    for key, value in params.items():
        if key.startswith("triton_"):
            raise InvalidInput(f"parameter keys starting with 'triton_' are reserved: '{key}'")
        if key not in RESERVED_PARAMETERS:
            if not isinstance(value, (str, int, float, bool)):
                raise InvalidInput(f"parameter '{key}' must be a string, number or boolean")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidInput(f"parameter '{key}' must be a finite number")
            _check_text(key, "a parameter name")
            if isinstance(value, str):
                _check_text(value, f"parameter '{key}'")
            passthrough[key] = value
    if any(k in params for k in ("sequence_id", "sequence_start", "sequence_end")) or spec.sequence_batching:
        raise InvalidInput(f"sequence batching is not supported yet (model '{spec.name}')")
    priority = params.get("priority", 0)
    timeout = params.get("timeout", 0)
    for key, value in (("priority", priority), ("timeout", timeout)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInput(f"parameter '{key}' must be a non-negative integer")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput("parameter 'binary_data_output' must be a boolean")
    return passthrough, priority, timeout, binary_default


def _parse_outputs(doc: dict[str, Any], spec: ModelSpec) -> tuple[list[str] | None, frozenset[str]]:
    raw = doc.get("outputs")
    if raw is None:
        return None, frozenset()
    if not isinstance(raw, list):
        raise InvalidInput("'outputs' must be an array")
    names: list[str] = []
    binary: set[str] = set()
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidInput("each requested output needs a 'name'")
        name = item["name"]
        if spec.output(name) is None:
            raise InvalidInput(f"unexpected inference output '{name}' for model '{spec.name}'")
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"output '{name}': parameters must be an object")
        if "shared_memory_region" in params:
            raise Unsupported("shared memory outputs are not supported by fleet")
        if "classification" in params:
            raise Unsupported("the classification extension is not supported by fleet")
        if params.get("binary_data") is True:
            binary.add(name)
        if name not in names:
            names.append(name)
    return names, frozenset(binary)


def parse_infer(body: bytes, header_length: str | None, spec: ModelSpec) -> ParsedInfer:
    """Parse and validate one infer request against `spec`; raises InvalidInput / Unsupported."""
    header, binary = split_body(body, header_length)
    doc = _load_json(header)
    client_id = doc.get("id", "")
    if isinstance(client_id, str) and len(client_id) > MAX_ID_CHARS:
        raise InvalidInput(f"the request id is longer than {MAX_ID_CHARS} characters")
    if not isinstance(client_id, str):
        raise InvalidInput("request 'id' must be a string")
    _check_text(client_id, "request 'id'")
    passthrough, priority, timeout_us, binary_default = _parse_parameters(doc, spec)
    inputs = _parse_inputs(doc, spec, binary)
    outputs, binary_outputs = _parse_outputs(doc, spec)
    return ParsedInfer(client_id, inputs, outputs, binary_outputs, binary_default, passthrough, priority, timeout_us)


def json_data(t: WireTensor, dt: Datatype) -> list[Any]:
    arr = tensors.from_bytes(t.data, dt, t.shape).reshape(-1)
    if dt.name == "BYTES":
        return [bytes(v).decode("utf-8", errors="replace") for v in arr]
    values: list[Any] = arr.tolist()
    return values


def render_infer(
    model: str, version: int, req: ParsedInfer, outputs: list[WireTensor], parameters: dict[str, Any]
) -> tuple[bytes, int | None]:
    """(body, json header length or None when every output is JSON)."""
    rendered: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []
    for t in outputs:
        dt = tensors.lookup(t.datatype)
        item: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if req.is_binary(t.name):
            item["parameters"] = {"binary_data_size": len(t.data)}
            blobs.append(t.data)
        else:
            item["data"] = json_data(t, dt)
        rendered.append(item)
    doc: dict[str, Any] = {}
    if req.client_id:
        doc["id"] = req.client_id
    doc["model_name"] = model
    doc["model_version"] = str(version)
    if parameters:
        doc["parameters"] = parameters
    doc["outputs"] = rendered
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
