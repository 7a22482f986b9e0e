"""gRPC's request decoding and response encoding (gateway/grpc/codec.py), pure: a ModelInferRequest
decodes to exactly the ParsedInfer that HTTP's parser makes of the same request, raw contents pass
through as they are, every fault is an InvalidInput before anything is enqueued, and a response reads
back through tritonclient.grpc's own InferResult for every datatype. Plus the tables that must cover
the whole proto: each RPC served or listed as not yet, each ErrorCode with a gRPC status."""

from __future__ import annotations

import json
import re
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tg
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from fleet import grpc_flags
from fleet.cli import build_parser, settings_from_args
from fleet.envelope import WireTensor
from fleet.errors import ErrorCode, InvalidInput, ServingError
from fleet.kserve import ParsedInfer, parse_infer
from fleet.listen import address
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from fleet.settings import Settings
from gateway.errors import GRPC_STATUS, STATUS
from gateway.grpc.calls import response_encoding
from gateway.grpc.codec import decode_infer, encode_infer, parse_message, request_version
from gateway.grpc.handlers import HTTP_TWIN, SERVICE
from gateway.grpc.not_yet import NOT_YET
from gateway.grpc.server import local_settings
from gateway.grpc.service import InferenceService
from gateway.grpc.status_codes import StatusCode

DATATYPES = {"BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16", "UINT32": "TYPE_UINT32",
             "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8", "INT16": "TYPE_INT16", "INT32": "TYPE_INT32",
             "INT64": "TYPE_INT64", "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64",
             "BF16": "TYPE_BF16", "BYTES": "TYPE_STRING"}
NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
         "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
         "FP32": np.float32, "FP64": np.float64, "BF16": ml_dtypes.bfloat16}
# Where tritonclient's users put typed values (FP16 and BF16 have no typed field).
TYPED_FIELD = {"BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
               "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
               "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
               "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def spec_for(datatype: str, *, max_batch_size: int = 0, extra: str = "") -> ModelSpec:
    text = f"""
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "X", data_type: {DATATYPES[datatype]}, dims: [ -1 ] }} ]
output [ {{ name: "Y", data_type: {DATATYPES[datatype]}, dims: [ -1 ] }},
         {{ name: "Z", data_type: TYPE_FP32, dims: [ 1 ] }} ]
{extra}
"""
    return parse_config(text, source="test", model_name="m")


ADD_SUB = parse_config("""
backend: "python"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_INT32, dims: [ 4 ] }, { name: "B", data_type: TYPE_INT32, dims: [ 4 ] } ]
output [ { name: "S", data_type: TYPE_INT32, dims: [ 4 ] } ]
""", source="test", model_name="add_sub")


def raw_bytes(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v)) + v for v in values)
    return np.array(values, dtype=NUMPY[datatype]).tobytes()


def grpc_request(inputs: list[tuple[str, str, list[int]]], raw: list[bytes] | None = None,
                 typed: dict[str, tuple[str, list[Any]]] | None = None,
                 params: dict[str, tuple[str, Any]] | None = None, outputs: list[str] | None = None,
                 request_id: str = "") -> Any:
    request = pb.ModelInferRequest(model_name="m", id=request_id)
    for name, datatype, shape in inputs:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if typed and name in typed:
            field, values = typed[name]
            getattr(tensor.contents, field).extend(values)
    request.raw_input_contents.extend(raw or [])
    for key, (kind, value) in (params or {}).items():
        setattr(request.parameters[key], kind, value)
    for name in outputs or []:
        request.outputs.add(name=name)
    return request


def http_body(inputs: list[tuple[str, str, list[int], bytes]], params: dict[str, Any] | None = None,
              outputs: list[str] | None = None, request_id: str = "") -> tuple[bytes, str]:
    doc: dict[str, Any] = {"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
                                      for n, d, s, b in inputs]}
    if request_id:
        doc["id"] = request_id
    if params:
        doc["parameters"] = params
    if outputs:
        doc["outputs"] = [{"name": o, "parameters": {"binary_data": True}} for o in outputs]
    header = json.dumps(doc).encode()
    return header + b"".join(b for *_, b in inputs), str(len(header))


def same_request(a: ParsedInfer, b: ParsedInfer) -> None:
    """What reaches the envelope is the same (binary-output choices are HTTP's alone)."""
    assert [(t.name, t.datatype, t.shape, bytes(t.data)) for t in a.inputs] == \
        [(t.name, t.datatype, t.shape, bytes(t.data)) for t in b.inputs]
    assert (a.client_id, a.outputs, a.parameters, a.priority, a.timeout_us) == \
        (b.client_id, b.outputs, b.parameters, b.priority, b.timeout_us)


def values_of(datatype: str, n: int) -> st.SearchStrategy[list[Any]]:
    if datatype == "BYTES":
        return st.lists(st.binary(max_size=12), min_size=n, max_size=n)
    if datatype == "BOOL":
        return st.lists(st.booleans(), min_size=n, max_size=n)
    dt = np.dtype(NUMPY[datatype])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n)
    width = {"FP16": 16, "BF16": 32, "FP32": 32, "FP64": 64}[datatype]
    floats = st.floats(width=width, allow_nan=False)  # NaN != NaN: compared as bytes below anyway
    return st.lists(floats, min_size=n, max_size=n)


# ── the same request over both protocols decodes to the same thing ──────────────────────────────────


@settings(max_examples=150, deadline=None, database=None)
@given(st.data(), st.sampled_from(sorted(DATATYPES)), st.integers(0, 6), st.booleans())
def test_raw_and_typed_contents_decode_as_http_binary_does(data: st.DataObject, datatype: str, n: int,
                                                            typed: bool) -> None:
    values = data.draw(values_of(datatype, n))
    raw = raw_bytes(datatype, values)
    spec = spec_for(datatype)
    params = data.draw(st.fixed_dictionaries({}, optional={
        "priority": st.integers(0, 2**64 - 1), "timeout": st.integers(0, 2**63 - 1),
        "flag": st.booleans(), "note": st.text(max_size=8), "count": st.integers(-(2**63), 2**63 - 1),
        "ratio": st.floats(allow_nan=False, allow_infinity=False)}))
    kinds = {bool: "bool_param", str: "string_param", float: "double_param"}
    grpc_params = {k: ("uint64_param" if k == "priority" else kinds.get(type(v), "int64_param"), v)
                   for k, v in params.items()}
    outputs = data.draw(st.sampled_from([None, ["Y"], ["Z", "Y"]]))
    if typed and datatype in TYPED_FIELD:
        request = grpc_request([("X", datatype, [n])], typed={"X": (TYPED_FIELD[datatype], values)},
                               params=grpc_params, outputs=outputs, request_id="r")
    else:
        request = grpc_request([("X", datatype, [n])], raw=[raw], params=grpc_params, outputs=outputs,
                               request_id="r")
    over_grpc = decode_infer(request, spec, None)
    body, header_length = http_body([("X", datatype, [n], raw)], params, outputs, "r")
    same_request(over_grpc, parse_infer(body, header_length, spec))


def test_raw_contents_reach_the_envelope_as_sent() -> None:
    """No decode/re-encode: the bytes of each raw entry are the tensor's bytes, BYTES framing included."""
    spec = spec_for("BYTES", max_batch_size=4)
    framed = raw_bytes("BYTES", [b"\x00\xff", b"", "é".encode()])
    parsed = decode_infer(grpc_request([("X", "BYTES", [1, 3])], raw=[framed]), spec, None)
    assert parsed.inputs == [WireTensor("X", "BYTES", (1, 3), framed)]
    assert parsed.outputs is None and parsed.binary_default


def test_two_inputs_take_raw_entries_in_order() -> None:
    a, b = np.arange(8, dtype=np.int32).reshape(2, 4), np.full((2, 4), 7, np.int32)
    parsed = decode_infer(grpc_request([("A", "INT32", [2, 4]), ("B", "INT32", [2, 4])],
                                       raw=[a.tobytes(), b.tobytes()]), ADD_SUB, None)
    assert [bytes(t.data) for t in parsed.inputs] == [a.tobytes(), b.tobytes()]


def test_an_output_listed_twice_is_refused_as_over_http() -> None:
    with pytest.raises(InvalidInput, match="output 'Y' is requested more than once"):
        decode_infer(grpc_request([("X", "FP32", [1])], raw=[b"\0\0\0\0"], outputs=["Y", "Y"]),
                     spec_for("FP32"), None)


def test_parameters_without_effect_over_grpc_are_dropped() -> None:
    # perf_analyzer sends triton_enable_empty_final_response on every gRPC request.
    request = grpc_request([("X", "FP32", [1])], raw=[b"\0\0\0\0"],
                           params={"triton_enable_empty_final_response": ("bool_param", True),
                                   "binary_data_output": ("bool_param", True)})
    assert decode_infer(request, spec_for("FP32"), None).parameters == {}


# ── faults: each an InvalidInput (INVALID_ARGUMENT), with Triton's text where Triton has one ────────

F4 = np.zeros(4, np.float32).tobytes()
FAULTS: list[tuple[str, Any, str]] = [
    ("raw too short", grpc_request([("X", "FP32", [4])], raw=[F4[:-1]]), "unexpected total byte size 15"),
    ("raw too long", grpc_request([("X", "FP32", [4])], raw=[F4 + b"\0"]), "expecting 16"),
    ("raw left over", grpc_request([("X", "FP32", [4])], raw=[F4, F4]), "unexpected additional input data"),
    ("no data", grpc_request([("X", "FP32", [4])]), "unable to find data for input tensor 'X' for model 'm'"),
    ("typed and raw", grpc_request([("X", "FP32", [4])], raw=[F4], typed={"X": ("fp32_contents", [0.0] * 4)}),
     "contents field must not be specified when using raw_input_contents for 'X' for model 'm'"),
    ("typed count", grpc_request([("X", "FP32", [4])], typed={"X": ("fp32_contents", [0.0] * 3)}),
     "expected 4 elements for inference input 'X'"),
    ("typed field of another type", grpc_request([("X", "FP32", [4])], typed={"X": ("int_contents", [0] * 4)}),
     "unexpected explicit tensor data for input tensor 'X' for model 'm' of type 'INT32', expected datatype 'FP32'"),
    ("wrong datatype", grpc_request([("X", "INT32", [4])], raw=[F4]), "data-type is 'INT32'"),
    ("unknown input", grpc_request([("NOPE", "FP32", [4])], raw=[F4]), "unexpected inference input 'NOPE'"),
    ("input twice", grpc_request([("X", "FP32", [4]), ("X", "FP32", [4])], raw=[F4, F4]),
     "input 'X' already exists in request"),
    ("no inputs", grpc_request([]), "expected 1 inputs but got 0 inputs"),
    ("negative dim", grpc_request([("X", "FP32", [-4])], raw=[F4]), "non-negative integers"),
    ("huge shape, no data", grpc_request([("X", "FP32", [2**62])], raw=[F4]), "unexpected total byte size 16"),
    ("unknown output", grpc_request([("X", "FP32", [4])], raw=[F4], outputs=["NOPE"]), "unexpected inference output"),
    ("negative priority", grpc_request([("X", "FP32", [4])], raw=[F4], params={"priority": ("int64_param", -1)}),
     "'priority' must be an integer from 0 to 2^64-1"),
    ("string timeout", grpc_request([("X", "FP32", [4])], raw=[F4], params={"timeout": ("string_param", "5")}),
     "'timeout' must be an integer"),
    ("reserved key", grpc_request([("X", "FP32", [4])], raw=[F4], params={"triton_x": ("int64_param", 1)}),
     "reserved"),
    ("sequence_start not a bool", grpc_request([("X", "FP32", [4])], raw=[F4],
                                               params={"sequence_start": ("string_param", "x")}),
     "'sequence_start' must be a boolean"),
    ("id too long", grpc_request([("X", "FP32", [4])], raw=[F4], request_id="i" * 1025), "longer than 1024"),
]


@pytest.mark.parametrize("request_message,fragment", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_faults_are_invalid_input(request_message: Any, fragment: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(fragment)):
        decode_infer(request_message, spec_for("FP32"), None)


def test_a_parameter_without_a_value_is_refused() -> None:
    request = grpc_request([("X", "FP32", [4])], raw=[F4])
    request.parameters["p"].SetInParent()  # present, with none of its oneof set
    with pytest.raises(InvalidInput, match="'p' must be a string, number or boolean"):
        decode_infer(request, spec_for("FP32"), None)


@pytest.mark.parametrize("datatype,field,values", [
    ("INT8", "int_contents", [127, 128]), ("INT8", "int_contents", [-129, 0]), ("INT16", "int_contents", [2**15, 0]),
    ("UINT8", "uint_contents", [256, 0]), ("UINT16", "uint_contents", [2**16, 0]),
])
def test_typed_values_outside_the_datatype_are_refused(datatype: str, field: str, values: list[int]) -> None:
    """Triton would truncate them; the value the client meant cannot be known, so it is an error."""
    with pytest.raises(InvalidInput, match=f"outside the range of {datatype}"):
        decode_infer(grpc_request([("X", datatype, [2])], typed={"X": (field, values)}), spec_for(datatype), None)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_floats_have_no_typed_contents(datatype: str) -> None:
    with pytest.raises(InvalidInput, match=f"of type 'FP32', expected datatype '{datatype}'"):
        decode_infer(grpc_request([("X", datatype, [1])], typed={"X": ("fp32_contents", [1.0])}),
                     spec_for(datatype), None)


@pytest.mark.parametrize("raw", [struct.pack("<I", 9) + b"abc", struct.pack("<I", 1) + b"ab", b"\x01\x00"])
def test_malformed_bytes_framing_is_refused(raw: bytes) -> None:
    with pytest.raises(InvalidInput, match="BYTES"):
        decode_infer(grpc_request([("X", "BYTES", [1])], raw=[raw]), spec_for("BYTES"), None)


def test_batch_rules_are_http_s() -> None:
    four = np.zeros(4, np.int32).tobytes()
    with pytest.raises(InvalidInput, match="batch-size must be <= 8"):
        decode_infer(grpc_request([("A", "INT32", [9, 4]), ("B", "INT32", [9, 4])], raw=[four * 9, four * 9]),
                     ADD_SUB, None)
    with pytest.raises(InvalidInput, match="same batch size"):
        decode_infer(grpc_request([("A", "INT32", [1, 4]), ("B", "INT32", [2, 4])], raw=[four, four * 2]),
                     ADD_SUB, None)
    with pytest.raises(InvalidInput, match=re.escape("missing required input(s) ['B']")):
        decode_infer(grpc_request([("A", "INT32", [1, 4])], raw=[four]), ADD_SUB, None)


@pytest.mark.parametrize("raw", [b"\xff\xff\xff\xff", b"\x0a\x05ab", pb.ModelInferRequest(
    model_name="m", raw_input_contents=[b"x" * 100]).SerializeToString()[:-7]])
def test_malformed_messages_are_invalid_input(raw: bytes) -> None:
    with pytest.raises(InvalidInput, match="Unable to parse request"):
        parse_message(pb.ModelInferRequest, raw)


def test_versions_are_numbers() -> None:
    assert request_version("") is None and request_version("3") == "3"
    for bad in ("x", "-1", "1.0", "²"):
        with pytest.raises(InvalidInput, match="version should be an integral value"):
            request_version(bad)


# ── responses read back through tritonclient.grpc ───────────────────────────────────────────────────


@settings(max_examples=60, deadline=None, database=None)
@given(st.data(), st.sampled_from(sorted(DATATYPES)), st.integers(0, 5))
def test_responses_read_back_with_tritonclient(data: st.DataObject, datatype: str, n: int) -> None:
    values = data.draw(values_of(datatype, n))
    outputs = [WireTensor("Y", datatype, (1, n), raw_bytes(datatype, values)),
               WireTensor("Z", "FP32", (1, 1), memoryview(np.float32([2.5]).tobytes()))]
    req = ParsedInfer("req-7", [], None, frozenset(), True)
    response = encode_infer("m", 3, req, outputs, {"flag": True, "n": 2**64 - 1, "x": 0.5, "s": "t", "i": -3})
    wire = pb.ModelInferResponse.FromString(response.SerializeToString())
    assert (wire.model_name, wire.model_version, wire.id) == ("m", "3", "req-7")
    assert list(wire.raw_output_contents) == [raw_bytes(datatype, values), np.float32([2.5]).tobytes()]
    params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in wire.parameters.items()}
    assert params == {"flag": True, "n": 2**64 - 1, "x": 0.5, "s": "t", "i": -3}
    result = tg.InferResult(wire)
    got = result.as_numpy("Y")
    assert got.shape == (1, n)
    if datatype == "BYTES":
        assert got.reshape(-1).tolist() == values
    else:
        assert got.tobytes() == raw_bytes(datatype, values)
    assert result.as_numpy("Z").tolist() == [[2.5]]


# ── tables over the whole proto ─────────────────────────────────────────────────────────────────────


def test_every_rpc_is_served_or_listed_as_not_yet() -> None:
    names = {m.name for m in SERVICE.methods}
    assert len(names) == 20
    served = {n for n in names if callable(getattr(InferenceService, n, None))}
    assert served | set(NOT_YET) == names and not served & set(NOT_YET)
    assert set(HTTP_TWIN) == names


def test_every_error_code_has_a_grpc_status() -> None:
    assert set(GRPC_STATUS) == set(ErrorCode) == set(STATUS)
    # (the gateway's own codes, gateway/grpc/status_codes.py, carry grpcio's numbers: test_process_imports.py)
    assert GRPC_STATUS[ErrorCode.UNKNOWN_MODEL] == StatusCode.NOT_FOUND
    assert STATUS[ErrorCode.UNKNOWN_MODEL] == 404  # what tritonserver 2.51 answers over HTTP
    assert GRPC_STATUS[ErrorCode.INVALID_ARG] == StatusCode.INVALID_ARGUMENT
    assert GRPC_STATUS[ErrorCode.UNAVAILABLE] == StatusCode.UNAVAILABLE
    assert GRPC_STATUS[ErrorCode.UNSUPPORTED] == StatusCode.UNIMPLEMENTED
    assert GRPC_STATUS[ErrorCode.CANCELLED] == StatusCode.CANCELLED
    assert GRPC_STATUS[ErrorCode.UNAUTHENTICATED] == StatusCode.UNAUTHENTICATED
    assert issubclass(InvalidInput, ServingError)


def test_grpc_flags_pass_from_fleet_up_to_its_gateway() -> None:
    parser = build_parser()
    up = settings_from_args(parser.parse_args([
        "up", "--grpc-port", "9101", "--grpc-address", "0.0.0.0", "--allow-grpc", "false",
        "--grpc-keepalive-time", "1000", "--grpc-keepalive-timeout", "500", "--grpc-keepalive-permit-without-calls",
        "true", "--grpc-http2-max-pings-without-data", "0", "--grpc-http2-min-recv-ping-interval-without-data", "10",
        "--grpc-http2-max-ping-strikes", "5", "--grpc-infer-response-compression-level", "high"]))
    assert (up.grpc_port, up.grpc_host, up.allow_grpc, up.grpc_keepalive_permit_without_calls) == \
        (9101, "0.0.0.0", False, True)
    gateway = settings_from_args(parser.parse_args(["gateway", *grpc_flags.argv(up)]))
    fields = [f for f in Settings.model_fields if f.startswith("grpc_") or f == "allow_grpc"]
    assert {f: getattr(gateway, f) for f in fields} == {f: getattr(up, f) for f in fields}
    assert settings_from_args(parser.parse_args(["gateway"])).grpc_port == 8001
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--allow-grpc", "maybe"])


def test_server_settings_follow_tritonserver_s_flags() -> None:
    settings = Settings(max_input_bytes=1000, grpc_keepalive_time_ms=5000, grpc_keepalive_timeout_ms=6000,
                        grpc_keepalive_permit_without_calls=True, grpc_http2_max_pings_without_data=7,
                        grpc_http2_min_recv_ping_interval_without_data_ms=8000, grpc_http2_max_ping_strikes=9,
                        max_header_bytes=4096)
    applied = local_settings(settings)
    assert (applied.keepalive_time_s, applied.keepalive_timeout_s, applied.keepalive_permit_without_calls,
            applied.max_pings_without_data, applied.min_recv_ping_interval_without_data_s, applied.max_ping_strikes,
            applied.max_header_list_size) == (5.0, 6.0, True, 7, 8.0, 9, 4096)
    # The response compression level picks among what the client accepts, as grpc core ranks them.
    accepts = b"identity,deflate,gzip"
    assert [response_encoding(level, accepts) for level in ("none", "low", "med", "high")] == \
        [None, b"gzip", b"deflate", b"deflate"]
    assert response_encoding("high", b"identity") is None
    assert response_encoding("low", None) is None
    assert address("::1", 8001) == "[::1]:8001" and address("0.0.0.0", 8001) == "0.0.0.0:8001"
