"""ModelInferRequest -> ParsedInfer, and a reply -> ModelInferResponse.

The decoder produces exactly what HTTP's parser (fleet.kserve.parse_infer) produces, through the same
checks (fleet.kserve.check_input / check_input_set / check_parameters), so everything after decoding is
the one data path of gateway/dataplane.py. Raw contents (`raw_input_contents`, what tritonclient sends)
go into the envelope as the bytes the message holds, checked against the shape without being decoded;
typed `contents` are packed once with numpy. Everything a worker would choke on is an InvalidInput here
(gRPC INVALID_ARGUMENT): nothing malformed is ever enqueued.

Triton's texts where Triton has one for the same fault (tritonserver 2.51's answers, recorded against
it): "contents field must not be specified when using raw_input_contents for ...", "unable to find data
for input tensor ...", "unexpected explicit tensor data for input tensor ...". Stricter than Triton: a
typed value out of its datatype's range (Triton truncates it), raw contents left over after the last
input (Triton ignores them), and the checks HTTP makes (fleet/kserve.py).

Responses carry every output in `raw_output_contents`, as Triton always answers (tritonclient's
InferResult.as_numpy reads them by the output's position); an output written into shared memory keeps
its place with an empty entry.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from fleet import tensors
from fleet.classification import requested_classes
from fleet.datatypes import Datatype
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.input_checks import check_input, check_input_names, check_input_set, request_tag
from fleet.kserve import MAX_ID_CHARS, ParsedInfer, check_parameters, sequence_flags
from fleet.model_spec import ModelSpec
from fleet.tensor_regions import Regions, RegionSlice, check_input_bytes, input_from_region, output_to_region
from gateway.grpc.service_proto import service_pb2 as pb

# A typed contents field -> (the datatype Triton names it by, the input datatypes it may carry).
# FP16 and BF16 have none: they travel as raw contents only.
CONTENTS: dict[str, tuple[str, frozenset[str]]] = {
    "bool_contents": ("BOOL", frozenset({"BOOL"})),
    "int_contents": ("INT32", frozenset({"INT8", "INT16", "INT32"})),
    "int64_contents": ("INT64", frozenset({"INT64"})),
    "uint_contents": ("UINT32", frozenset({"UINT8", "UINT16", "UINT32"})),
    "uint64_contents": ("UINT64", frozenset({"UINT64"})),
    "fp32_contents": ("FP32", frozenset({"FP32"})),
    "fp64_contents": ("FP64", frozenset({"FP64"})),
    "bytes_contents": ("BYTES", frozenset({"BYTES"})),
}
# Request parameters that ask for nothing here, dropped before the checks HTTP makes: outputs always
# travel as raw bytes over gRPC; perf_analyzer sends triton_enable_empty_final_response (the one
# `triton_` key Triton allows) on every gRPC request, for decoupled models, which fleet has none of.
_NO_EFFECT = frozenset({"binary_data_output", "triton_enable_empty_final_response"})
_LEN = struct.Struct("<I")


def parameter_value(p: Any) -> Any:
    """An InferParameter as the plain Python value HTTP's JSON would give (None when none is set)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def parameters_dict(params: Mapping[str, Any]) -> dict[str, Any]:
    if not params:
        return {}
    return {key: parameter_value(p) for key, p in params.items()}


def set_parameter(target: Any, value: Any) -> None:
    """Write a plain value into an InferParameter (bool before int: a bool is an int to Python)."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if -(2**63) <= value < 2**63:
            target.int64_param = value
        elif 0 <= value < 2**64:
            target.uint64_param = value
        else:  # no integer field holds it: its digits, rather than failing the response
            target.string_param = str(value)
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def parse_message(message_type: Any, raw: bytes) -> Any:
    """A request message from its bytes; InvalidInput (not gRPC's INTERNAL) when they are no such message."""
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"Unable to parse request: {exc}") from None


def request_version(version: str) -> str | None:
    """The version of a request ("" = the model's default), Triton's message for one that is no number."""
    if not version:
        return None
    if not (version.isascii() and version.isdigit()):
        raise InvalidInput(f"failed to get model version from specified version string '{version}' (details: "
                           f"stol), version should be an integral value > 0")
    return version


def _typed_contents(contents: Any, name: str, model: str, dt: Datatype, count: int) -> bytes:
    fields = contents.ListFields()
    if not fields:  # present, but every list empty: the data of a tensor with no elements
        if count:
            raise InvalidInput(f"unable to find data for input tensor '{name}' for model '{model}' in request.")
        return b""
    if len(fields) > 1:
        raise InvalidInput(f"input '{name}': its contents set more than one of "
                           f"{sorted(f.name for f, _ in fields)}")
    descriptor, values = fields[0]
    typed, carries = CONTENTS[descriptor.name]
    if dt.name not in carries:
        raise InvalidInput(f"unexpected explicit tensor data for input tensor '{name}' for model '{model}' of "
                           f"type '{typed}', expected datatype '{dt.name}'")
    if len(values) != count:
        what = "string elements" if dt.name == "BYTES" else "elements"
        raise InvalidInput(f"expected {count} {what} for inference input '{name}' for model '{model}', "
                           f"got {len(values)}")
    if dt.name == "BYTES":
        return b"".join(part for v in values for part in (_LEN.pack(len(v)), v))
    if typed in ("INT32", "UINT32") and dt.name != typed:
        wide = np.array(values, dtype=np.int64)
        info = np.iinfo(dt.numpy)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise InvalidInput(f"input '{name}': its {descriptor.name} hold a value outside the range of {dt.name} "
                               f"({info.min} to {info.max})")
        return tensors.to_bytes(wide.astype(dt.numpy), dt)
    return tensors.to_bytes(np.array(values, dtype=dt.numpy), dt)


def input_data(tensor: Any, params: dict[str, Any], dt: Datatype, shape: list[int], raw: Iterator[bytes],
               has_raw: bool, model: str, regions: Regions | None) -> bytes:
    """THE decoding of one input's data, from wherever its request put it: a shared-memory region its
    `params` name (fleet.tensor_regions), its typed `contents`, or the next `raw_input_contents` entry
    (`raw`, in input order, as Triton takes them). Checked against `shape` and `dt`; raises InvalidInput."""
    name = tensor.name
    count = tensors.element_count(shape)
    if "shared_memory_region" in params:
        data = input_from_region(regions, name, dt, shape, params)
        assert data is not None  # the region is named, so it is read (or an error raised)
        return data
    if tensor.HasField("contents"):
        if has_raw:
            raise InvalidInput(f"contents field must not be specified when using raw_input_contents for "
                               f"'{name}' for model '{model}'")
        return _typed_contents(tensor.contents, name, model, dt, count)
    data = next(raw, None)
    if data is None:
        raise InvalidInput(f"unable to find data for input tensor '{name}' for model '{model}' in request.")
    check_input_bytes(name, dt, shape, data)  # as is, without decoding: the size, or BYTES framing
    return data


def _outputs(request: Any, spec: ModelSpec, regions: Regions | None
             ) -> tuple[list[str] | None, dict[str, RegionSlice], dict[str, int]]:
    if not request.outputs:
        return None, {}, {}  # none listed: every output
    names: list[str] = []
    in_regions: dict[str, RegionSlice] = {}
    classes: dict[str, int] = {}
    for item in request.outputs:
        name = item.name
        ts = spec.output(name)
        if ts is None:
            raise InvalidInput(f"unexpected inference output '{name}' for model '{spec.name}'")
        if name in names:  # as over HTTP (fleet/kserve.py): never merged silently
            raise InvalidInput(f"output '{name}' is requested more than once")
        params = parameters_dict(item.parameters)
        params.pop("binary_data", None)  # outputs always travel as raw bytes over gRPC
        target = output_to_region(regions, name, params)
        if target is not None:
            in_regions[name] = target
        count = requested_classes(params, name, ts.datatype.name)
        if count:
            classes[name] = count
        names.append(name)
    return names, in_regions, classes


def decode_infer(request: Any, spec: ModelSpec, regions: Regions | None,
                 raw_contents: Sequence[bytes] | None = None) -> ParsedInfer:
    """A ModelInferRequest for the model of `spec` as the ParsedInfer HTTP's parser would produce for the
    same request; raises InvalidInput / Unsupported. `raw_contents`: its raw_input_contents, when they were
    taken out of it (gateway/grpc/request_heads.py)."""
    client_id = request.id
    if len(client_id) > MAX_ID_CHARS:
        raise InvalidInput(f"the request id is longer than {MAX_ID_CHARS} characters")
    params = parameters_dict(request.parameters)
    for key in _NO_EFFECT:
        params.pop(key, None)
    passthrough, priority, timeout_us, _ = check_parameters(params, spec)
    tag = request_tag(client_id)
    check_input_names(spec, [t.name for t in request.inputs], tag)
    if not request.inputs:  # (a model whose inputs are all optional: still one input to batch by)
        raise InvalidInput("the request must have a non-empty 'inputs' array")
    if raw_contents is None:
        raw_contents = request.raw_input_contents
    has_raw = len(raw_contents) > 0
    raw = iter(raw_contents)
    inputs: list[WireTensor] = []
    batch: int | None = None
    for tensor in request.inputs:
        ts, shape, batch = check_input(spec, inputs, tensor.name, tensor.datatype, list(tensor.shape), batch, tag)
        data = input_data(tensor, parameters_dict(tensor.parameters), ts.datatype, shape, raw, has_raw, spec.name,
                          regions)
        inputs.append(WireTensor(tensor.name, ts.datatype.name, tuple(shape), data))
    if next(raw, None) is not None:
        raise InvalidInput(f"unexpected additional input data for model '{spec.name}': more raw_input_contents "
                           f"than inputs that take them")
    check_input_set(spec, inputs, batch, tag)
    outputs, in_regions, classes = _outputs(request, spec, regions)
    return ParsedInfer(client_id=client_id, inputs=inputs, outputs=outputs, binary_outputs=frozenset(),
                       binary_default=True, parameters=passthrough, priority=priority, timeout_us=timeout_us,
                       shm_outputs=in_regions, sequence=sequence_flags(params, spec, inputs), classification=classes)


def encode_infer(model: str, version: int, req: ParsedInfer, outputs: list[WireTensor],
                 parameters: Mapping[str, Any]) -> Any:
    """The ModelInferResponse of a reply: every output's bytes as raw contents, in the outputs' order."""
    tensors_out = []
    raw: list[bytes] = []
    for t in outputs:
        out = pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape)
        target = req.shm_outputs.get(t.name)
        if target is not None:
            target.write(t.name, t.data)  # answered with name, datatype and shape only, as Triton does
            raw.append(b"")
        else:
            raw.append(t.data if isinstance(t.data, bytes) else bytes(t.data))
        tensors_out.append(out)
    response = pb.ModelInferResponse(model_name=model, model_version=str(version), id=req.client_id,
                                     outputs=tensors_out, raw_output_contents=raw)
    for key, value in parameters.items():
        set_parameter(response.parameters[key], value)
    return response
