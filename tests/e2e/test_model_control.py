"""Model control end to end (gateway/model_control.py, workers/control.py): real gateway and worker
processes in explicit mode, driven with tritonclient over HTTP and gRPC as Triton's
simple_http_model_control.py / simple_grpc_model_control.py do, plus failing loads, `file:`
overrides, an auto-completed config, and unload draining what is queued."""

from __future__ import annotations

import base64
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from fleet.keys import Keys
from tests.support.model_repo import TRITON_EXAMPLES
from tests.support.processes import Cluster, explicit_cluster

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "ctl"

BROKEN_INIT = '''
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights file is missing")

    def execute(self, requests):
        return []
'''

SLOW = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.2)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                                 .as_numpy().astype(np.float32))])
                for r in requests]
'''

IO = ('input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
      'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n')


ENSEMBLE = """platform: "ensemble"
max_batch_size: MAX
input [ { name: "IN", data_type: TYPE_FP32, dims: [ DIMS ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ DIMS ] } ]
ensemble_scheduling { step [
  { model_name: "STEP" model_version: -1 input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "mid" } },
  { model_name: "STEP" model_version: -1 input_map { key: "IN" value: "mid" } output_map { key: "OUT" value: "OUT" } }
] }
"""


def python_model(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


def build_repository(root: Path) -> Path:
    repo = root / "models"
    repo.mkdir()
    shutil.copytree(TRITON_EXAMPLES / "simple", repo / "simple")
    shutil.copytree(ROOT / "tests" / "models" / "doubler", repo / "doubler")
    python_model(repo, "broken_init", BROKEN_INIT, 'backend: "python"\nmax_batch_size: 0\n' + IO)
    python_model(repo, "slow", SLOW, 'backend: "python"\nmax_batch_size: 0\n' + IO)
    (repo / "bad_file" / "1").mkdir(parents=True)
    (repo / "bad_file" / "1" / "model.onnx").write_bytes(b"this is not an onnx model")
    (repo / "bad_file" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 0\n' + IO)
    # No config.pbtxt at all: a worker completes it from the ONNX graph (workers/auto_complete.py).
    (repo / "completed" / "1").mkdir(parents=True)
    shutil.copy(TRITON_EXAMPLES / "simple" / "1" / "model.onnx", repo / "completed" / "1" / "model.onnx")
    # An ensemble of two doubler steps (doubler loads at start), one of `slow`, which nothing loads first, and
    # one of a model no repository has.
    for name, step in (("twice", "doubler"), ("slow_twice", "slow"), ("lost_twice", "nowhere")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(ENSEMBLE.replace("STEP", step).replace(
            "MAX", "8" if step == "doubler" else "0").replace("DIMS", "-1" if step == "doubler" else "1"))
    return repo


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("control")
    with explicit_cluster(tmp, build_repository(tmp), PREFIX, "doubler") as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> Iterator[th.InferenceServerClient]:
    c = th.InferenceServerClient(f"127.0.0.1:{cluster.http_port}", network_timeout=120.0)
    yield c
    c.close()


def add(client: th.InferenceServerClient | tg.InferenceServerClient, model: str, module: object) -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]  # type: ignore[attr-defined]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return client.infer(model, inputs).as_numpy("OUTPUT0")  # type: ignore[no-any-return]


def index_of(client: th.InferenceServerClient) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for item in client.get_model_repository_index():
        out.setdefault(item["name"], []).append(item)
    return out


def test_only_the_startup_models_load_and_the_index_lists_every_model(client: th.InferenceServerClient) -> None:
    index = index_of(client)
    assert sorted(index) == ["bad_file", "broken_init", "completed", "doubler", "lost_twice", "simple", "slow",
                             "slow_twice", "twice"]
    assert index["doubler"] == [{"name": "doubler", "version": "1", "state": "READY"}]
    assert index["simple"] == [{"name": "simple"}]  # never loaded: its name alone, as Triton
    assert not client.is_model_ready("simple")
    # tritonserver 2.51 in explicit mode answers a repository model never loaded as one that is not there.
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'simple' is not found") as e:
        add(client, "simple", th)
    assert e.value.status() == "404"


def test_triton_http_model_control_flow(client: th.InferenceServerClient) -> None:
    """simple_http_model_control.py's steps and checks."""
    client.load_model("simple")
    assert client.is_model_ready("simple")
    assert (add(client, "simple", th) == np.arange(1, 17)).all()
    with pytest.raises(InferenceServerException, match="failed to load"):
        client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    # The override replaces config.pbtxt; the rest is completed from the ONNX graph, as in Triton.
    client.load_model("simple", config='{"max_batch_size":"16"}')
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 16
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert (add(client, "simple", th) == np.arange(1, 17)).all()
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    with pytest.raises(InferenceServerException, match="failed to load"):
        client.load_model("wrong_model_name")


def test_triton_grpc_model_control_flow(cluster: Cluster) -> None:
    """simple_grpc_model_control.py's steps and checks, over gRPC."""
    client = tg.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    try:
        grpc_flow(client)
    finally:
        client.close()


def grpc_flow(client: tg.InferenceServerClient) -> None:
    client.load_model("simple")
    assert client.is_model_ready("simple")
    with pytest.raises(InferenceServerException, match="failed to load"):
        client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    client.load_model("simple", config='{"max_batch_size":"16"}')
    assert client.get_model_config("simple").config.max_batch_size == 16
    assert (add(client, "simple", tg) == np.arange(1, 17)).all()
    names = {m.name for m in client.get_model_repository_index().models}
    assert {"simple", "doubler", "completed"} <= names
    client.unload_model("simple")
    assert not client.is_model_ready("simple")
    with pytest.raises(InferenceServerException, match="failed to load"):
        client.load_model("wrong_model_name")


def test_a_failing_load_reports_the_workers_reason(client: th.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="weights file is missing"):
        client.load_model("broken_init")
    with pytest.raises(InferenceServerException, match="failed to load") as bad:
        client.load_model("bad_file")
    assert "bad_file" in str(bad.value)
    index = index_of(client)
    assert index["broken_init"][0]["state"] == "UNAVAILABLE"
    assert "weights file is missing" in index["broken_init"][0]["reason"]
    assert client.is_model_ready("doubler")  # nothing else disturbed


def test_a_model_without_config_is_completed_by_the_worker(client: th.InferenceServerClient) -> None:
    client.load_model("completed")
    config = client.get_model_config("completed")
    assert config["max_batch_size"] == 4 and config["backend"] == "onnxruntime"
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1"]
    assert (add(client, "completed", th) == np.arange(1, 17)).all()
    client.unload_model("completed")


def test_file_overrides_load_a_model_from_the_request(client: th.InferenceServerClient) -> None:
    onnx = (TRITON_EXAMPLES / "simple" / "1" / "model.onnx").read_bytes()
    config = (TRITON_EXAMPLES / "simple" / "config.pbtxt").read_text()
    as_json = '{"backend":"onnxruntime","max_batch_size":8,' \
              '"input":[{"name":"INPUT0","data_type":"TYPE_INT32","dims":[16]},' \
              '{"name":"INPUT1","data_type":"TYPE_INT32","dims":[16]}],' \
              '"output":[{"name":"OUTPUT0","data_type":"TYPE_INT32","dims":[16]},' \
              '{"name":"OUTPUT1","data_type":"TYPE_INT32","dims":[16]}]}'
    assert "INPUT0" in config
    client.load_model("uploaded", config=as_json, files={"file:1/model.onnx": onnx})
    assert (add(client, "uploaded", th) == np.arange(1, 17)).all()
    with pytest.raises(InferenceServerException, match="must be relative"):
        client.load_model("uploaded", config=as_json, files={"file:../../escape.onnx": onnx})
    raw = base64.b64encode(b"x").decode()
    assert raw  # the HTTP client sends file contents base64, as Triton's protocol says
    client.unload_model("uploaded")


def test_unload_answers_what_is_queued_and_refuses_new_requests(cluster: Cluster,
                                                                 client: th.InferenceServerClient) -> None:
    client.load_model("slow")
    results: list[object] = []

    def one(i: int) -> None:
        x = th.InferInput("IN", [1], "FP32")
        x.set_data_from_numpy(np.array([float(i)], np.float32))
        own = th.InferenceServerClient(f"127.0.0.1:{cluster.http_port}", network_timeout=120.0)
        try:
            results.append(float(own.infer("slow", [x]).as_numpy("OUT")[0]))
        except InferenceServerException as exc:
            results.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]  # ~1.6 s of work, one instance
    for t in threads:
        t.start()
    # All 8 accepted before the unload (a fixed 0.3 s was not always enough on a loaded host). Counted as
    # the stream's entries ever added: an answered request's entry lives on until its acknowledgement, so
    # entries plus answers could count one twice and unload before the last was enqueued.
    r = redis.Redis.from_url(cluster.redis_url)
    queue_key = Keys(PREFIX).queue("slow", version=1)
    deadline = time.monotonic() + 20
    while not (r.exists(queue_key) and r.xinfo_stream(queue_key)["entries-added"] >= 8):
        assert time.monotonic() < deadline, "the 8 requests were not all accepted"
        time.sleep(0.02)
    r.close()
    client.unload_model("slow")
    assert not client.is_model_ready("slow")
    with pytest.raises(InferenceServerException, match="has no available versions") as unloaded:
        x = th.InferInput("IN", [1], "FP32")
        x.set_data_from_numpy(np.array([1.0], np.float32))
        client.infer("slow", [x])
    assert unloaded.value.status() == "404"  # as tritonserver answers: not a 503 a client would retry on
    for t in threads:
        t.join(30)
    assert sorted(r for r in results if isinstance(r, float)) == [float(i) for i in range(8)], results
    deadline = time.monotonic() + 20
    while index_of(client)["slow"] != [{"name": "slow", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]:
        assert time.monotonic() < deadline, index_of(client)["slow"]
        time.sleep(0.2)


def test_a_reload_that_fails_leaves_the_model_serving(client: th.InferenceServerClient) -> None:
    """Triton keeps the loaded model when a reload fails; so does fleet (here: a config that parses but
    does not validate)."""
    x = th.InferInput("IN", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[2.0]], np.float32))
    with pytest.raises(InferenceServerException, match="failed to load"):
        client.load_model("doubler", config='{"backend": "python", "max_batch_size": -1}')
    assert client.is_model_ready("doubler")
    assert float(client.infer("doubler", [x]).as_numpy("OUT")[0, 0]) == 4.0


def test_a_model_name_is_never_a_path(cluster: Cluster) -> None:
    grpc = tg.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    try:
        for name in ("../../escape", "a/b", ".."):
            with pytest.raises(InferenceServerException, match="not a valid model name"):
                grpc.load_model(name, config="{}", files={"file:1/model.onnx": b"x"})
    finally:
        grpc.close()
    assert not (cluster.tmp / "escape").exists()


def test_an_ensemble_loads_and_unloads_with_its_composing_models(client: th.InferenceServerClient) -> None:
    """As Triton in explicit mode: loading an ensemble loads the models its steps name that are not loaded
    (`slow` here), and unload_dependents unloads them with it; one whose steps already serve loads too."""
    x = th.InferInput("IN", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[3.0]], np.float32))
    client.load_model("twice")
    assert client.is_model_ready("twice")
    assert client.infer("twice", [x]).as_numpy("OUT").tolist() == [[12.0]]
    client.unload_model("twice")
    assert not client.is_model_ready("twice") and client.is_model_ready("doubler")

    assert not client.is_model_ready("slow")
    client.load_model("slow_twice")
    assert client.is_model_ready("slow_twice") and client.is_model_ready("slow")
    y = th.InferInput("IN", [1], "FP32")
    y.set_data_from_numpy(np.array([3.0], np.float32))
    assert client.infer("slow_twice", [y]).as_numpy("OUT").tolist() == [3.0]  # slow is the identity
    client.unload_model("slow_twice", unload_dependents=True)
    assert not client.is_model_ready("slow_twice") and not client.is_model_ready("slow")
    # A step no repository holds: refused before anything is written (no record left behind to rescan for).
    with pytest.raises(InferenceServerException, match="its step model 'nowhere' is not in any model repository"):
        client.load_model("lost_twice")
