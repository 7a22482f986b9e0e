"""The running system driven by Triton's own Python client, unchanged."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from tests.e2e.conftest import RunningSystem

pytestmark = pytest.mark.e2e


@pytest.fixture
def client(system: RunningSystem) -> http.InferenceServerClient:
    return http.InferenceServerClient(system.url, concurrency=16, network_timeout=60)


def infer(client: http.InferenceServerClient, model: str, arrays: dict[str, np.ndarray], datatypes: dict[str, str],
          binary: bool, outputs: list[str] | None = None) -> http.InferResult:
    inputs = []
    for name, arr in arrays.items():
        i = http.InferInput(name, list(arr.shape), datatypes[name])
        i.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(i)
    outs = [http.InferRequestedOutput(o, binary_data=binary) for o in outputs] if outputs else None
    return client.infer(model, inputs, outputs=outs, request_id="req-1")


def test_health_and_server_metadata(client: http.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    # tritonserver 2.51's list, less cuda_shared_memory (refused here).
    assert meta["extensions"] == ["classification", "sequence", "model_repository",
                                  "model_repository(unload_dependents)", "schedule_policy", "model_configuration",
                                  "system_shared_memory", "binary_tensor_data", "parameters", "statistics", "trace",
                                  "logging"]


def test_an_unknown_model_is_answered_as_tritonserver_answers(system: RunningSystem,
                                                              client: http.InferenceServerClient) -> None:
    """The statuses and words of tritonserver 2.51, compared call by call with tritonclient."""
    for call in (lambda: client.get_model_metadata("nope"), lambda: client.get_model_config("nope")):
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found") as e:
            call()
        assert e.value.status() == "404"
    assert not client.is_model_ready("nope")
    try:
        urllib.request.urlopen(f"http://{system.url}/v2/models/nope/ready", timeout=30).close()
        pytest.fail("an unknown model answered ready")
    except urllib.error.HTTPError as refused:
        with refused:  # (closes its connection: a socket left to the garbage collector fails a later test)
            answer = refused.code, json.loads(refused.read())
    assert answer == (400, {"error": "Model version not ready"})  # Triton: 400, as for a model not ready


def test_statistics_of_an_unknown_model_or_version_are_tritons_400(client: http.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="requested model 'nope' is not available") as e:
        client.get_inference_statistics("nope")
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException,
                       match="requested model version is not available for model 'simple'") as e:
        client.get_inference_statistics("simple", "9")
    assert e.value.status() == "400"


def test_classes_of_an_integer_output(client: http.InferenceServerClient) -> None:
    """tritonclient's class_count on Triton's `simple` (OUTPUT0 = INPUT0 + INPUT1, INT32 [16])."""
    a = np.array([[3, 9, -2, 9, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        i = http.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(a)
        inputs.append(i)
    for binary in (True, False):
        result = client.infer("simple", inputs, outputs=[http.InferRequestedOutput("OUTPUT0", binary_data=binary,
                                                                                   class_count=3)])
        assert result.get_output("OUTPUT0")["datatype"] == "BYTES"
        got = [[c if isinstance(c, bytes) else c.encode() for c in row] for row in result.as_numpy("OUTPUT0").tolist()]
        assert got == [[b"18:1", b"18:3", b"6:0"]]  # (tritonclient reads JSON strings as str)


EXPECTED_MODELS = ["add_sub", "minilm", "mlp", "simple", "simple_identity", "simple_int8", "simple_string"]


@pytest.mark.parametrize("model", EXPECTED_MODELS)
def test_metadata_and_config(client: http.InferenceServerClient, model: str) -> None:
    assert client.is_model_ready(model)
    meta = client.get_model_metadata(model)
    config = client.get_model_config(model)
    assert meta["name"] == model and meta["versions"] == ["1"]
    assert {i["name"] for i in meta["inputs"]} == {i["name"] for i in config["input"]}
    if config["max_batch_size"] > 0:
        assert all(i["shape"][0] == -1 for i in meta["inputs"])
    assert config["name"] == model and isinstance(config["max_batch_size"], int)


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("model,dtype,npdt", [("simple", "INT32", np.int32), ("simple_int8", "INT8", np.int8)])
def test_triton_simple_models(client: http.InferenceServerClient, binary: bool, model: str, dtype: str,
                              npdt: type) -> None:
    a = np.arange(16, dtype=npdt).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=npdt)
    r = infer(client, model, {"INPUT0": a, "INPUT1": b}, {"INPUT0": dtype, "INPUT1": dtype}, binary,
              ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    assert r.get_response()["id"] == "req-1"


@pytest.mark.parametrize("binary", [True, False])
def test_triton_simple_string(client: http.InferenceServerClient, binary: bool) -> None:
    a = np.array([[str(i) for i in range(16)]], dtype=object)
    b = np.array([["2"] * 16], dtype=object)
    r = infer(client, "simple_string", {"INPUT0": a, "INPUT1": b}, {"INPUT0": "BYTES", "INPUT1": "BYTES"}, binary,
              ["OUTPUT0", "OUTPUT1"])
    assert [int(x) for x in r.as_numpy("OUTPUT0").reshape(-1)] == [i + 2 for i in range(16)]
    assert [int(x) for x in r.as_numpy("OUTPUT1").reshape(-1)] == [i - 2 for i in range(16)]


@pytest.mark.parametrize("binary", [True, False])
def test_add_sub_and_identity(client: http.InferenceServerClient, binary: bool) -> None:
    x = np.array([1, 2, 3, 4], np.float32)
    y = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
    r = infer(client, "add_sub", {"INPUT0": x, "INPUT1": y}, {"INPUT0": "FP32", "INPUT1": "FP32"}, binary,
              ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), x + y)
    np.testing.assert_allclose(r.as_numpy("OUTPUT1"), x - y)
    s = np.array([["héllo".encode(), b"", b"x y"]], dtype=object)
    r = infer(client, "simple_identity", {"INPUT0": s}, {"INPUT0": "BYTES"}, binary)
    assert r.as_numpy("OUTPUT0").tolist() == s.tolist()


def reference_mlp(x: np.ndarray) -> np.ndarray:
    import torch

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                              torch.nn.ReLU(), torch.nn.Linear(1024, 256)).eval()
    with torch.inference_mode():
        return mlp(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("binary", [True, False])
def test_mlp_matches_direct_computation(client: http.InferenceServerClient, binary: bool) -> None:
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    r = infer(client, "mlp", {"INPUT0": x}, {"INPUT0": "FP32"}, binary)
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), reference_mlp(x), rtol=1e-4, atol=1e-5)


def test_minilm_embeddings(client: http.InferenceServerClient) -> None:
    texts = np.array([["A cat sits on the mat."], ["A kitten is sitting on a rug."], ["Stock prices fell."]],
                     dtype=object)
    r = infer(client, "minilm", {"TEXT": texts}, {"TEXT": "BYTES"}, True)
    emb = r.as_numpy("EMBEDDING")
    assert emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.2


def stats_of(client: http.InferenceServerClient, model: str) -> dict[str, int]:
    s = client.get_inference_statistics(model)["model_stats"][0]
    return {"inferences": int(s["inference_count"]), "executions": int(s["execution_count"])}


def test_concurrent_clients_get_batched(system: RunningSystem) -> None:
    before = stats_of(http.InferenceServerClient(system.url), "mlp")
    xs = np.random.default_rng(2).standard_normal((48, 1, 256)).astype(np.float32)

    def one(i: int) -> np.ndarray:
        c = http.InferenceServerClient(system.url)
        return infer(c, "mlp", {"INPUT0": xs[i]}, {"INPUT0": "FP32"}, True).as_numpy("OUTPUT0")

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    np.testing.assert_allclose(np.concatenate(results), reference_mlp(xs[:, 0]), rtol=1e-4, atol=1e-5)
    after = stats_of(http.InferenceServerClient(system.url), "mlp")
    inferences = after["inferences"] - before["inferences"]
    executions = after["executions"] - before["executions"]
    assert inferences == 48
    assert executions < inferences, f"no batching: {executions} executions for {inferences} inferences"


def raw_post(system: RunningSystem, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{system.url}{path}", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def simple_body(**override: object) -> bytes:
    doc = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                      for n in ("INPUT0", "INPUT1")]}
    doc.update(override)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/v2/models/nope/infer", simple_body(), 404, "unknown model"),  # tritonserver 2.51: 404
    ("/v2/models/simple/versions/9/infer", simple_body(), 404, "version"),
    ("/v2/models/simple/infer", b"{oops", 400, "JSON"),
    ("/v2/models/simple/infer", simple_body(inputs=[]), 400, "inputs"),
    ("/v2/models/simple/infer", simple_body(outputs=[{"name": "NOPE"}]), 400, "output"),
    ("/v2/models/simple/infer", json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]}).encode(), 400, "data-type"),
    ("/v2/models/simple/infer", json.dumps({"inputs": [
        {"name": n, "datatype": "INT32", "shape": [9, 16], "data": [1] * 144} for n in ("INPUT0", "INPUT1")]}).encode(),
     400, "batch-size"),
    ("/v2/models/simple_sequence/infer", json.dumps({"inputs": [
        {"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}]}).encode(), 400,
     "inference request to model 'simple_sequence' must specify a non-zero or non-empty correlation ID"),
])
def test_bad_inputs_get_status_codes(system: RunningSystem, path: str, body: bytes, status: int,
                                     fragment: str) -> None:
    code, doc = raw_post(system, path, body)
    assert code == status, doc
    assert fragment.lower() in doc["error"].lower()


def test_client_raises_on_bad_input(client: http.InferenceServerClient) -> None:
    x = np.zeros((1, 15), np.int32)
    with pytest.raises(InferenceServerException, match="unexpected shape"):
        infer(client, "simple", {"INPUT0": x, "INPUT1": x}, {"INPUT0": "INT32", "INPUT1": "INT32"}, True)


def test_statistics_have_every_duration(client: http.InferenceServerClient) -> None:
    s = client.get_inference_statistics("simple")["model_stats"][0]
    assert set(s["inference_stats"]) == {"success", "fail", "queue", "compute_input", "compute_infer",
                                         "compute_output", "cache_hit", "cache_miss"}
    assert s["inference_stats"]["success"]["count"] > 0


def test_metrics_use_triton_names(system: RunningSystem) -> None:
    with urllib.request.urlopen(system.metrics_url, timeout=10) as r:
        text = r.read().decode()
    # Exactly Triton's names: its counters carry no `_total` (prometheus-cpp), so dashboards and alerts
    # written for Triton find them.
    assert "# TYPE nv_inference_request_success counter" in text
    assert 'nv_inference_request_success{model="simple",version="1"}' in text
    assert 'nv_inference_exec_count{model="simple",version="1"}' in text
    assert "nv_inference_request_success_total" not in text


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_responses(client: http.InferenceServerClient, algorithm: str) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        i = http.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(a)
        inputs.append(i)
    r = client.infer("simple", inputs, request_compression_algorithm=algorithm,
                     response_compression_algorithm=algorithm)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + a)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - a)


def test_response_is_compressed_when_asked(system: RunningSystem) -> None:
    import gzip

    req = urllib.request.Request(f"http://{system.url}/v2/models/simple/infer", data=simple_body(), method="POST",
                                 headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        doc = json.loads(gzip.decompress(r.read()))
    assert {o["name"]: o["data"] for o in doc["outputs"]}["OUTPUT0"] == [2] * 16


def test_the_mlp_pipeline_ensemble_equals_its_steps_called_one_by_one(system: RunningSystem,
                                                                     client: http.InferenceServerClient) -> None:
    """model_repository/mlp_pipeline (mlp_pre -> mlp -> mlp_post), over HTTP and gRPC, against the three
    models called from the client one after another."""
    import tritonclient.grpc as grpc

    raw = np.random.default_rng(7).normal(3.0, 2.0, size=(2, 256)).astype(np.float32)
    pre = infer(client, "mlp_pre", {"RAW": raw}, {"RAW": "FP32"}, True).as_numpy("INPUT0")
    logits = infer(client, "mlp", {"INPUT0": pre}, {"INPUT0": "FP32"}, True).as_numpy("OUTPUT0")
    post = infer(client, "mlp_post", {"LOGITS": logits}, {"LOGITS": "FP32"}, True)
    result = infer(client, "mlp_pipeline", {"RAW": raw}, {"RAW": "FP32"}, True)
    assert (result.as_numpy("CLASS") == post.as_numpy("CLASS")).all()
    assert np.allclose(result.as_numpy("PROBS"), post.as_numpy("PROBS"), atol=1e-6)
    assert np.allclose(result.as_numpy("PROBS").sum(axis=1), 1.0, atol=1e-5)
    g = grpc.InferenceServerClient(system.grpc_url)
    try:
        x = grpc.InferInput("RAW", [2, 256], "FP32")
        x.set_data_from_numpy(raw)
        out = g.infer("mlp_pipeline", [x], outputs=[grpc.InferRequestedOutput("CLASS")])
        assert (out.as_numpy("CLASS") == post.as_numpy("CLASS")).all() and out.as_numpy("PROBS") is None
        assert g.get_model_config("mlp_pipeline").config.platform == "ensemble"
    finally:
        g.close()


def test_the_text_pipeline_ensemble(client: http.InferenceServerClient) -> None:
    """model_repository/text_pipeline: text_pre (cleaning) -> minilm -> text_post (FP16, top dim)."""
    messy = np.array([["  A cat\tsits on\nthe mat.  "], ["A kitten is sitting on a rug."]], dtype=object)
    result = infer(client, "text_pipeline", {"RAW_TEXT": messy}, {"RAW_TEXT": "BYTES"}, True)
    emb16 = result.as_numpy("EMBEDDING_FP16")
    assert emb16.dtype == np.float16 and emb16.shape == (2, 384)
    clean = np.array([["A cat sits on the mat."], ["A kitten is sitting on a rug."]], dtype=object)
    direct = infer(client, "minilm", {"TEXT": clean}, {"TEXT": "BYTES"}, True).as_numpy("EMBEDDING")
    np.testing.assert_allclose(emb16.astype(np.float32), direct, atol=2e-3)
    assert (result.as_numpy("TOP_DIM")[:, 0] == np.abs(direct).argmax(axis=1)).all()
