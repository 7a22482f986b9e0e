"""The data layer of /infer against a running gateway (a `fleet gateway` and a `fleet worker` process on
the session's Redis, over real HTTP on 127.0.0.1): what a request's parameters, body encoding and `data`
may be, what a response carries (only valid JSON, never altered data), which backend errors are the
client's (400), and how a URL's version is read. One reproduction of issue 10 per test.

Responses are read with a strict JSON parser (tests/support/infer_bodies.py); binary outputs are read
with Triton's own client and byte for byte.
"""

from __future__ import annotations

import gzip
import json
import shutil
import struct
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from fleet import tensors
from fleet.datatypes import BY_NAME
from fleet.redis_server import LocalServer
from tests.support.infer_bodies import response_outputs, strict_json
from tests.support.model_repo import TRITON_EXAMPLES
from tests.support.processes import Cluster

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"doubler": ROOT / "tests" / "models" / "doubler",  # FP32 [-1] -> 2x, batching (8)
          "echo_params": ROOT / "tests" / "models" / "echo_params",  # INT32 [1], parameters echoed back
          "data_edges": ROOT / "tests" / "models" / "data_edges",  # outputs JSON cannot carry, by CASE
          "add_sub": ROOT / "model_repository" / "add_sub",  # FP32 [4] + [4], no batching
          "simple_string": TRITON_EXAMPLES / "simple_string"}  # Triton's ONNX model: BYTES [16] as ints
NON_FINITE = [float("nan"), float("inf"), float("-inf"), 1.5]  # what data_edges answers for CASE 1
NOT_UTF8 = [b"ok", b"\xff\xfe\x00", b"\xc3("]  # ... and for CASE 2


@pytest.fixture(scope="module")
def gateway(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a gateway process with a worker process, on the session's Redis under a key prefix of
    their own. simple_string_batched is Triton's simple_string with a dynamic batcher that waits 300 ms,
    so two requests sent together share one onnxruntime run; simple_loose is Triton's simple with its
    config dims loosened, so onnxruntime itself refuses a shape the gateway lets through."""
    tmp = tmp_path_factory.mktemp("http-data")
    repo = tmp / "models"
    for name, src in MODELS.items():
        shutil.copytree(src, repo / name)
    loose = repo / "simple_loose"  # Triton's simple, its config dims loosened to [-1]: ONNX still takes 16
    shutil.copytree(TRITON_EXAMPLES / "simple", loose)
    config = (loose / "config.pbtxt").read_text().replace('name: "simple"', 'name: "simple_loose"')
    (loose / "config.pbtxt").write_text(config.replace("dims: [ 16 ]", "dims: [ -1 ]"))
    batched = repo / "simple_string_batched"
    shutil.copytree(TRITON_EXAMPLES / "simple_string", batched)
    config = (batched / "config.pbtxt").read_text().replace('name: "simple_string"', 'name: "simple_string_batched"')
    (batched / "config.pbtxt").write_text(config + "\ndynamic_batching { max_queue_delay_microseconds: 300000 }\n")
    env = {"FLEET_KEY_PREFIX": f"hd{uuid.uuid4().hex[:8]}", "FLEET_CONTROL_API": "1"}  # control: the index route
    cluster = Cluster(tmp, repo, env, redis_port=redis_server.port)
    cluster.start_gateway()
    cluster.start_worker()
    try:
        cluster.wait_ready()
        yield cluster.base_url
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as c:
        yield c


def infer(client: httpx.Client, model: str, doc: Any = None, *, content: bytes | None = None,
          headers: dict[str, str] | None = None, path: str | None = None) -> httpx.Response:
    body = content if content is not None else json.dumps(doc).encode()
    return client.post(path or f"/v2/models/{model}/infer", content=body, headers=headers)


def error_of(r: httpx.Response, status: int) -> str:
    """The error message of a response that must have `status`, read as strict JSON."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    doc = strict_json(r.content)
    assert set(doc) == {"error"} and isinstance(doc["error"], str), doc
    return str(doc["error"])


def echo(params: dict[str, Any]) -> dict[str, Any]:
    return {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [7]}], "parameters": params}


def case(n: int, outputs: list[dict[str, Any]] | None = None, binary: bool | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"inputs": [{"name": "CASE", "datatype": "INT32", "shape": [1], "data": [n]}]}
    if outputs is not None:
        doc["outputs"] = outputs
    if binary is not None:
        doc["parameters"] = {"binary_data_output": binary}
    return doc


# --- 1. numbers outside 64 bits -----------------------------------------------------------------------------


@pytest.mark.parametrize("params,needle", [
    ({"x": 2**70}, "parameter 'x' is outside the signed 64-bit integer range"),
    ({"x": 2**63}, "parameter 'x' is outside the signed 64-bit integer range"),
    ({"x": -(2**63) - 1}, "parameter 'x' is outside the signed 64-bit integer range"),
    ({"x": [2**70]}, "parameter 'x' must be a string, number or boolean"),
    ({"x": {"y": 1}}, "parameter 'x' must be a string, number or boolean"),
    ({"priority": 2**64}, "parameter 'priority' must be an integer from 0 to 2^64-1"),
    ({"priority": -1}, "parameter 'priority' must be an integer from 0 to 2^64-1"),
    ({"priority": 1.5}, "parameter 'priority' must be an integer from 0 to 2^64-1"),
    ({"timeout": 2**70}, "parameter 'timeout' must be an integer from 0 to 2^64-1"),
    ({"timeout": True}, "parameter 'timeout' must be an integer from 0 to 2^64-1"),
    ({"sequence_id": 2**64}, "parameter 'sequence_id' must be an integer from 0 to 2^64-1"),
    ({"sequence_start": 1}, "parameter 'sequence_start' must be a boolean"),
])
def test_parameters_outside_64_bits_are_a_400_naming_the_parameter(client: httpx.Client,
                                                                     params: dict[str, Any], needle: str) -> None:
    assert needle in error_of(infer(client, "echo_params", echo(params)), 400)


def test_parameters_within_64_bits_reach_the_model(client: httpx.Client) -> None:
    params = {"big": 2**63 - 1, "small": -(2**63), "f": 1.5, "b": True, "s": "text", "priority": 2**64 - 1,
              "timeout": 2**64 - 1}
    r = infer(client, "echo_params", echo(params))
    assert r.status_code == 200, r.text
    # echo_params answers the model's parameters back; floats come back as strings (Triton's types).
    assert strict_json(r.content)["parameters"] == {"big": 2**63 - 1, "small": -(2**63), "f": "1.5", "b": True,
                                                     "s": "text"}


def test_shape_dims_outside_64_bits(client: httpx.Client) -> None:
    doc = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2**64], "data": []}]}
    assert "at most 2^63-1" in error_of(infer(client, "doubler", doc), 400)


def test_integer_data_outside_the_datatype(client: httpx.Client) -> None:
    for value in (2**31, -(2**31) - 1, 2**70):
        doc = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [value]}]}
        message = error_of(infer(client, "echo_params", doc), 400)
        assert "input 'IN': 'data' holds a value outside the range of INT32" in message
        assert "-2147483648 to 2147483647" in message and "Python" not in message


# --- 2. outputs JSON cannot carry ---------------------------------------------------------------------------


def test_ordinary_outputs_are_strict_json(client: httpx.Client) -> None:
    r = infer(client, "data_edges", case(0))
    assert r.status_code == 200, r.text
    _, outputs = response_outputs(r.headers, r.content)
    for name in ("F16", "F32", "F64", "BF"):
        assert outputs[name].tolist() == [1.5, -2.0, 0.25, 3.0], name
    assert outputs["TXT"].tolist() == [b"plain", "é".encode(), b""]


@pytest.mark.parametrize("how", ["default", "listed", "binary_data_output false"])
def test_non_finite_outputs_as_json_are_a_400_asking_for_binary(client: httpx.Client, how: str) -> None:
    doc = {"default": case(1), "listed": case(1, [{"name": "F32"}]),
           "binary_data_output false": case(1, binary=False)}[how]
    message = error_of(infer(client, "data_edges", doc), 400)
    assert "holds NaN or infinity, which JSON cannot represent" in message
    assert '"binary_data": true' in message


@pytest.mark.parametrize("name", ["F16", "F32", "F64", "BF"])
def test_each_float_type_is_checked(client: httpx.Client, name: str) -> None:
    message = error_of(infer(client, "data_edges", case(1, [{"name": name}])), 400)
    assert f"output '{name}' holds NaN or infinity" in message


def test_an_output_not_asked_for_as_json_does_not_matter(client: httpx.Client) -> None:
    r = infer(client, "data_edges", case(1, [{"name": "TXT"}, {"name": "F32", "parameters": {"binary_data": True}}]))
    assert r.status_code == 200, r.text
    doc, outputs = response_outputs(r.headers, r.content)
    assert sorted(o["name"] for o in doc["outputs"]) == ["F32", "TXT"]
    np.testing.assert_array_equal(outputs["F32"], np.array(NON_FINITE, np.float32))


def test_non_finite_outputs_as_binary_carry_the_exact_bits(gateway: str) -> None:
    c = http.InferenceServerClient(gateway.removeprefix("http://"))
    x = http.InferInput("CASE", [1], "INT32")
    x.set_data_from_numpy(np.array([1], np.int32))
    names = ["F16", "F32", "F64", "BF"]
    result = c.infer("data_edges", [x], outputs=[http.InferRequestedOutput(n, binary_data=True) for n in names])
    for name, dtype in zip(names, (np.float16, np.float32, np.float64, np.float32), strict=True):
        got = result.as_numpy(name)
        assert got is not None
        np.testing.assert_array_equal(got.astype(np.float64), np.array(NON_FINITE, dtype).astype(np.float64))
    # Byte for byte, as the model's arrays encode: BF16 is float32 rounded (NaN a quiet NaN).
    r = httpx.post(f"{gateway}/v2/models/data_edges/infer", content=json.dumps(case(1, binary=True)).encode())
    assert r.status_code == 200, r.text
    header = int(r.headers["inference-header-content-length"])
    tail = r.content[header:]
    expected = b"".join([np.array(NON_FINITE, np.float16).tobytes(), np.array(NON_FINITE, np.float32).tobytes(),
                         np.array(NON_FINITE, np.float64).tobytes(),
                         tensors.to_bytes(np.array(NON_FINITE, np.float32), BY_NAME["BF16"]),
                         tensors.to_bytes(np.array([b"plain", "é".encode(), b""], dtype=object), BY_NAME["BYTES"])])
    assert tail == expected
    c.close()


def test_bytes_that_are_not_utf8_as_json_are_a_400_asking_for_binary(client: httpx.Client) -> None:
    message = error_of(infer(client, "data_edges", case(2, [{"name": "TXT"}])), 400)
    assert "output 'TXT': element 1 is not UTF-8 text" in message and '"binary_data": true' in message


def test_bytes_that_are_not_utf8_as_binary_are_unaltered(gateway: str) -> None:
    c = http.InferenceServerClient(gateway.removeprefix("http://"))
    x = http.InferInput("CASE", [1], "INT32")
    x.set_data_from_numpy(np.array([2], np.int32))
    result = c.infer("data_edges", [x], outputs=[http.InferRequestedOutput("TXT", binary_data=True)])
    got = result.as_numpy("TXT")
    assert got is not None and got.tolist() == NOT_UTF8
    c.close()


def test_a_nan_response_parameter_is_a_500_in_valid_json(client: httpx.Client) -> None:
    message = error_of(infer(client, "data_edges", case(4, [{"name": "F32"}])), 500)
    assert "response parameter to NaN or infinity" in message


# --- 3. the body's text encoding ----------------------------------------------------------------------------


ADD_SUB = {"inputs": [{"name": n, "datatype": "FP32", "shape": [4], "data": [1.0, 2.0, 3.0, 4.0]}
                      for n in ("INPUT0", "INPUT1")]}


@pytest.mark.parametrize("encoding,needle", [
    ("utf-16", "it is UTF-16 text (byte order mark)"),  # Python writes a BOM for "utf-16"
    ("utf-16-le", "looks like UTF-16 or UTF-32"), ("utf-16-be", "looks like UTF-16 or UTF-32"),
    ("utf-32", "it is UTF-32 text (byte order mark)"),
    ("utf-32-le", "looks like UTF-16 or UTF-32"), ("utf-32-be", "looks like UTF-16 or UTF-32"),
    ("utf-8-sig", "starts with a UTF-8 byte order mark"),
])
def test_bodies_that_are_not_plain_utf8_are_a_400(client: httpx.Client, encoding: str, needle: str) -> None:
    r = infer(client, "add_sub", content=json.dumps(ADD_SUB).encode(encoding))
    message = error_of(r, 400)
    assert message.startswith("failed to parse the request JSON buffer") and needle in message


def test_a_utf8_body_is_served(client: httpx.Client) -> None:
    r = infer(client, "add_sub", ADD_SUB)
    assert r.status_code == 200, r.text
    assert strict_json(r.content)["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


# --- 4. data nesting, binary_data, duplicate outputs ---------------------------------------------------------


def add_sub(data: Any, shape: list[int] | None = None) -> dict[str, Any]:
    return {"inputs": [{"name": n, "datatype": "FP32", "shape": shape or [4], "data": data}
                       for n in ("INPUT0", "INPUT1")]}


@pytest.mark.parametrize("data", [[[1, 2, 3], [4]], [[1, 2], [3, 4]], [[1, 2, 3, 4]], [1, 2, [3], 4], [[[1, 2, 3, 4]]]])
def test_ragged_or_misnested_data_is_a_400(client: httpx.Client, data: Any) -> None:
    message = error_of(infer(client, "add_sub", add_sub(data)), 400)
    assert "'data' must be a flat list of 4 elements or nested exactly as its shape [4]" in message


def test_data_nested_exactly_as_the_shape_or_flat_is_served(client: httpx.Client) -> None:
    for data in ([[1.0, 2.0], [3.0, 4.0]], [1.0, 2.0, 3.0, 4.0]):
        r = infer(client, "doubler", {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 2], "data": data}]})
        assert r.status_code == 200, r.text
        out = strict_json(r.content)["outputs"][0]
        assert out["shape"] == [2, 2] and out["data"] == [2.0, 4.0, 6.0, 8.0]
    r = infer(client, "doubler", {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 2],
                                              "data": [[1.0, 2.0, 3.0], [4.0]]}]})
    assert "nested exactly as its shape [2, 2]" in error_of(r, 400)


@pytest.mark.parametrize("value", ["yes", "true", 1, None, [True]])
def test_binary_data_must_be_a_boolean_for_an_output_too(client: httpx.Client, value: Any) -> None:
    doc = {**add_sub([1, 2, 3, 4]), "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": value}}]}
    assert "output 'OUTPUT0': parameter 'binary_data' must be a boolean" in error_of(infer(client, "add_sub", doc), 400)
    doc = {**add_sub([1, 2, 3, 4]), "parameters": {"binary_data_output": value}}
    assert "parameter 'binary_data_output' must be a boolean" in error_of(infer(client, "add_sub", doc), 400)


def test_an_output_requested_twice_is_a_400_naming_it(client: httpx.Client) -> None:
    doc = {**add_sub([1, 2, 3, 4]), "outputs": [{"name": "OUTPUT1"}, {"name": "OUTPUT0"},
                                                {"name": "OUTPUT1", "parameters": {"binary_data": True}}]}
    assert "output 'OUTPUT1' is requested more than once" in error_of(infer(client, "add_sub", doc), 400)


def test_an_empty_outputs_list_means_every_output(client: httpx.Client) -> None:
    r = infer(client, "add_sub", {**add_sub([1, 2, 3, 4]), "outputs": []})
    assert r.status_code == 200, r.text
    assert [o["name"] for o in strict_json(r.content)["outputs"]] == ["OUTPUT0", "OUTPUT1"]


# --- 5. messages that say what the client sent wrong --------------------------------------------------------


def test_messages_name_the_client_mistake(client: httpx.Client) -> None:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 16], "data": ["\ud800"] + ["1"] * 15},
                      {"name": "INPUT1", "datatype": "BYTES", "shape": [1, 16], "data": ["1"] * 16}]}
    body = json.dumps(doc).encode()  # ensure_ascii: the lone surrogate travels as the escape \ud800
    message = error_of(infer(client, "simple_string", content=body), 400)
    assert "input 'INPUT0': element 0 of 'data' holds a lone surrogate" in message and "codec" not in message

    header = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1],
                                     "parameters": {"binary_data_size": True}}]}).encode()
    r = infer(client, "doubler", content=header + struct.pack("<f", 1.0),
              headers={"Inference-Header-Content-Length": str(len(header))})
    message = error_of(r, 400)
    assert "binary_data_size must be a non-negative integer" in message and "True" not in message

    for body in (b"[]", b'{"ready": "no"}', b"\xff"):
        message = error_of(client.post("/v2/repository/index", content=body), 400)
        assert "object has no attribute" not in message and "codec" not in message, message

    digits = b"1" + b"0" * 5000
    r = infer(client, "doubler", content=b'{"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], '
                                         b'"data": [' + digits + b"]}]}")
    message = error_of(r, 400)
    assert "an integer has more than 4300 digits" in message and "sys." not in message

    r = infer(client, "doubler", content=b"not gzip at all", headers={"Content-Encoding": "gzip"})
    message = error_of(r, 400)
    assert "not a valid gzip stream" in message and "Error -3" not in message

    wrong = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1.0, "2"]}]}
    message = error_of(infer(client, "doubler", wrong), 400)
    assert "element 1 of 'data' is a string; FP32 elements are JSON numbers" in message


def test_gzip_bodies_still_work(client: httpx.Client) -> None:
    r = infer(client, "add_sub", content=gzip.compress(json.dumps(ADD_SUB).encode()),
              headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text


# --- 6. backend errors that are the client's -----------------------------------------------------------------


def simple_string(first: str) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 16], "data": [first] + ["1"] * 15},
                       {"name": "INPUT1", "datatype": "BYTES", "shape": [1, 16], "data": ["2"] * 16}]}


def test_onnxruntime_invalid_argument_is_a_400(client: httpx.Client) -> None:
    """onnxruntime's INVALID_ARGUMENT is its verdict on the data it was given: a 400 with its reason."""
    doc = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 8], "data": [1] * 8} for n in ("INPUT0", "INPUT1")]}
    message = error_of(infer(client, "simple_loose", doc), 400)
    assert "model 'simple_loose' (onnxruntime) refused the request's data" in message
    assert "Got invalid dimensions" in message
    doc = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                      for n in ("INPUT0", "INPUT1")]}
    assert infer(client, "simple_loose", doc).status_code == 200


def test_simple_string_given_text_it_cannot_parse_is_a_400(client: httpx.Client) -> None:
    """simple_string casts its strings to integers; for "a" onnxruntime raises RUNTIME_EXCEPTION from its
    Cast node ("stoll"). A Cast over string data fails only on text it cannot parse: the client's data,
    a 400 that says so (Triton's onnxruntime backend answers 500 with the bare onnxruntime message)."""
    message = error_of(infer(client, "simple_string", simple_string("a")), 400)
    assert "could not convert its string input to a number" in message and "stoll" in message
    r = infer(client, "simple_string", simple_string("5"))
    assert r.status_code == 200 and strict_json(r.content)["outputs"][0]["data"][0] == "7"


def test_a_bad_request_fails_alone_in_its_onnxruntime_batch(client: httpx.Client) -> None:
    """The batcher puts both requests into one run (it waits 300 ms); the run fails on the bad one, so
    each runs again alone: the good one is answered, only the bad one gets the error."""
    path = "/v2/models/simple_string_batched/infer"
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(infer, client, "", simple_string("5"), path=path)
        bad = pool.submit(infer, client, "", simple_string("a"), path=path)
        assert good.result().status_code == 200, good.result().text
        assert "stoll" in error_of(bad.result(), 400)


def test_python_backend_invalid_arg_is_a_400(gateway: str) -> None:
    c = http.InferenceServerClient(gateway.removeprefix("http://"))
    x = http.InferInput("CASE", [1], "INT32")
    x.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException) as err:
        c.infer("data_edges", [x])
    assert err.value.status() == "400" and "CASE 3 is refused on purpose" in str(err.value.message())
    c.close()


# --- 7. the version in the URL -------------------------------------------------------------------------------


EMPTY = "the model version in the URL is empty"


@pytest.mark.parametrize("method,suffix", [("POST", "/infer"), ("GET", ""), ("GET", "/config"), ("GET", "/ready"),
                                           ("GET", "/stats")])
def test_an_empty_version_is_a_404_on_every_route(client: httpx.Client, method: str, suffix: str) -> None:
    content = json.dumps(add_sub([1, 2, 3, 4])).encode() if method == "POST" else None
    r = client.request(method, f"/v2/models/add_sub/versions/{suffix}", content=content)
    assert EMPTY in error_of(r, 404)
    for version in ("abc", "%C2%B2", "-1"):  # "²" is a digit to str.isdigit(), not to Triton
        r = client.request(method, f"/v2/models/add_sub/versions/{version}{suffix}", content=content)
        assert "Request for unknown model: 'add_sub' version" in error_of(r, 404)
    r = client.request(method, f"/v2/models/add_sub/versions/1{suffix}", content=content)
    assert r.status_code == 200, r.text


# --- raw binary requests ----------------------------------------------------------------------------------


def test_a_raw_binary_request_is_its_one_inputs_bytes(client: httpx.Client) -> None:
    """Inference-Header-Content-Length: 0 (Triton's binary tensor data extension): the body is the model's one
    input, batch 1, its variable dim told by the byte count; every output comes back binary."""
    x = np.array([1.5, -2.0, 3.25], np.float32)
    r = infer(client, "doubler", content=x.tobytes(), headers={"Inference-Header-Content-Length": "0"})
    assert r.status_code == 200, r.text
    header = int(r.headers["inference-header-content-length"])
    doc = strict_json(r.content[:header])
    (out,) = doc["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("OUT", "FP32", [1, 3])
    assert out["parameters"]["binary_data_size"] == 12 and "data" not in out
    np.testing.assert_array_equal(np.frombuffer(r.content[header:], np.float32), x * 2)


@pytest.mark.parametrize("model,body,needle", [
    ("add_sub", b"\0" * 32, "raw binary requests are for models of one input; it has 2"),
    ("doubler", b"\0" * 13, "13 bytes are no whole number of FP32 elements"),
    ("echo_params", b"\0" * 8, "unexpected total byte size 8 for input 'IN', expecting 4"),  # INT32 [1]
])
def test_a_raw_binary_request_a_model_cannot_take_is_a_400(client: httpx.Client, model: str, body: bytes,
                                                          needle: str) -> None:
    r = infer(client, model, content=body, headers={"Inference-Header-Content-Length": "0"})
    assert needle in error_of(r, 400)
