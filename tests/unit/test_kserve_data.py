"""The data rules of fleet.kserve / fleet.tensor_json without a server: whatever parse_infer accepts can
cross Redis (a request it passes never fails later on encoding), `data` nests exactly as its shape or
not at all, and render_infer writes only strict JSON, carrying every value unaltered or refusing."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet import tensors
from fleet.datatypes import BY_NAME
from fleet.envelope import RequestEnvelope, WireTensor, encode_request
from fleet.errors import InferenceFailed, InvalidInput, ServingError
from fleet.kserve import ParsedInfer, parse_infer, render_infer
from fleet.model_config import parse_config
from fleet.tensor_json import pack_json
from tests.support.infer_bodies import response_outputs, strict_json

SPEC = parse_config(
    'name: "m"\nbackend: "python"\nmax_batch_size: 0\n'
    'input [ { name: "A" data_type: TYPE_INT64 dims: [ 2, 2 ] }, { name: "S" data_type: TYPE_STRING dims: [ -1 ] '
    "optional: true } ]\n"
    'output [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "T" data_type: TYPE_STRING dims: [ -1 ] } ]',
    source="m", model_name="m",
)


def parse(doc: Any) -> ParsedInfer:
    return parse_infer(json.dumps(doc).encode(), None, SPEC)


def a_input(data: Any, shape: list[int] | None = None) -> dict[str, Any]:
    return {"name": "A", "datatype": "INT64", "shape": shape or [2, 2], "data": data}


big = st.one_of(st.integers(), st.integers(2**62, 2**66), st.integers(-(2**66), -(2**62)), st.just(2**64),
                st.just(2**63), st.just(-(2**63) - 1))
values = st.recursive(st.none() | st.booleans() | big | st.floats(allow_nan=False) | st.text(max_size=4),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=2), max_leaves=6)
keys = st.sampled_from(["priority", "timeout", "sequence_id", "binary_data_output", "x", "y"])


@settings(max_examples=400, deadline=None)
@given(params=st.dictionaries(keys, st.one_of(big, values), max_size=4),
       shape=st.one_of(st.just([4]), st.lists(big, min_size=1, max_size=3)),
       data=st.one_of(st.just([[1, 2], [3, 4]]), st.lists(big, min_size=4, max_size=4), values))
def test_whatever_parses_can_cross_redis(params: dict[str, Any], shape: list[int], data: Any) -> None:
    """A request the parser accepts must encode into an envelope: a number msgpack cannot carry once made
    a 500 with a traceback after parsing, instead of a 400."""
    doc = {"parameters": params, "inputs": [a_input(data), {"name": "S", "datatype": "BYTES", "shape": shape,
                                                               "data": ["s"] * 4}]}
    try:
        req = parse(doc)
    except ServingError as exc:
        assert exc.code.value in ("INVALID_ARG", "UNSUPPORTED"), exc
        return
    encode_request(RequestEnvelope(id="g:1", model="m", version=1, inputs=req.inputs, reply_to="r",
                                   enqueued_at_us=0, outputs=req.outputs, parameters=req.parameters,
                                   priority=req.priority, client_id=req.client_id))


@pytest.mark.parametrize("data", [[1, 2, 3, 4], [[1, 2], [3, 4]], 7])
def test_flat_or_exactly_nested_data(data: Any) -> None:
    if data == 7:  # a lone scalar is one element (Triton reads it so): the count decides
        with pytest.raises(InvalidInput, match="got 1, expected 4"):
            parse({"inputs": [a_input(data)]})
        return
    req = parse({"inputs": [a_input(data)]})
    assert np.frombuffer(req.inputs[0].data, "<i8").tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("data", [[[1, 2, 3], [4]], [[1], [2, 3, 4]], [[1, 2, 3, 4]], [[[1, 2], [3, 4]]],
                                  [1, 2, [3], 4], [[1, 2], 3, 4], [[1, 2], [3, [4]]]])
def test_ragged_or_misnested_data_is_refused(data: Any) -> None:
    with pytest.raises(InvalidInput, match=r"nested exactly as its shape \[2, 2\]|got \d, expected 4"):
        parse({"inputs": [a_input(data)]})


@pytest.mark.parametrize("element,message", [
    (None, "element 2 of 'data' is null; INT64 elements are JSON numbers"),
    (True, "element 2 of 'data' is a boolean"), ("3", "element 2 of 'data' is a string"),
    ({"v": 3}, "element 2 of 'data' is an object"), (2.5, "element 2 of 'data' is a number with a fraction"),
    (2**63, "outside the range of INT64; its elements must be integers from -9223372036854775808 to "
            "9223372036854775807"),
])
def test_wrong_elements_are_named(element: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(")):
        parse({"inputs": [a_input([1, 2, element, 4])]})


def test_outputs_empty_duplicate_and_binary_flags() -> None:
    assert parse({"inputs": [a_input([1, 2, 3, 4])], "outputs": []}).outputs is None
    with pytest.raises(InvalidInput, match="output 'X' is requested more than once"):
        parse({"inputs": [a_input([1, 2, 3, 4])], "outputs": [{"name": "X"}, {"name": "X"}]})
    with pytest.raises(InvalidInput, match="'binary_data' must be a boolean"):
        parse({"inputs": [a_input([1, 2, 3, 4])], "outputs": [{"name": "X", "parameters": {"binary_data": "yes"}}]})


def render(outputs: list[WireTensor], binary: bool = False, parameters: dict[str, Any] | None = None) -> Any:
    req = parse({"inputs": [a_input([1, 2, 3, 4])], "parameters": {"binary_data_output": binary}})
    body, hlen = render_infer("m", 1, req, outputs, parameters or {})
    return response_outputs({} if hlen is None else {"inference-header-content-length": str(hlen)}, body)


def fp(name: str, values: list[float]) -> WireTensor:
    return WireTensor("X", name, (len(values),), tensors.to_bytes(np.array(values, np.float32), BY_NAME[name]))


@pytest.mark.parametrize("name", ["FP16", "FP32", "FP64", "BF16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_outputs_are_never_written_as_json(name: str, value: float) -> None:
    with pytest.raises(InvalidInput, match="output 'X' holds NaN or infinity.*binary_data"):
        render([fp(name, [1.0, value])])
    _, outputs = render([fp(name, [1.0, value])], binary=True)
    np.testing.assert_array_equal(outputs["X"].astype(np.float64), [1.0, value])


def test_bytes_outputs_are_never_altered() -> None:
    items = np.array([b"ok", b"\xff", "é".encode()], dtype=object)
    t = WireTensor("T", "BYTES", (3,), tensors.to_bytes(items, BY_NAME["BYTES"]))
    with pytest.raises(InvalidInput, match="output 'T': element 1 is not UTF-8 text"):
        render([t])
    _, outputs = render([t], binary=True)
    assert outputs["T"].tolist() == items.tolist()
    ok = WireTensor("T", "BYTES", (2,), tensors.to_bytes(np.array([b"a", "é".encode()], dtype=object),
                                                         BY_NAME["BYTES"]))
    doc, _ = render([ok])
    assert doc["outputs"][0]["data"] == ["a", "é"]


def test_a_nan_response_parameter_is_the_model_s_fault() -> None:
    with pytest.raises(InferenceFailed, match="response parameter to NaN"):
        render([fp("FP32", [1.0])], parameters={"p": float("nan")})


@pytest.mark.parametrize("body,message", [
    ('{"inputs": []}'.encode("utf-16"), "it is UTF-16 text"),
    ('{"inputs": []}'.encode("utf-32-be"), "UTF-16 or UTF-32"),
    (b"\xef\xbb\xbf{}", "UTF-8 byte order mark"), (b'{"id": "\xc3("}', "it is not UTF-8 text (byte 8 is 0xc3)"),
    (b'{"id": ' + b"9" * 5000 + b"}", "an integer has more than 4300 digits"),
    (b'{"id" "a"}', "Expecting ':' delimiter at offset 6"),
])
def test_bodies_that_are_no_utf8_json(body: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_infer(body, None, SPEC)


def test_rendered_json_is_strict() -> None:
    doc, _ = render([fp("FP32", [1.5, -0.0, 3.4e38])])
    assert strict_json(json.dumps(doc).encode())["outputs"][0]["data"] == [1.5, -0.0, float(np.float32(3.4e38))]


@pytest.mark.parametrize(("datatype", "data", "says"), [
    ("FP32", [1.0, 1e39], "outside the range of FP32"),  # a double, but past FP32's range
    ("FP16", [1.0, 70000], "outside the range of FP16"),
    ("FP32", [1.0, float("inf")], "must be finite numbers"),  # json's 1e400
    ("FP32", [float("inf"), 1e39], "outside the range of FP32"),  # both: the range, as with np.errstate
    ("FP64", [1e39, float("-inf")], "must be finite numbers"),
    ("INT8", [1, 300], "outside the range of INT8"),
    ("UINT64", [1, -1], "outside the range of UINT64"),
    ("BF16", [1.0, 3.4e38], "outside the range of BF16; its elements must be finite numbers from "
                            "-3.3895313892515355e[+]38 to 3.3895313892515355e[+]38"),  # FP32, but BF16's inf
    ("BF16", [-1e39, 1.0], "outside the range of BF16"),
])
@pytest.mark.parametrize("warnings_as", ["error", "always", "ignore"])
def test_numbers_past_a_datatype_are_refused_whatever_the_warnings(datatype: str, data: list[Any], says: str,
                                                                   warnings_as: str) -> None:
    # pack_json casts without np.errstate and tells an overflow by the inf it leaves, or, where warnings are
    # errors (as under pytest), by numpy's RuntimeWarning: the same refusal either way.
    with warnings.catch_warnings(record=True):  # ("always": recorded, not shown)
        warnings.simplefilter(warnings_as)
        with pytest.raises(InvalidInput, match=says):
            pack_json(data, BY_NAME[datatype], [2], "x")
        with np.errstate(over="raise"), pytest.raises(InvalidInput, match=says):  # a caller's own errstate
            pack_json(data, BY_NAME[datatype], [2], "x")
    assert np.frombuffer(pack_json([1.0, 3e38], BY_NAME["FP32"], [2], "x"), "<f4").tolist() == \
        [1.0, float(np.float32(3e38))]
    # BF16's largest, and a float just past it that rounds to it, not to infinity
    assert pack_json([3.3895313892515355e38, -3.395e38], BY_NAME["BF16"], [2], "x") == b"\x7f\x7f\x7f\xff"


def test_an_overflow_refused_prints_no_warning_in_a_fleet_process() -> None:
    # A process's own warning filters (not pytest's): numpy's "overflow encountered in cast" is filtered for
    # tensor_json's calls, so a refused 1e39 leaves nothing on stderr.
    code = ("from fleet.tensor_json import pack_json; from fleet.datatypes import BY_NAME\n"
            "try:\n    pack_json([1e39], BY_NAME['FP32'], [1], 'x')\nexcept Exception as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2], check=True)
    assert "outside the range of FP32" in done.stdout
    assert done.stderr == ""
