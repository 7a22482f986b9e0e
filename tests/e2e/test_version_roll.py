"""Poll mode end to end: two real workers follow the repository. A new version directory is loaded beside
the old one while 16 clients keep sending unversioned requests; they switch to it once it serves, the
old version drains and unloads, and not one request fails. A removed model goes away."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from tests.support.processes import Cluster, http_status

pytestmark = pytest.mark.e2e
CLIENTS = 16

VERSIONED = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.factor = float(args["model_version"])

    def execute(self, requests):
        time.sleep(0.005)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", (pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * self.factor).astype(np.float32))])
                for r in requests]
'''
CONFIG = ('backend: "python"\nmax_batch_size: 8\n'
          'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
          'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
          'dynamic_batching { max_queue_delay_microseconds: 2000 }\n')


def add_version(model_dir: Path, version: int) -> None:
    """Written beside, then renamed into place: a poll never sees half a version directory."""
    staging = model_dir.parent.parent / f".staging-{model_dir.name}-{version}"
    staging.mkdir()
    (staging / "model.py").write_text(VERSIONED)
    staging.rename(model_dir / str(version))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    repo = tmp_path / "models"
    for name in ("versioned", "gone"):
        (repo / name).mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG)
        add_version(repo / name, 1)
    env = {"FLEET_KEY_PREFIX": "roll", "FLEET_BLOCK_MS": "200", "FLEET_MODEL_CONTROL_MODE": "poll",
           "FLEET_CONTROL_API": "1", "FLEET_REPOSITORY_POLL_SECS": "0.5", "FLEET_HEARTBEAT_INTERVAL_S": "0.3",
           "FLEET_UNLOAD_GRACE_S": "1.5"}
    c = Cluster(tmp_path, repo, env)
    c.start_redis()
    c.start_gateway()
    c.start_worker()
    c.start_worker()
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def index(c: Cluster) -> list[dict[str, str]]:
    client = th.InferenceServerClient(f"127.0.0.1:{c.http_port}")
    try:
        return client.get_model_repository_index()  # type: ignore[no-any-return]
    finally:
        client.close()


def test_a_new_version_rolls_in_under_load_without_a_failed_request(cluster: Cluster) -> None:
    stop = threading.Event()
    factors: list[float] = []
    failures: list[str] = []

    def client_loop(i: int) -> None:
        client = th.InferenceServerClient(f"127.0.0.1:{cluster.http_port}", network_timeout=60.0)
        x = th.InferInput("IN", [1, 1], "FP32")
        x.set_data_from_numpy(np.array([[1.0]], np.float32))
        deadline = time.monotonic() + 90  # bounded whatever happens
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                factors.append(float(client.infer("versioned", [x]).as_numpy("OUT")[0, 0]))
            except InferenceServerException as exc:
                failures.append(str(exc))
        client.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        assert factors and set(factors) == {1.0}, (failures[:3], set(factors))
        add_version(cluster.repository / "versioned", 2)
        deadline = time.monotonic() + 60
        # The default policy (latest 1): version 2 replaces 1 on both workers, 1 drains and unloads.
        while [(i["version"], i.get("state")) for i in index(cluster) if i["name"] == "versioned"] != [("2", "READY")]:
            assert time.monotonic() < deadline, f"no roll within 60 s: {index(cluster)}\n{cluster.logs()}"
            time.sleep(0.2)
        switched = len(factors)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    print(f"roll: {len(factors)} answered ({factors.count(1.0)} by v1, {factors.count(2.0)} by v2), "
          f"{len(failures)} failed")
    assert not failures, f"{len(failures)} failed requests during the roll, first: {failures[:3]}"
    assert set(factors) == {1.0, 2.0}
    assert set(factors[switched + CLIENTS:]) == {2.0}  # once 1 is gone, only 2 answers
    assert len(factors) > 200


def test_a_removed_model_goes_away(cluster: Cluster) -> None:
    base = f"http://127.0.0.1:{cluster.http_port}"
    assert http_status(f"{base}/v2/models/gone/ready") == 200
    shutil.rmtree(cluster.repository / "gone")
    deadline = time.monotonic() + 30
    while any(i["name"] == "gone" for i in index(cluster)):
        assert time.monotonic() < deadline, index(cluster)
        time.sleep(0.2)
    assert http_status(f"{base}/v2/models/gone/ready") != 200
    assert http_status(f"{base}/v2/models/versioned/ready") == 200
