"""Codec round trips for every datatype: tensors <-> wire bytes, the msgpack envelope, and the HTTP
codec (JSON data and the binary tensor extension) against a model config."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fleet import tensors
from fleet.datatypes import BY_NAME
from fleet.envelope import (
    ReplyEnvelope,
    RequestEnvelope,
    WireTensor,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from fleet.errors import ErrorCode, InvalidInput, Unsupported
from fleet.kserve import parse_infer, render_infer
from fleet.model_config import parse_config
from gateway.errors import STATUS

FIXED = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5)


@pytest.mark.parametrize("name", FIXED)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_fixed_size_round_trip(name: str, data: st.DataObject) -> None:
    dt = BY_NAME[name]
    arr = data.draw(hnp.arrays(dt.numpy, shapes))
    back = tensors.from_bytes(tensors.to_bytes(arr, dt), dt, arr.shape)
    np.testing.assert_array_equal(back, arr)
    assert back.dtype == dt.numpy


@pytest.mark.parametrize("name", [*FIXED, "BF16", "BYTES"])
@settings(max_examples=20, deadline=None)
@given(data=st.data(), transpose=st.booleans())
def test_wire_view_is_the_wire_bytes_and_shares_a_contiguous_arrays_memory(
        name: str, data: st.DataObject, transpose: bool) -> None:
    dt = BY_NAME[name]
    source = np.float32 if name == "BF16" else dt.numpy
    if name == "BYTES":
        arr = np.array(data.draw(st.lists(st.binary(max_size=8), min_size=1, max_size=6)), dtype=np.object_)
    else:
        arr = data.draw(hnp.arrays(source, shapes))
    arr = arr.T if transpose else arr  # a transposed array is not C-contiguous: copied, in C order
    view = tensors.wire_view(arr, dt)
    assert bytes(view) == tensors.to_bytes(arr, dt) and len(view) == len(tensors.to_bytes(arr, dt))
    if isinstance(view, memoryview) and arr.flags.c_contiguous and arr.size:
        assert np.shares_memory(np.frombuffer(view, np.uint8), arr)  # no copy


@settings(max_examples=50, deadline=None)
@given(shape=shapes, data=st.data())
def test_bytes_round_trip(shape: tuple[int, ...], data: st.DataObject) -> None:
    n = int(np.prod(shape))
    items = data.draw(st.lists(st.binary(max_size=20), min_size=n, max_size=n))
    arr = np.empty(n, dtype=np.object_)
    arr[:] = items
    arr = arr.reshape(shape)
    back = tensors.from_bytes(tensors.to_bytes(arr, BY_NAME["BYTES"]), BY_NAME["BYTES"], shape)
    assert back.shape == tuple(shape) and back.reshape(-1).tolist() == items


def test_bf16_is_upper_half_of_fp32_rounded_to_nearest_even() -> None:
    x = np.array([1.0, -2.5, 3.140625], dtype=np.float32)  # exact in BF16
    raw = tensors.to_bytes(x, BY_NAME["BF16"])
    assert raw == (x.view(np.uint32) >> 16).astype("<u2").tobytes()
    np.testing.assert_array_equal(tensors.from_bytes(raw, BY_NAME["BF16"], [3]), x)
    # 0x3F808000 is halfway between 0x3F80 and 0x3F81: ties go to the even one; just above, up.
    ties = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0xBF80FFFF], dtype=np.uint32).view(np.float32)
    assert list(tensors.float32_to_bf16(ties)) == [0x3F80, 0x3F82, 0x3F81, 0xBF81]
    special = np.array([np.inf, -np.inf, np.nan, -np.nan, 3.4e38], dtype=np.float32)
    assert list(tensors.float32_to_bf16(special)) == [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F80]


def test_bad_sizes_and_framing_are_invalid_input() -> None:
    with pytest.raises(InvalidInput):
        tensors.from_bytes(b"\x00" * 7, BY_NAME["FP32"], [2])
    with pytest.raises(InvalidInput):
        tensors.from_bytes(b"\x05\x00\x00\x00ab", BY_NAME["BYTES"], [1])
    with pytest.raises(InvalidInput):
        tensors.from_bytes(b"\x01\x00\x00\x00a", BY_NAME["BYTES"], [2])


def test_envelope_round_trip() -> None:
    env = RequestEnvelope(id="g:1", model="m", version=3, inputs=[WireTensor("A", "FP32", (2, 2), b"\x00" * 16)],
                          reply_to="fleet:reply:g", enqueued_at_us=123, outputs=["B"], parameters={"k": 1.5},
                          priority=2, deadline_us=999, client_id="cid")
    back = decode_request(encode_request(env))
    assert back == env
    rep = ReplyEnvelope(id="g:1", model_version=3, outputs=[WireTensor("B", "INT8", (1,), b"\x07")],
                        parameters={"p": "v"}, queue_us=5, compute_us=6)
    assert decode_reply(encode_reply(rep)) == rep
    err = ReplyEnvelope(id="g:2", error_code="INTERNAL", error_message="boom")
    assert decode_reply(encode_reply(err)) == err
    with pytest.raises(InvalidInput):
        decode_request(b"\x93garbage")


ALL_TYPES_CONFIG = "\n".join(
    ['name: "all"', 'backend: "python"', "max_batch_size: 4"]
    + [f'input {{ name: "I_{n}" data_type: {BY_NAME[n].config_name} dims: [ -1 ] optional: true }}'
       for n in [*FIXED, "BF16", "BYTES"]]
    + [f'output {{ name: "O_{n}" data_type: {BY_NAME[n].config_name} dims: [ -1 ] }}'
       for n in [*FIXED, "BF16", "BYTES"]]
)
SPEC = parse_config(ALL_TYPES_CONFIG, source="all/config.pbtxt", model_name="all")


def sample(name: str) -> np.ndarray:
    if name == "BYTES":
        return np.array([[b"a", b"", "é".encode()]], dtype=np.object_)
    if name == "BOOL":
        return np.array([[True, False, True]])
    dt = np.float32 if name == "BF16" else BY_NAME[name].numpy
    return np.array([[1, 0, 2]], dtype=dt)


@pytest.mark.parametrize("name", [*FIXED, "BF16", "BYTES"])
@pytest.mark.parametrize("binary", [True, False])
def test_http_codec_every_datatype(name: str, binary: bool) -> None:
    arr = sample(name)
    dt = BY_NAME[name]
    raw = tensors.to_bytes(arr, dt)
    inp: dict[str, object] = {"name": f"I_{name}", "datatype": name, "shape": list(arr.shape)}
    if binary:
        inp["parameters"] = {"binary_data_size": len(raw)}
    else:
        inp["data"] = [v.decode() for v in arr.reshape(-1)] if name == "BYTES" else arr.reshape(-1).tolist()
    header = json.dumps({"id": "x", "inputs": [inp], "outputs": [
        {"name": f"O_{name}", "parameters": {"binary_data": binary}}]}).encode()
    body = header + raw if binary else header
    req = parse_infer(body, str(len(header)) if binary else None, SPEC)
    assert bytes(req.inputs[0].data) == raw
    out = WireTensor(f"O_{name}", name, arr.shape, raw)
    rendered, hlen = render_infer("all", 1, req, [out], {})
    if binary:
        assert hlen is not None and rendered[hlen:] == raw
        doc = json.loads(rendered[:hlen])
        assert doc["outputs"][0]["parameters"] == {"binary_data_size": len(raw)}
    else:
        assert hlen is None
        doc = json.loads(rendered)
        expected = inp["data"]
        assert doc["outputs"][0]["data"] == expected
    assert doc["id"] == "x" and doc["model_version"] == "1"


SIMPLE = parse_config(
    'name: "s"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    'input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
    'output [ { name: "C" data_type: TYPE_INT32 dims: [ 16 ] } ]',
    source="s", model_name="s",
)


def good_inputs(batch: int = 1) -> list[dict[str, object]]:
    return [{"name": n, "datatype": "INT32", "shape": [batch, 16], "data": [1] * 16 * batch} for n in "AB"]


@pytest.mark.parametrize("doc,exc,msg", [
    ({"inputs": good_inputs(9)}, InvalidInput, "batch-size must be <= 8"),
    ({"inputs": good_inputs()[:1]}, InvalidInput, "missing"),
    ({"inputs": [*good_inputs(), {"name": "Z", "datatype": "INT32", "shape": [1], "data": [1]}]}, InvalidInput,
     re.escape("expected 2 inputs but got 3 inputs for model 's'. Got input(s) ['A','B','Z'], but missing "
               "required input(s) ]")),  # tritonserver 2.51 counts the inputs before it looks at their names
    ({"inputs": [good_inputs()[0], {"name": "Z", "datatype": "INT32", "shape": [1], "data": [1]}]}, InvalidInput,
     "^unexpected inference input 'Z' for model 's'$"),
    ({"inputs": [{**good_inputs()[0], "datatype": "FP32"}, good_inputs()[1]]}, InvalidInput, "data-type"),
    ({"inputs": [{**good_inputs()[0], "shape": [1, 15]}, good_inputs()[1]]}, InvalidInput, "unexpected shape"),
    ({"inputs": [{**good_inputs()[0], "data": [1] * 15}, good_inputs()[1]]}, InvalidInput, "number of elements"),
    ({"inputs": [{**good_inputs()[0], "data": ["x"] * 16}, good_inputs()[1]]}, InvalidInput, "JSON numbers"),
    ({"inputs": good_inputs(), "outputs": [{"name": "nope"}]}, InvalidInput, "unexpected inference output"),
    ({"inputs": good_inputs(), "parameters": {"triton_x": 1}}, InvalidInput, "reserved"),
    ({"inputs": [{**good_inputs()[0], "parameters": {"shared_memory_region": "r"}}, good_inputs()[1]]},
     InvalidInput, "exactly one"),
    ({"inputs": [{"name": "A", "datatype": "INT32", "shape": [1, 16],
                  "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64}}, good_inputs()[1]]},
     Unsupported, "shared memory"),  # no regions: a bulk job's line
    ({"inputs": [{**good_inputs()[0], "parameters": {"binary_data_size": 64}}, good_inputs()[1]]}, InvalidInput,
     "exactly one"),
    ({}, InvalidInput, "inputs"),
])
def test_bad_requests(doc: dict[str, object], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        parse_infer(json.dumps(doc).encode(), None, SIMPLE)


def test_binary_framing_errors() -> None:
    ins = [{"name": n, "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}} for n in "AB"]
    header = json.dumps({"inputs": ins}).encode()
    with pytest.raises(InvalidInput, match="additional input data"):
        parse_infer(header + b"\x00" * 129, str(len(header)), SIMPLE)
    with pytest.raises(InvalidInput, match="end of binary data"):
        parse_infer(header + b"\x00" * 100, str(len(header)), SIMPLE)
    with pytest.raises(InvalidInput, match="outside the body"):
        parse_infer(header, str(len(header) + 1), SIMPLE)
    req = parse_infer(header + b"\x00" * 128, str(len(header)), SIMPLE)
    assert [len(t.data) for t in req.inputs] == [64, 64]


def test_binary_output_defaults() -> None:
    req = parse_infer(json.dumps({"inputs": good_inputs(), "parameters": {"binary_data_output": True}}).encode(),
                      None, SIMPLE)
    assert req.is_binary("C")
    req = parse_infer(json.dumps({"inputs": good_inputs(), "outputs": [{"name": "C"}],
                                  "parameters": {"binary_data_output": True}}).encode(), None, SIMPLE)
    assert not req.is_binary("C")  # listed without binary_data: Triton's code answers JSON


def test_every_error_code_has_a_status() -> None:
    assert set(STATUS) == set(ErrorCode)
    assert STATUS[ErrorCode.INVALID_ARG] == 400 and STATUS[ErrorCode.NOT_FOUND] == 404
    assert STATUS[ErrorCode.UNAVAILABLE] == 503 and STATUS[ErrorCode.INTERNAL] == 500


@pytest.mark.parametrize("encoding", ["gzip", "deflate", None])
def test_compressed_request_bodies(encoding: str | None) -> None:
    import gzip
    import zlib

    from fleet.content_encoding import decompress

    body = json.dumps({"inputs": good_inputs()}).encode()
    packed = {"gzip": gzip.compress, "deflate": zlib.compress, None: lambda b: b}[encoding](body)
    assert decompress(packed, encoding, 1 << 20) == body
    with pytest.raises(InvalidInput):
        decompress(b"not compressed", "gzip", 1 << 20)
    with pytest.raises(InvalidInput, match="unsupported Content-Encoding"):
        decompress(body, "br", 1 << 20)
    if encoding is not None:
        with pytest.raises(InvalidInput, match="truncated"):
            decompress(packed[:-12], encoding, 1 << 20)


def test_a_decompression_bomb_stops_at_the_body_limit() -> None:
    import gzip

    from fleet.content_encoding import decompress

    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~64 KB
    assert len(bomb) < 100_000
    with pytest.raises(InvalidInput, match="exceeds the limit of 1048576 bytes"):
        decompress(bomb, "gzip", 1 << 20)


@pytest.mark.parametrize(("header", "match"), [
    (b'{"inputs": [' * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [NaN]}]}', "NaN is not valid JSON"),
    (b'{"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [-Infinity]}]}', "Infinity"),
    (b"\xff\xfe{}", "failed to parse"),
    (json.dumps({"id": "x" * 5000, "inputs": []}).encode(), "longer than 1024"),
])
def test_hostile_json_is_a_clear_400(header: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        parse_infer(header, None, SPEC)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
input_docs = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["A", "B", "Z", ""]) | json_values,
    "datatype": st.sampled_from(["INT32", "FP32", "BYTES", "BOOL", "nope"]) | json_values,
    "shape": st.lists(st.integers(-2, 40), max_size=3) | json_values,
    "data": st.lists(st.integers(-5, 5), max_size=40) | json_values,
    "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-3, 200) | json_values,
                                                      "shared_memory_region": st.text(max_size=3)}) | json_values,
})
request_docs = st.fixed_dictionaries({}, optional={
    "id": st.text(max_size=4) | json_values,
    "inputs": st.lists(input_docs, max_size=3) | json_values,
    "outputs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["C", "X"])}, optional={
        "parameters": st.dictionaries(st.sampled_from(["binary_data", "classification"]), json_values)}),
        max_size=2) | json_values,
    "parameters": st.dictionaries(st.sampled_from(["priority", "timeout", "binary_data_output", "x", "triton_y"]),
                                  json_values, max_size=3) | json_values,
})


@settings(max_examples=300, deadline=None)
@given(doc=request_docs, tail=st.binary(max_size=80), framed=st.booleans())
def test_hostile_requests_only_raise_serving_errors(doc: dict[str, object], tail: bytes, framed: bool) -> None:
    """Whatever a client sends, parsing answers with a ServingError (a 4xx/5xx), never a crash."""
    from fleet.errors import ServingError

    header = json.dumps(doc).encode()
    try:
        if framed:
            parse_infer(header + tail, str(len(header)), SIMPLE)
        else:
            parse_infer(header, None, SIMPLE)
    except ServingError:
        pass


@pytest.mark.parametrize("header,expected", [
    (None, None), ("", None), ("gzip", "gzip"), ("deflate", "deflate"), ("identity", None),
    ("gzip;q=0.5, deflate;q=0.8", "deflate"), ("br", None), ("gzip;q=0, identity", None),
    ("identity;q=0.1, gzip", "gzip"), ("gzip;q=abc, deflate", "deflate"),
])
def test_response_encoding_negotiation(header: str | None, expected: str | None) -> None:
    from fleet.content_encoding import response_encoding

    assert response_encoding(header) == expected


@pytest.mark.parametrize("binary", [True, False])
def test_a_huge_claimed_shape_is_refused_before_any_allocation(binary: bool) -> None:
    import tracemalloc

    inp: dict[str, object] = {"name": "I_FP32", "datatype": "FP32", "shape": [1, 10**12]}
    if binary:
        inp["parameters"] = {"binary_data_size": 10}
    else:
        inp["data"] = [1.0]
    header = json.dumps({"inputs": [inp]}).encode()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match="000000000000"):
            parse_infer(header + (b"\0" * 10 if binary else b""), str(len(header)) if binary else None, SPEC)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_envelopes_decode_plain_data_only() -> None:
    import msgpack

    from fleet.envelope import decode_request

    base = {"id": "a", "m": "m", "v": 1, "i": [], "r": "reply", "t": 0}
    with pytest.raises(InvalidInput, match="extension type 42"):
        decode_request(msgpack.packb({**base, "p": {"x": msgpack.ExtType(42, b"obj")}}))
    with pytest.raises(InvalidInput):
        decode_request(msgpack.packb({**base, "p": {1: "int key"}}))
    assert decode_request(msgpack.packb(base)).id == "a"


@pytest.mark.parametrize("doc,message", [
    # Each text is what tritonserver 2.51 answered for the same body (the anchor's `double`, checked by hand).
    ({"inputs": []}, "[request id: <id_unknown>] expected 2 inputs but got 0 inputs for model 's'. Got input(s) [], "
                     "but missing required input(s) ['A','B']. Please provide all required input(s)."),
    ({"id": "r7", "inputs": [good_inputs()[0], good_inputs()[0]]},
     "[request id: r7] input 'A' already exists in request"),
    ({"inputs": [{**good_inputs()[0], "datatype": "FP32"}, good_inputs()[1]]},
     "[request id: <id_unknown>] inference input 'A' data-type is 'FP32', but model 's' expects 'INT32'"),
    ({"inputs": [{**good_inputs()[0], "shape": [1, 15]}, good_inputs()[1]]},
     "[request id: <id_unknown>] unexpected shape for input 'A' for model 's'. Expected [-1,16], got [1,15]. NOTE: "
     "Setting a non-zero max_batch_size in the model config requires a batch dimension to be prepended to each "
     "input shape. If you want to specify the full shape including the batch dim in your input dims config, try "
     "setting max_batch_size to zero. See the model configuration docs for more info on max_batch_size."),
    ({"inputs": good_inputs(9)}, "[request id: <id_unknown>] inference request batch-size must be <= 8 for 's'"),
])
def test_input_errors_in_tritons_words(doc: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_infer(json.dumps(doc).encode(), None, SIMPLE)
    assert refused.value.message == message
