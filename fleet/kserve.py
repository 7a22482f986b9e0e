"""Infer request parsing and response rendering: KServe v2 JSON plus Triton's binary tensor extension.

Shared by the gateway (HTTP /infer) and the bulk-job runner (a JSON Lines job's line is exactly an
/infer body; its output line is exactly the /infer response's data), so both read and write the one
format the same way. Pure: fleet and numpy only.

`parse_infer` turns an HTTP body into envelope tensors, checked against the model config so a bad
request never reaches a worker (the input checks every protocol shares: fleet/input_checks.py). Binary
inputs are views of the body (no Python lists; a small one is copied once, into the envelope's msgpack, a
large one is written to Redis from the body itself: fleet/envelope.py); JSON `data` is packed once with
numpy. `render_infer` does the reverse for the reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batching.sequences import no_correlation_id
from fleet import tensors
from fleet.classification import requested_classes
from fleet.envelope import SequenceFlags, WireTensor
from fleet.errors import InferenceFailed, InvalidInput
from fleet.input_checks import check_input, check_input_names, check_input_set, request_tag
from fleet.model_spec import ModelSpec
from fleet.parts import LONG_BUFFER, Parts, byte_view, total_bytes
from fleet.raw_binary import raw_header
from fleet.request_json import dump_json, load_exact, load_json
from fleet.sequence_spec import ControlKind
from fleet.tensor_json import INT64_MAX, INT64_MIN, UINT64_MAX, json_data, pack_json
from fleet.tensor_regions import Regions, RegionSlice, input_from_region, output_to_region

__all__ = ["ParsedInfer", "check_input", "check_input_set", "check_parameters", "json_data", "parse_infer",
           "parse_infer_read", "render_infer", "sequence_flags", "split_body"]

# Request-level parameters with a meaning to the server; the rest pass through to the model.
RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output", "headers"}
)

# Binary outputs this long go out from their own buffers after the JSON header (fleet/parts.py), not
# joined into one body.
LONG_BLOBS = LONG_BUFFER


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
    shm_outputs: dict[str, RegionSlice] = field(default_factory=dict)  # outputs written into shared memory
    sequence: SequenceFlags | None = None  # a sequence model's correlation id and flags (sequence_flags)
    # Outputs requested as their top K classes (the classification extension, fleet/classification.py).
    classification: dict[str, int] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return name in self.binary_outputs if self.outputs is not None else self.binary_default

    def with_inputs(self, inputs: list[WireTensor], client_id: str | None = None) -> ParsedInfer:
        """This request with these inputs (and this request id, if given), sharing nothing mutable with it but
        its regions' slices (the caches of decoded requests, fleet/known_requests.py and
        fleet/jobs/line_heads.py, keep none). Every field by name:
        dataclasses.replace would take twice as long as the rest of a cache hit. The caches' property tests
        compare every field with the decoders', so a field added to ParsedInfer and left out here fails them
        where they draw a value for it other than its default."""
        return ParsedInfer(client_id=self.client_id if client_id is None else client_id, inputs=inputs,
                           outputs=None if self.outputs is None else list(self.outputs),
                           binary_outputs=self.binary_outputs, binary_default=self.binary_default,
                           parameters=dict(self.parameters), priority=self.priority, timeout_us=self.timeout_us,
                           shm_outputs=dict(self.shm_outputs), sequence=self.sequence,
                           classification=dict(self.classification))


def split_body(body: bytes, header_length: str | None, spec: ModelSpec) -> tuple[bytes, memoryview]:
    """(JSON header, binary tail) as framed by Inference-Header-Content-Length (0: a raw binary request, the
    header it stands for, fleet/raw_binary.py)."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        n = int(header_length)
    except ValueError as exc:
        raise InvalidInput(f"invalid Inference-Header-Content-Length '{header_length}'") from exc
    if n < 0 or n > len(body):
        raise InvalidInput(f"Inference-Header-Content-Length {n} is outside the body of {len(body)} bytes")
    if n == 0:
        return raw_header(spec, len(body)), memoryview(body)
    view = memoryview(body)
    return bytes(view[:n]), view[n:]


def _parse_inputs(doc: dict[str, Any], spec: ModelSpec, binary: memoryview, regions: Regions | None,
                  tag: str) -> list[WireTensor]:
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidInput("the request must have a non-empty 'inputs' array")
    if not all(isinstance(raw, dict) and isinstance(raw.get("name"), str) for raw in raw_inputs):
        raise InvalidInput("each input needs a 'name'")
    check_input_names(spec, [raw["name"] for raw in raw_inputs], tag)
    if not raw_inputs:  # (a model whose inputs are all optional: still one input to batch by)
        raise InvalidInput("the request must have a non-empty 'inputs' array")
    out: list[WireTensor] = []
    offset = 0
    batch: int | None = None
    for raw in raw_inputs:
        name = raw["name"]
        ts, shape, batch = check_input(spec, out, name, raw.get("datatype"), raw.get("shape"), batch, tag)
        params = raw.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"input '{name}': parameters must be an object")
        has_data = "data" in raw
        has_binary = "binary_data_size" in params
        has_region = "shared_memory_region" in params
        if has_data + has_binary + has_region != 1:
            raise InvalidInput(f"input '{name}' must set exactly one of 'data', 'binary_data_size' (in its "
                               f"parameters) and 'shared_memory_region' (in its parameters)")
        count = tensors.element_count(shape)
        in_region = input_from_region(regions, name, ts.datatype, shape, params) if has_region else None
        data: bytes | memoryview
        if in_region is not None:
            data = in_region  # read once from the region, checked against the shape
        elif has_binary:
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInput(f"input '{name}': binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise InvalidInput(f"unexpected end of binary data for input '{name}'")
            data = binary[offset : offset + size]  # a view of the body, never copied for a large envelope
            offset += size
            if ts.datatype.name == "BYTES":
                tensors.deserialize_bytes(data, count)  # checks the framing; the worker decodes again
            elif size != count * ts.datatype.itemsize:
                raise InvalidInput(
                    f"unexpected total byte size {size} for input '{name}', expecting "
                    f"{count * ts.datatype.itemsize}"
                )
        else:
            data = pack_json(raw["data"], ts.datatype, shape, name)
        out.append(WireTensor(name, ts.datatype.name, tuple(shape), data))
    if offset != len(binary):
        raise InvalidInput(f"unexpected additional input data for model '{spec.name}'")
    check_input_set(spec, out, batch, tag)
    return out


def _check_text(value: str, what: str) -> None:
    """JSON's \\uD800-style escapes can spell lone surrogates: valid JSON, but no UTF-8 text, so they could
    not be forwarded to a worker (msgpack carries UTF-8 only)."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} is not valid UTF-8 text: {exc.reason}") from exc


def _check_int_range(key: str, value: Any) -> None:
    """Triton passes integer parameters to the model as int64; a larger one could not cross Redis either
    (msgpack), which once made it a 500 after parsing."""
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise InvalidInput(f"parameter '{key}' is outside the signed 64-bit integer range (-2^63 to 2^63-1)")


def _uint64(params: dict[str, Any], key: str) -> int:
    value = params.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= UINT64_MAX:
        raise InvalidInput(f"parameter '{key}' must be an integer from 0 to 2^64-1 (Triton's uint64)")
    return value


def _check_sequence_parameters(params: dict[str, Any]) -> None:
    """The types Triton's HTTP frontend reads them as, checked before saying sequences are unsupported, so
    a client fixing its request learns what is wrong with it first."""
    if "sequence_id" in params and not isinstance(params["sequence_id"], str):
        _uint64(params, "sequence_id")
    for key in ("sequence_start", "sequence_end"):
        if key in params and not isinstance(params[key], bool):
            raise InvalidInput(f"parameter '{key}' must be a boolean")


def sequence_flags(params: dict[str, Any], spec: ModelSpec, inputs: list[WireTensor]) -> SequenceFlags | None:
    """A sequence model's request: its correlation id (required, as in Triton) and flags, its batch size 1.
    Any other model ignores the (type-checked) sequence parameters, as Triton does."""
    if spec.sequence is None:
        return None
    sid = params.get("sequence_id", 0)
    if sid in (0, ""):
        raise InvalidInput(no_correlation_id(spec.name))
    if isinstance(sid, str):
        if len(sid) > MAX_ID_CHARS:
            raise InvalidInput(f"the sequence id is longer than {MAX_ID_CHARS} characters")
        _check_text(sid, "parameter 'sequence_id'")
    if spec.max_batch_size > 0 and inputs and inputs[0].shape and inputs[0].shape[0] != 1:
        raise InvalidInput(f"inference request to model '{spec.name}' must specify batch-size 1 due to "
                           f"requirements of sequence batcher")
    corrid = spec.sequence.control(ControlKind.CORRID)
    if corrid is not None and corrid.datatype.name != "BYTES":
        if isinstance(sid, str):
            raise InvalidInput(f"model '{spec.name}' takes its correlation ID as {corrid.datatype.name} (control "
                               f"'{corrid.name}'): the sequence_id must be an integer, got the string '{sid}'")
        limits = np.iinfo(corrid.datatype.numpy)
        if not limits.min <= sid <= limits.max:
            raise InvalidInput(f"sequence_id {sid} does not fit the {corrid.datatype.name} correlation ID control "
                               f"'{corrid.name}' of model '{spec.name}'")
    return SequenceFlags(sid, bool(params.get("sequence_start", False)), bool(params.get("sequence_end", False)))


def _parse_parameters(doc: dict[str, Any], spec: ModelSpec) -> tuple[dict[str, Any], int, int, bool]:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("request 'parameters' must be an object")
    return check_parameters(params, spec)


def check_parameters(params: dict[str, Any], spec: ModelSpec) -> tuple[dict[str, Any], int, int, bool]:
    """Request parameters as plain Python values (HTTP's JSON; gRPC: each InferParameter's set field):
    (those passed to the model, priority, timeout µs, binary_data_output). InvalidInput for a reserved
    `triton_` key, a value no model could be given (not a string, boolean, finite number or int64),
    priority or timeout outside uint64, and sequence parameters of the wrong type."""
    passthrough: dict[str, Any] = {}
    for key, value in params.items():
        if key.startswith("triton_"):
            raise InvalidInput(f"parameter keys starting with 'triton_' are reserved: '{key}'")
        if key not in RESERVED_PARAMETERS:
            if not isinstance(value, (str, int, float, bool)):
                raise InvalidInput(f"parameter '{key}' must be a string, number or boolean")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidInput(f"parameter '{key}' must be a finite number")
            _check_int_range(key, value)
            _check_text(key, "a parameter name")
            if isinstance(value, str):
                _check_text(value, f"parameter '{key}'")
            passthrough[key] = value
    _check_sequence_parameters(params)
    priority = _uint64(params, "priority")
    timeout = _uint64(params, "timeout")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput("parameter 'binary_data_output' must be a boolean")
    return passthrough, priority, timeout, binary_default


def _parse_outputs(doc: dict[str, Any], spec: ModelSpec, regions: Regions | None
                   ) -> tuple[list[str] | None, frozenset[str], dict[str, RegionSlice], dict[str, int]]:
    raw = doc.get("outputs")
    if raw is None or raw == []:
        return None, frozenset(), {}, {}  # Triton: no output listed (or an empty list) means every output
    if not isinstance(raw, list):
        raise InvalidInput("'outputs' must be an array")
    names: list[str] = []
    binary: set[str] = set()
    in_regions: dict[str, RegionSlice] = {}
    classes: dict[str, int] = {}
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidInput("each requested output needs a 'name'")
        name = item["name"]
        ts = spec.output(name)
        if ts is None:
            raise InvalidInput(f"unexpected inference output '{name}' for model '{spec.name}'")
        if name in names:
            # Its two entries could ask for different binary_data (older Triton cores: "already requested").
            raise InvalidInput(f"output '{name}' is requested more than once")
        params = item.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"output '{name}': parameters must be an object")
        target = output_to_region(regions, name, params)
        if target is not None:
            in_regions[name] = target
        count = requested_classes(params, name, ts.datatype.name)
        if count:
            classes[name] = count
        is_binary = params.get("binary_data", False)
        if not isinstance(is_binary, bool):
            raise InvalidInput(f"output '{name}': parameter 'binary_data' must be a boolean")
        if is_binary:
            binary.add(name)
        names.append(name)
    return names, frozenset(binary), in_regions, classes


def parse_infer(body: bytes, header_length: str | None, spec: ModelSpec, regions: Regions | None = None
                ) -> ParsedInfer:
    """Parse and validate one infer request against `spec`; raises InvalidInput / Unsupported. `regions`: the
    gateway's shared-memory regions, for tensors that name one (fleet.tensor_regions); None refuses them."""
    header, binary = split_body(body, header_length, spec)
    return parse_infer_read(header, load_json(header), spec, binary, regions)


def parse_infer_read(header: bytes, read: tuple[dict[str, Any], bool], spec: ModelSpec, binary: memoryview,
                     regions: Regions | None = None) -> ParsedInfer:
    """parse_infer_doc on load_json's reading of `header` ((document, read by orjson))."""
    doc, fast = read
    try:
        return parse_infer_doc(doc, spec, binary, regions)
    except InvalidInput:
        if not fast:
            raise
    # Read by orjson and refused: read again as json does, for json's words (a number past 64 bits reads
    # as a float in orjson, an integer in json).
    return parse_infer_doc(load_exact(header), spec, binary, regions)


def request_id(doc: dict[str, Any]) -> str:
    """The request's `id` ("" without one); InvalidInput if it is not a string of UTF-8 text of at most
    MAX_ID_CHARS characters."""
    client_id = doc.get("id", "")
    if isinstance(client_id, str) and len(client_id) > MAX_ID_CHARS:
        raise InvalidInput(f"the request id is longer than {MAX_ID_CHARS} characters")
    if not isinstance(client_id, str):
        raise InvalidInput("request 'id' must be a string")
    _check_text(client_id, "request 'id'")
    return client_id


def parse_infer_doc(doc: dict[str, Any], spec: ModelSpec, binary: memoryview, regions: Regions | None
                    ) -> ParsedInfer:
    """parse_infer once the JSON is read: `binary` is the body's binary tail."""
    client_id = request_id(doc)
    passthrough, priority, timeout_us, binary_default = _parse_parameters(doc, spec)
    inputs = _parse_inputs(doc, spec, binary, regions, request_tag(client_id))
    outputs, binary_outputs, in_regions, classes = _parse_outputs(doc, spec, regions)
    sequence = sequence_flags(doc.get("parameters") or {}, spec, inputs)
    return ParsedInfer(client_id, inputs, outputs, binary_outputs, binary_default, passthrough, priority, timeout_us,
                       in_regions, sequence, classes)


def render_infer(
    model: str, version: int, req: ParsedInfer, outputs: list[WireTensor], parameters: dict[str, Any]
) -> tuple[bytes | Parts, int | None]:
    """(body, json header length or None when every output is JSON). Outputs the request put in shared
    memory are written there (InvalidInput if one does not fit) and answered without data. A body whose
    binary outputs hold LONG_BLOBS bytes or more is `Parts`: the JSON header, then the outputs' own buffers
    (views of the reply's payload), which the HTTP writer sends without joining them."""
    rendered: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []
    for t in outputs:
        dt = tensors.lookup(t.datatype)
        item: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        target = req.shm_outputs.get(t.name)
        if target is not None:
            # Triton answers it with name, datatype and shape only: Triton's C++ client (perf_analyzer)
            # takes any `parameters` of an output for binary data and fails without `binary_data_size`.
            target.write(t.name, t.data)
        elif req.is_binary(t.name):
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
    try:
        # Outputs were checked by json_data (finite, or refused); what is left is the model's own response
        # parameters: with any, the body is written by json, which refuses a NaN (it must not turn the
        # whole body into invalid JSON) where orjson would write null.
        header = dump_json(doc, checked=not parameters)
    except ValueError:
        raise InferenceFailed(f"model '{model}' set a response parameter to NaN or infinity, which JSON "
                              f"cannot represent") from None
    if not blobs:
        return header, None
    if total_bytes(blobs) >= LONG_BLOBS:
        return Parts((header, *map(byte_view, blobs))), len(header)
    return b"".join([header, *blobs]), len(header)
