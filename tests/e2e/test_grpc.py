"""The running system (`fleet up`) over gRPC with Triton's own clients, unchanged: tritonclient.grpc
(sync, async_infer with callbacks, streaming) and tritonclient.grpc.aio, on every example model,
including Triton's example repository. What HTTP answers (tests/e2e/test_tritonclient.py), gRPC answers
too: the same metadata, config, statistics, values, and errors with Triton's gRPC status codes."""

from __future__ import annotations

import asyncio
import json
import queue
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from tests.e2e.conftest import RunningSystem
from tests.e2e.test_tritonclient import EXPECTED_MODELS, reference_mlp

pytestmark = pytest.mark.e2e
EVERY_MODEL = [*EXPECTED_MODELS, "simple_dyna_sequence", "simple_sequence"]


@pytest.fixture
def client(system: RunningSystem) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(system.grpc_url)
    yield c
    c.close()


def http_get(system: RunningSystem, path: str) -> Any:
    with urllib.request.urlopen(f"http://{system.url}{path}", timeout=30) as r:
        return json.loads(r.read())


def tensor(name: str, array: np.ndarray, datatype: str) -> tg.InferInput:
    i = tg.InferInput(name, list(array.shape), datatype)
    i.set_data_from_numpy(array)
    return i


def simple_inputs(a: np.ndarray, b: np.ndarray, datatype: str = "INT32") -> list[tg.InferInput]:
    return [tensor("INPUT0", a, datatype), tensor("INPUT1", b, datatype)]


def test_health_and_server_metadata(system: RunningSystem, client: tg.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    http = http_get(system, "/v2")
    assert (meta["name"], meta["version"], meta["extensions"]) == (http["name"], http["version"], http["extensions"])


@pytest.mark.parametrize("model", EVERY_MODEL)
def test_metadata_and_config_as_over_http(system: RunningSystem, client: tg.InferenceServerClient,
                                          model: str) -> None:
    assert client.is_model_ready(model)
    # The HTTP JSON is the proto's JSON form (fleet/config_json.py): the same message, field by field.
    config = client.get_model_config(model).config
    http_config = http_get(system, f"/v2/models/{model}/config")
    assert config == json_format.ParseDict(http_config, model_config_pb2.ModelConfig())
    meta = client.get_model_metadata(model)
    http = http_get(system, f"/v2/models/{model}")
    assert (meta.name, list(meta.versions), meta.platform) == (http["name"], http["versions"], http["platform"])
    for got, want in ((meta.inputs, http["inputs"]), (meta.outputs, http["outputs"])):
        assert [(t.name, t.datatype, list(t.shape)) for t in got] == [(t["name"], t["datatype"], t["shape"])
                                                                      for t in want]


def test_unknown_models_and_versions(client: tg.InferenceServerClient) -> None:
    assert not client.is_model_ready("nope") and not client.is_model_ready("simple", "9")
    for call in (lambda: client.get_model_metadata("nope"), lambda: client.get_model_config("nope"),
                 lambda: client.infer("nope", simple_inputs(np.zeros((1, 16), np.int32), np.zeros((1, 16), np.int32)))):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert (err.value.status(), err.value.message()) == \
            ("StatusCode.NOT_FOUND", "Request for unknown model: 'nope' is not found")
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("simple", "9")
    assert (err.value.status(), err.value.message()) == \
        ("StatusCode.NOT_FOUND", "Request for unknown model: 'simple' version 9 is not found")
    # Statistics answer both INVALID_ARGUMENT, in tritonserver 2.51's words.
    for (model, version), message in ((("nope", ""), "requested model 'nope' is not available"),
                                      (("simple", "9"), "requested model version is not available for model 'simple'")):
        with pytest.raises(InferenceServerException) as err:
            client.get_inference_statistics(model, version)
        assert (err.value.status(), err.value.message()) == ("StatusCode.INVALID_ARGUMENT", message)


def test_classes_over_grpc(client: tg.InferenceServerClient) -> None:
    a = np.array([[3, 9, -2, 9, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    r = client.infer("simple", simple_inputs(a, a), outputs=[tg.InferRequestedOutput("OUTPUT1", class_count=2)])
    assert r.as_numpy("OUTPUT1").tolist() == [[b"0:0", b"0:1"]]  # OUTPUT1 = a - a: every value 0, lowest index first


@pytest.mark.parametrize("model,dtype,npdt", [("simple", "INT32", np.int32), ("simple_int8", "INT8", np.int8)])
def test_triton_simple_models(client: tg.InferenceServerClient, model: str, dtype: str, npdt: type) -> None:
    a = np.arange(16, dtype=npdt).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=npdt)
    outputs = [tg.InferRequestedOutput("OUTPUT0"), tg.InferRequestedOutput("OUTPUT1")]
    r = client.infer(model, simple_inputs(a, b, dtype), outputs=outputs, request_id="req-1")
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    assert r.get_response().id == "req-1" and r.get_response().model_version == "1"


def test_string_tensors(client: tg.InferenceServerClient) -> None:
    a = np.array([[str(i) for i in range(16)]], dtype=object)
    b = np.array([["2"] * 16], dtype=object)
    r = client.infer("simple_string", simple_inputs(a, b, "BYTES"))
    assert [int(x) for x in r.as_numpy("OUTPUT0").reshape(-1)] == [i + 2 for i in range(16)]
    assert [int(x) for x in r.as_numpy("OUTPUT1").reshape(-1)] == [i - 2 for i in range(16)]
    s = np.array([["héllo".encode(), b"", b"x\x00y"]], dtype=object)
    assert client.infer("simple_identity", [tensor("INPUT0", s, "BYTES")]).as_numpy("OUTPUT0").tolist() == s.tolist()


def test_add_sub_mlp_and_minilm(client: tg.InferenceServerClient) -> None:
    x, y = np.array([1, 2, 3, 4], np.float32), np.array([0.5] * 4, np.float32)
    r = client.infer("add_sub", simple_inputs(x, y, "FP32"))
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), x + y)
    np.testing.assert_allclose(r.as_numpy("OUTPUT1"), x - y)
    m = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    out = client.infer("mlp", [tensor("INPUT0", m, "FP32")]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, reference_mlp(m), rtol=1e-4, atol=1e-5)
    texts = np.array([["A cat sits on the mat."], ["A kitten is sitting on a rug."], ["Stock prices fell."]],
                     dtype=object)
    emb = client.infer("minilm", [tensor("TEXT", texts, "BYTES")]).as_numpy("EMBEDDING")
    assert emb.shape == (3, 384) and emb[0] @ emb[1] > emb[0] @ emb[2] + 0.2


def test_async_infer_with_callbacks_is_batched(client: tg.InferenceServerClient) -> None:
    before = client.get_inference_statistics("mlp").model_stats[0]
    xs = np.random.default_rng(2).standard_normal((32, 1, 256)).astype(np.float32)
    answers: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    for i in range(32):
        client.async_infer("mlp", [tensor("INPUT0", xs[i], "FP32")], request_id=str(i),
                           callback=lambda result, error, i=i: answers.put((i, result, error)))
    got = sorted((answers.get(timeout=60) for _ in range(32)), key=lambda t: t[0])
    assert all(error is None for _, _, error in got)
    assert all(result.get_response().id == str(i) for i, result, _ in got)
    np.testing.assert_allclose(np.concatenate([r.as_numpy("OUTPUT0") for _, r, _ in got]), reference_mlp(xs[:, 0]),
                               rtol=1e-4, atol=1e-5)
    after = client.get_inference_statistics("mlp").model_stats[0]
    assert after.inference_count - before.inference_count == 32
    assert after.execution_count - before.execution_count < 32, "no batching over gRPC"


def test_grpc_aio_client(system: RunningSystem) -> None:
    async def main() -> list[np.ndarray]:
        client = tga.InferenceServerClient(system.grpc_url)
        try:
            assert await client.is_server_ready()
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            results = await asyncio.gather(*(client.infer("simple", simple_inputs(a + i, a)) for i in range(8)))
            return [r.as_numpy("OUTPUT0") for r in results]
        finally:
            await client.close()

    outs = asyncio.run(main())
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, 2 * a + i)


def test_streaming_with_many_requests_in_flight(client: tg.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    xs = np.random.default_rng(3).standard_normal((16, 1, 256)).astype(np.float32)
    client.start_stream(lambda result, error: answers.put((result, error)))
    try:
        for i in range(16):
            client.async_stream_infer("mlp", [tensor("INPUT0", xs[i], "FP32")], request_id=f"m{i}")
        client.async_stream_infer("simple", simple_inputs(np.zeros((1, 15), np.int32), np.zeros((1, 15), np.int32)),
                                  request_id="bad")
        got = [answers.get(timeout=60) for _ in range(17)]
        client.async_stream_infer("mlp", [tensor("INPUT0", xs[0], "FP32")], request_id="again")
        again, again_error = answers.get(timeout=60)
    finally:
        client.stop_stream()
    errors = [str(e) for _, e in got if e is not None]
    assert len(errors) == 1 and "unexpected shape for input 'INPUT0' for model 'simple'" in errors[0]
    by_id = {r.get_response().id: r.as_numpy("OUTPUT0") for r, e in got if e is None}
    assert sorted(by_id) == sorted(f"m{i}" for i in range(16))
    np.testing.assert_allclose(np.concatenate([by_id[f"m{i}"] for i in range(16)]), reference_mlp(xs[:, 0]),
                               rtol=1e-4, atol=1e-5)
    assert again_error is None and again.get_response().id == "again"
    # As tritonserver 2.51: a model that is not decoupled answers on a stream marked final, unasked.
    assert all(r.get_response().parameters["triton_final_response"].bool_param for r, e in got + [(again, None)]
               if e is None)


def test_statistics_as_over_http(system: RunningSystem, client: tg.InferenceServerClient) -> None:
    client.infer("simple", simple_inputs(np.zeros((1, 16), np.int32), np.zeros((1, 16), np.int32)))
    stats = client.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    http = http_get(system, "/v2/models/simple/stats")["model_stats"][0]
    assert (stats["name"], stats["version"]) == ("simple", "1")
    assert set(stats["inference_stats"]) == set(http["inference_stats"])
    assert int(stats["inference_stats"]["success"]["count"]) > 0
    every = client.get_inference_statistics().model_stats
    assert {s.name for s in every} >= set(EXPECTED_MODELS)


def zeros(shape: tuple[int, ...], datatype: str = "INT32") -> list[tg.InferInput]:
    a = np.zeros(shape, np.float32 if datatype == "FP32" else np.int32)
    return simple_inputs(a, a, datatype)


@pytest.mark.parametrize("kind,call,status,fragment", [
    ("bad shape", lambda c: c.infer("simple", zeros((1, 15))),
     "INVALID_ARGUMENT", "unexpected shape for input 'INPUT0' for model 'simple'"),
    ("bad datatype", lambda c: c.infer("simple", zeros((1, 16), "FP32")),
     "INVALID_ARGUMENT", "data-type is 'FP32', but model 'simple' expects 'INT32'"),
    ("batch too large", lambda c: c.infer("simple", zeros((9, 16))),
     "INVALID_ARGUMENT", "batch-size must be <= 8"),
    ("sequence model", lambda c: c.infer("simple_sequence", [tensor("INPUT", np.zeros((1, 1), np.int32), "INT32")]),
     "INVALID_ARGUMENT", "model 'simple_sequence' must specify a non-zero or non-empty correlation ID"),
    ("model control", lambda c: c.load_model("simple"), "PERMISSION_DENIED", "model control is disabled"),
    ("unknown output", lambda c: c.infer("simple", zeros((1, 16)), outputs=[tg.InferRequestedOutput("NOPE")]),
     "INVALID_ARGUMENT", "unexpected inference output 'NOPE' for model 'simple'"),
    ("no data", lambda c: c.infer("simple", [tg.InferInput("INPUT0", [1, 16], "INT32"),
                                             tg.InferInput("INPUT1", [1, 16], "INT32")]),
     "INVALID_ARGUMENT", "unable to find data for input tensor 'INPUT0' for model 'simple' in request."),
])
def test_errors_have_triton_s_codes(client: tg.InferenceServerClient, kind: str, call: Any, status: str,
                                    fragment: str) -> None:
    with pytest.raises(InferenceServerException) as err:
        call(client)
    assert err.value.status() == f"StatusCode.{status}", err.value.message()
    assert fragment in err.value.message()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client: tg.InferenceServerClient, algorithm: str) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    r = client.infer("simple", simple_inputs(a, a), compression_algorithm=algorithm)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + a)


def test_http_and_grpc_clients_together(system: RunningSystem) -> None:
    """Both protocols at once against one gateway process: each caller gets its own answer."""
    import tritonclient.http as http

    def over_grpc(i: int) -> bool:
        c = tg.InferenceServerClient(system.grpc_url)
        try:
            a = np.full((1, 16), i, np.int32)
            return bool((c.infer("simple", simple_inputs(a, a)).as_numpy("OUTPUT0") == 2 * i).all())
        finally:
            c.close()

    def over_http(i: int) -> bool:
        c = http.InferenceServerClient(system.url)
        a = np.full((1, 16), i, np.int32)
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            x = http.InferInput(name, [1, 16], "INT32")
            x.set_data_from_numpy(a)
            inputs.append(x)
        return bool((c.infer("simple", inputs).as_numpy("OUTPUT1") == 0).all())

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: over_grpc(i) if i % 2 else over_http(i), range(40)))
    assert all(results)
