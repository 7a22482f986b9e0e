"""Fuzzing the gateway's infer path in process: hypothesis over JSON bodies and Triton's binary framing,
plus a deterministic case for each kind of malformed input.

The system (gateway app + a real worker, real Redis) runs on its own event loop in a thread for the
whole module, so hypothesis can drive it from plain synchronous tests, one request at a time. Each answer
must be a success or a client error carrying `{"error": "<message>"}`, never a 5xx; a request answered
with an error must not have been queued for a worker (the model streams' entries-added is unchanged),
except an output JSON cannot carry (NaN, infinity: the client is told to ask for it as binary), which
is only known once computed. Every success is checked value by value against what the model computes
from the inputs the request sent (doubler: 2x, simple_identity: the same bytes, add_sub: sum and
difference), read back with a strict JSON parser.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fleet import tensors
from fleet.keys import Keys
from fleet.redis_server import LocalServer
from tests.support.infer_bodies import request_inputs, response_outputs
from tests.support.system import InProcessSystem, in_process_system

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"doubler": ROOT / "tests" / "models" / "doubler",  # FP32 [-1], batching (8)
           "simple_identity": ROOT / "model_repository" / "simple_identity",  # BYTES [-1], batching (8)
           "add_sub": ROOT / "model_repository" / "add_sub"}  # two FP32 [4] inputs, no batching
MODELS = tuple(SOURCES)
RAW_INPUTS = {"doubler": ("IN", "FP32"), "simple_identity": ("INPUT0", "BYTES")}  # the one-input models
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES"]
# 501 is fleet's documented answer for Triton features it does not implement (a few shared-memory forms);
# every other 5xx is a bug.
ALLOWED = {200, 400, 404, 501}
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

T = TypeVar("T")


class LiveSystem:
    """in_process_system on a private event loop thread; synchronous calls for hypothesis tests."""

    def __init__(self, redis_url: str, repo: Path) -> None:
        self.prefix = f"fz{uuid.uuid4().hex[:8]}"
        self.keys = Keys(self.prefix)
        self.redis = redis.Redis.from_url(redis_url, protocol=2)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fuzz-system", daemon=True)
        self._thread.start()
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[InProcessSystem] = self._loop.create_future()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(redis_url, repo), self._loop)
        self.system = asyncio.run_coroutine_threadsafe(self._wait_ready(), self._loop).result(120)

    async def _serve(self, redis_url: str, repo: Path) -> None:
        try:
            # Fuzzed uploads and job outputs land next to the repository, never in the working tree.
            jobs_dir = repo.parent / f"{repo.name}-jobs"
            async with in_process_system(redis_url, self.prefix, [repo], jobs_dir=jobs_dir) as system:
                self._ready.set_result(system)
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    async def _wait_ready(self) -> InProcessSystem:
        return await self._ready

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.run(self.system.client.post(path, **kwargs))

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self.run(self.system.client.request(method, url, **kwargs))

    def queued(self) -> int:
        """Requests ever added to any model stream of this system (entries-added survives trimming)."""
        total = 0
        lanes_of_every_model = self.keys.queue("*", 0, version=1).removesuffix("0") + "*"
        for key in self.redis.scan_iter(match=lanes_of_every_model):
            total += int(self.redis.xinfo_stream(key)["entries-added"])
        return total

    def left_over(self) -> dict[str, tuple[int, int]]:
        """Every model stream of this system still holding entries, or entries read but not acknowledged:
        {stream: (length, pending)}."""
        left = {}
        lanes_of_every_model = self.keys.queue("*", 0, version=1).removesuffix("0") + "*"
        for key in self.redis.scan_iter(match=lanes_of_every_model):
            length = int(self.redis.xlen(key))
            pending = sum(int(g["pending"]) for g in self.redis.xinfo_groups(key))
            if length or pending:
                left[key.decode()] = (length, pending)
        return left

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        try:
            self._main.result(60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self.redis.close()


@pytest.fixture(scope="module")
def live(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSystem]:
    repo = tmp_path_factory.mktemp("fuzz-repo")
    for name, src in SOURCES.items():
        shutil.copytree(src, repo / name)
    system = LiveSystem(redis_server.url, repo)
    try:
        yield system
    finally:
        system.close()


def check(live: LiveSystem, response: httpx.Response, queued_before: int) -> None:
    """The invariants every fuzzed request must keep."""
    status = response.status_code
    assert status in ALLOWED, f"{status}: {response.text[:500]}"
    if status != 200:
        doc = response.json()
        assert isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"].strip(), doc
        computed_but_not_json = status == 400 and "request it as binary data" in doc["error"]
        assert computed_but_not_json or live.queued() == queued_before, \
            f"a request answered {status} reached a worker: {doc}"


def expected_outputs(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What each test model computes, from the inputs as sent (numpy float32 arithmetic, as the models)."""
    if model == "doubler":
        return {"OUT": (inputs["IN"].astype(np.float32) * 2).astype(np.float32)}
    if model == "add_sub":
        a, b = inputs["INPUT0"].astype(np.float32), inputs["INPUT1"].astype(np.float32)
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
    return {"OUTPUT0": inputs["INPUT0"]}


def check_values(model: str, content: bytes, headers: dict[str, str], response: httpx.Response) -> None:
    """A 200 answers exactly what the model computes from the request's own inputs: every output asked
    for (all when none is listed), with its shape and values, and the request id echoed."""
    if headers.get("Inference-Header-Content-Length") == "0":  # raw binary: the body is the one input, batch 1
        name, datatype = RAW_INPUTS[model]
        dt = tensors.lookup(datatype)
        rows = (1, 1) if datatype == "BYTES" else (1, len(content) // dt.itemsize)
        request, inputs = {}, {name: tensors.from_bytes(content, dt, rows)}
    else:
        request, inputs = request_inputs(content, headers.get("Inference-Header-Content-Length"))
    doc, outputs = response_outputs(response.headers, response.content)
    want = expected_outputs(model, inputs)
    listed = [o["name"] for o in request.get("outputs") or []]
    assert sorted(outputs) == sorted(listed or want), (listed, list(outputs))
    for name, got in outputs.items():
        assert got.shape == want[name].shape and got.dtype.kind == want[name].dtype.kind, (name, got, want[name])
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    assert doc["model_name"] == model and doc["model_version"] == "1"
    assert doc.get("id", "") == request.get("id", "")


def post_infer(live: LiveSystem, model: str, content: bytes, headers: dict[str, str] | None = None
               ) -> httpx.Response:
    before = live.queued()
    r = live.post(f"/v2/models/{model}/infer", content=content,
                  headers={"content-type": "application/json", **(headers or {})})
    check(live, r, before)
    if r.status_code == 200:
        check_values(model, content, headers or {}, r)
    return r


def assert_bad(live: LiveSystem, model: str, content: bytes, needle: str,
               headers: dict[str, str] | None = None) -> None:
    r = post_infer(live, model, content, headers)
    assert r.status_code == 400, r.text
    assert needle.lower() in r.json()["error"].lower(), r.json()


# --- strategies ------------------------------------------------------------------------------------------

# Text includes lone surrogates: JSON can spell them (\\ud800), UTF-8 cannot.
texts = st.one_of(st.text(max_size=20), st.text(st.characters(codec=None, categories=["Cs", "Lu"]), max_size=3))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.floats(min_value=1e38, max_value=1e308), texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)), max_leaves=30)


@st.composite
def valid_input(draw: st.DrawFn, model: str) -> list[dict[str, Any]]:
    """A request body's `inputs` that the model accepts."""
    if model == "add_sub":
        return [{"name": n, "datatype": "FP32", "shape": [4],
                 "data": draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=4, max_size=4))}
                for n in ("INPUT0", "INPUT1")]
    rows, cols = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    if model == "doubler":
        data: list[Any] = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=rows * cols,
                                        max_size=rows * cols))
        return [{"name": "IN", "datatype": "FP32", "shape": [rows, cols], "data": data}]
    data = draw(st.lists(st.text(max_size=10), min_size=rows * cols, max_size=rows * cols))
    return [{"name": "INPUT0", "datatype": "BYTES", "shape": [rows, cols], "data": data}]


@st.composite
def mutated_body(draw: st.DrawFn, model: str) -> dict[str, Any]:
    """A valid body with a few fields broken: wrong types, shapes, datatypes, names, nested garbage."""
    doc: dict[str, Any] = {"inputs": draw(valid_input(model))}
    for _ in range(draw(st.integers(0, 3))):
        target = doc["inputs"][draw(st.integers(0, len(doc["inputs"]) - 1))]
        field = draw(st.sampled_from(["name", "datatype", "shape", "data", "parameters", "extra"]))
        target[field] = draw(st.one_of(
            json_values,
            st.sampled_from(DATATYPES + ["FP128", "", "fp32", "STRING"]),
            st.lists(st.integers(-3, 2**64), max_size=4),
            st.just({"binary_data_size": draw(st.integers(-1, 64))}),
        ))
    for key in draw(st.lists(st.sampled_from(["id", "parameters", "outputs", "inputs", "junk"]), max_size=2)):
        doc[key] = draw(st.one_of(
            json_values, texts,
            st.dictionaries(st.one_of(st.sampled_from(["priority", "timeout", "binary_data_output", "custom",
                                                       "sequence_id", "triton_x", "shared_memory_region"]), texts),
                            json_values, max_size=3),
            st.lists(st.fixed_dictionaries({"name": st.text(max_size=10)},
                                            optional={"parameters": json_values}), max_size=3),
        ))
    return doc


@st.composite
def nearly_valid_body(draw: st.DrawFn, model: str) -> dict[str, Any]:
    """A valid body with odd values where the structure is right: ids and parameters with any text
    (lone surrogates), data elements of any JSON scalar (huge, NaN, of the wrong type)."""
    doc: dict[str, Any] = {"inputs": draw(valid_input(model))}
    if draw(st.booleans()):
        doc["id"] = draw(texts)
    if draw(st.booleans()):
        doc["parameters"] = draw(st.dictionaries(texts, scalars, max_size=3))
    if draw(st.booleans()):
        data = doc["inputs"][0]["data"]
        data[draw(st.integers(0, len(data) - 1))] = draw(scalars)
    return doc


def encode(doc: Any) -> bytes:
    # allow_nan: NaN / Infinity tokens are not JSON; the gateway must refuse them, so they are sent too.
    return json.dumps(doc, allow_nan=True).encode("utf-8", errors="surrogatepass")


# --- hypothesis ------------------------------------------------------------------------------------------


@FUZZ
@given(model=st.sampled_from(MODELS), data=st.data())
def test_fuzzed_json_bodies(live: LiveSystem, model: str, data: st.DataObject) -> None:
    doc = data.draw(st.one_of(mutated_body(model), nearly_valid_body(model)))
    r = post_infer(live, model, encode(doc))
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how much got past validation


@FUZZ
@given(model=st.sampled_from(MODELS), data=st.data())
def test_valid_json_bodies_are_served(live: LiveSystem, model: str, data: st.DataObject) -> None:
    inputs = data.draw(valid_input(model))
    r = post_infer(live, model, encode({"id": data.draw(st.text(max_size=30)), "inputs": inputs}))
    assert r.status_code == 200, r.text


@FUZZ
@given(model=st.sampled_from(MODELS), body=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_arbitrary_bytes(live: LiveSystem, model: str, body: bytes) -> None:
    r = post_infer(live, model, body)
    assert r.status_code == 400, r.text


def _bytes_elements(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


@st.composite
def binary_request(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """(model, body, headers): a JSON header with binary_data_size inputs and a binary tail, each possibly
    broken: the declared sizes, the tail, the BYTES length prefixes, Inference-Header-Content-Length."""
    model = draw(st.sampled_from(["doubler", "simple_identity"]))
    rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    if model == "doubler":
        tail = struct.pack(f"<{rows * cols}f", *draw(st.lists(st.floats(-10, 10, width=32),
                                                                min_size=rows * cols, max_size=rows * cols)))
        datatype, name = "FP32", "IN"
    else:
        items = draw(st.lists(st.binary(max_size=8), min_size=rows * cols, max_size=rows * cols))
        tail = _bytes_elements(items)
        if draw(st.booleans()) and tail:  # overwrite one length prefix with anything
            at = draw(st.integers(0, len(items) - 1))
            pos = sum(4 + len(b) for b in items[:at])
            tail = tail[:pos] + struct.pack("<I", draw(st.integers(0, 2**32 - 1))) + tail[pos + 4:]
        datatype, name = "BYTES", "INPUT0"
    size = len(tail)
    if draw(st.booleans()):
        size = draw(st.integers(-2, len(tail) + 8))
    if draw(st.booleans()):
        tail = draw(st.one_of(st.just(tail[: len(tail) // 2]), st.binary(max_size=40), st.just(tail + b"\0")))
    header = json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": [rows, cols],
                                     "parameters": {"binary_data_size": size}}],
                         "outputs": [{"name": "OUT" if model == "doubler" else "OUTPUT0",
                                      "parameters": {"binary_data": draw(st.booleans())}}]}).encode()
    length: str = str(len(header))
    if draw(st.booleans()):
        length = draw(st.one_of(st.integers(-5, len(header) + len(tail) + 5).map(str),
                                st.sampled_from(["", "abc", "1e3", " 12 ", "0x10", str(2**70)])))
    return model, header + tail, {"Inference-Header-Content-Length": length}


@FUZZ
@given(request=binary_request())
def test_fuzzed_binary_framing(live: LiveSystem, request: tuple[str, bytes, dict[str, str]]) -> None:
    model, body, headers = request
    r = post_infer(live, model, body, headers)
    event(f"HTTP {r.status_code}")


# --- deterministic malformed inputs ---------------------------------------------------------------------


def fp32(data: Any, shape: list[int] | None = None, **extra: Any) -> bytes:
    return encode({"inputs": [{"name": "IN", "datatype": "FP32", "shape": shape or [1, 1], "data": data}],
                   **extra})


def test_bytes_length_prefix_overruns_the_buffer(live: LiveSystem) -> None:
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 2],
                                     "parameters": {"binary_data_size": 12}}]}).encode()
    tail = struct.pack("<I", 3) + b"abc" + struct.pack("<I", 1000) + b"x"  # the second element says 1000
    assert_bad(live, "simple_identity", header + tail, "runs past the end",
               {"Inference-Header-Content-Length": str(len(header))})
    truncated = struct.pack("<I", 1) + b"a" + b"\x01\x00"  # half a length prefix
    header = header.replace(b"12", str(len(truncated)).encode())
    assert_bad(live, "simple_identity", header + truncated, "truncated length prefix",
               {"Inference-Header-Content-Length": str(len(header))})


@pytest.mark.parametrize(("length", "needle"), [
    ("100000", "outside the body"), ("-1", "outside the body"), ("abc", "invalid inference-header-content-length"),
    ("10", "failed to parse the request json"), (str(2**80), "outside the body"),
])
def test_wrong_inference_header_content_length(live: LiveSystem, length: str, needle: str) -> None:
    header = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1],
                                     "parameters": {"binary_data_size": 4}}]}).encode()
    assert_bad(live, "doubler", header + struct.pack("<f", 1.0), needle, {"Inference-Header-Content-Length": length})


def test_header_length_that_leaves_binary_data_over(live: LiveSystem) -> None:
    body = fp32([1.0])
    assert_bad(live, "doubler", body + b"\0\0\0\0", "unexpected additional input data",
               {"Inference-Header-Content-Length": str(len(body))})


def test_non_utf8_json(live: LiveSystem) -> None:
    assert_bad(live, "doubler", b'{"id": "\xff\xfe", "inputs": []}', "failed to parse the request json")
    assert_bad(live, "doubler", fp32([1.0]).replace(b'"IN"', b'"I\xc3"'), "failed to parse the request json")


def test_deeply_nested_json(live: LiveSystem) -> None:
    assert_bad(live, "doubler", b"[" * 100_000 + b"]" * 100_000, "nested too deeply")
    assert_bad(live, "doubler", b'{"id": "a", "inputs": ' + b"[" * 100_000, "failed to parse the request json")
    for depth in (500, 900, 950, 980, 990, 995, 1000, 1100, 5000):  # around the interpreter's recursion limit
        nested = b"[" * depth + b"1.0, 2.0" + b"]" * depth  # two elements for a [1, 1] tensor
        r = post_infer(live, "doubler", fp32([0.0]).replace(b"[0.0]", nested))
        assert r.status_code == 400, r.text
    assert_bad(live, "doubler", fp32([[1.0]], shape=[1] + [1] * 499), "unexpected shape")
    deep = json.loads("[" * 300 + "]" * 300)
    assert_bad(live, "doubler", fp32([1.0], parameters={"custom": deep}), "must be a string, number or boolean")


@pytest.mark.parametrize("datatype", ["FP128", "fp32", "", "STRING", "TYPE_FP32"])
def test_unknown_datatypes(live: LiveSystem, datatype: str) -> None:
    body = encode({"inputs": [{"name": "IN", "datatype": datatype, "shape": [1, 1], "data": [1.0]}]})
    assert_bad(live, "doubler", body, f"data-type is '{datatype}'")


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_tokens(live: LiveSystem, token: bytes) -> None:
    assert_bad(live, "doubler", fp32([0.0]).replace(b"0.0", token), "is not valid json")


@pytest.mark.parametrize("number", [b"1e400", b"-1e400", b"1e39"])
def test_numbers_that_overflow_the_datatype(live: LiveSystem, number: bytes) -> None:
    # 1e400 is no finite double (Python's json makes it inf); 1e39 is a double but no finite FP32.
    assert_bad(live, "doubler", fp32([0.0]).replace(b"0.0", number), "finite")


def test_non_finite_parameters(live: LiveSystem) -> None:
    assert_bad(live, "doubler", fp32([1.0]).replace(b'"inputs"', b'"parameters": {"p": 1e400}, "inputs"'),
               "finite")


def test_huge_ids(live: LiveSystem) -> None:
    assert_bad(live, "doubler", fp32([1.0], id="x" * 1025), "longer than 1024")
    assert_bad(live, "doubler", fp32([1.0], id="x" * 5_000_000), "longer than 1024")
    assert_bad(live, "doubler", fp32([1.0], id=10**400), "must be a string")
    r = post_infer(live, "doubler", fp32([1.0], id="x" * 1024))
    assert r.status_code == 200 and r.json()["id"] == "x" * 1024


def test_lone_surrogates(live: LiveSystem) -> None:
    # Valid JSON escapes, but no UTF-8 text: they could not be forwarded to a worker.
    assert_bad(live, "doubler", fp32([1.0]).replace(b'"inputs"', b'"id": "\\ud800", "inputs"'), "utf-8")
    body = fp32([1.0]).replace(b'"inputs"', b'"parameters": {"k\\udfff": "v"}, "inputs"')
    assert_bad(live, "doubler", body, "utf-8")
    body = fp32([1.0]).replace(b'"inputs"', b'"parameters": {"k": "\\udfff"}, "inputs"')
    assert_bad(live, "doubler", body, "utf-8")
    body = encode({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": ["\ud800"]}]})
    assert_bad(live, "simple_identity", body, "element 0 of 'data' holds a lone surrogate")


def test_huge_shapes(live: LiveSystem) -> None:
    assert_bad(live, "doubler", fp32([1.0], shape=[1, 2**62]), "unexpected number of elements")
    assert_bad(live, "doubler", fp32([1.0], shape=[1, 10**30]), "at most 2^63-1")  # no int64: no Triton dim
    assert_bad(live, "doubler", fp32([1.0], shape=[2**40, 1]), "unexpected number of elements")
    assert_bad(live, "doubler", fp32([1.0], shape=[1, -1]), "non-negative integers")
    header = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2**62],
                                     "parameters": {"binary_data_size": 2**64}}]}).encode()
    assert_bad(live, "doubler", header + b"\0" * 4, "unexpected end of binary data",
               {"Inference-Header-Content-Length": str(len(header))})


def test_the_worker_still_serves_after_the_fuzzing(live: LiveSystem) -> None:
    r = post_infer(live, "doubler", fp32([[1.5, 2.0]], shape=[1, 2]))
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [3.0, 4.0]
    assert live.request("GET", "/v2/health/ready").status_code == 200
    # Every request the fuzzing got queued was answered and taken off its stream: nothing is left waiting
    # in Redis or held (read but not acknowledged) by the worker. The wait covers a reply read before its
    # XACK/XDEL, which ride on the worker's next write or go out 5 ms later (3 s: a loaded host).
    deadline = time.monotonic() + 3.0
    while (left := live.left_over()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.queued() > 0, "the fuzzing never reached a worker: this check would be vacuous"
    assert left == {}, f"left in the model streams (length, pending): {left}"


# --- schemathesis: the gateway's own OpenAPI document, and the KServe v2 REST spec ------------------------

# schemathesis is in the dev extra; without it these tests skip and the ones above still run.
needs_schemathesis = pytest.mark.skipif(importlib.util.find_spec("schemathesis") is None,
                                        reason="schemathesis is not installed (pip install -e '.[dev]')")
SCHEMA_FUZZ = settings(max_examples=15, deadline=None, database=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                              HealthCheck.filter_too_much])


def gateway_schema(pinned: bool) -> Any:
    """The gateway's own OpenAPI document (/openapi.json: the KServe v2 spec). `pinned`: names and
    versions are this system's models, so requests get past the model lookup into the body validation."""
    import schemathesis

    from fleet.settings import Settings
    from gateway.app import create_app

    doc = copy.deepcopy(create_app(Settings()).openapi())
    for item in doc["paths"].values():
        for param in item.get("parameters", []):
            if pinned and param["name"] == "MODEL_NAME":
                param["schema"] = {"type": "string", "enum": list(MODELS)}
            if pinned and param["name"] == "MODEL_VERSION":
                param["schema"] = {"type": "string", "enum": ["1", "2", "01"]}
    return schemathesis.openapi.from_dict(doc)


def operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def send_case(live: LiveSystem, case: Any) -> httpx.Response:
    kw = case.as_transport_kwargs(base_url=str(live.system.client.base_url).rstrip("/"))
    extra: dict[str, Any] = {}
    if "json" in kw:
        extra["json"] = kw["json"]
    elif isinstance(kw.get("data"), (bytes, str)):
        extra["content"] = kw["data"]
    elif kw.get("data") is not None:
        extra["data"] = kw["data"]
    before = live.queued()
    r = live.request(kw["method"], kw["url"], params=kw.get("params"), headers=kw.get("headers"), **extra)
    event(f"{case.operation.method.upper()} {case.operation.path}: HTTP {r.status_code}")
    assert r.status_code < 500 or r.status_code == 501, f"{case.operation.label}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        doc = r.json()
        assert isinstance(doc.get("error"), str) and doc["error"].strip(), doc
        if "/infer" in case.operation.path:
            assert live.queued() == before, f"an infer request answered {r.status_code} reached a worker"
    return r


def fuzz_operation(live: LiveSystem, operation: Any) -> None:
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategy = operation.as_strategy(generation_mode=mode)

        @SCHEMA_FUZZ
        @given(case=strategy)
        def run(case: Any) -> None:
            send_case(live, case)

        try:
            run()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # nothing to break in an operation without inputs


@needs_schemathesis
@pytest.mark.parametrize("pinned", [False, True], ids=["any-model", "served-models"])
def test_gateway_openapi_document(live: LiveSystem, pinned: bool) -> None:
    ops = operations(gateway_schema(pinned))
    assert len(ops) == 23  # KServe's 6 and fleet's extensions (Triton's and bulk jobs)
    for operation in ops:
        fuzz_operation(live, operation)


def test_the_gateway_serves_its_openapi_document(live: LiveSystem) -> None:
    r = live.request("GET", "/openapi.json")
    assert r.status_code == 200 and "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/infer" in r.json()["paths"]
