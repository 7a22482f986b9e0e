"""JSON logs from real processes (FLEET_LOG_FORMAT=json, what containers run with): a gateway, a worker
with a Python model's stub and a bulk-jobs worker on a real Redis, at verbose level 1 so that every
library's lines pass through too. Every line each process writes, from start to stop, is one JSON
object; the lines about a request name its model, version and fleet's request id, the same id in the
gateway's, the worker's and the model's (pb_utils.Logger) lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from tests.support.processes import Cluster

pytestmark = pytest.mark.e2e

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

# Says what it computes through Triton's logger; a negative input makes execute() raise.
MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_info("chatty ready")

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            pb_utils.Logger.log_info(f"chatty sums {x.size} values")
            if (x < 0).any():
                raise ValueError("chatty refuses negative values")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x.astype(np.float32))]))
        return out
"""

ENV = {"FLEET_LOG_FORMAT": "json", "FLEET_LOG_VERBOSE": "1", "FLEET_KEY_PREFIX": "jsonlogs",
       "FLEET_BLOCK_MS": "200"}
FIELDS = {"ts", "level", "logger", "role", "pid", "msg"}


def _repository(tmp: Path) -> Path:
    model = tmp / "repo" / "chatty"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(MODEL)
    return model.parent


def _lines(text: str, name: str) -> list[dict[str, Any]]:
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            doc = json.loads(line)
        except ValueError:
            pytest.fail(f"{name} line {n} is not JSON: {line!r}")
        assert isinstance(doc, dict) and FIELDS <= doc.keys(), (name, line)
        docs.append(doc)
    return docs


def _infer(client: http.InferenceServerClient, values: list[float]) -> None:
    data = np.array(values, dtype=np.float32)
    inp = http.InferInput("IN", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    client.infer("chatty", [inp], model_version="1")


def test_every_line_is_json_and_names_its_request(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, _repository(tmp_path), ENV)
    try:
        cluster.start_redis()
        gateway = cluster.start_gateway()
        worker = cluster.start_worker()
        jobs = cluster.start_jobs_worker()
        cluster.wait_ready()
        client = http.InferenceServerClient(cluster.base_url.removeprefix("http://"))
        _infer(client, [1.0, 2.0])
        with pytest.raises(InferenceServerException, match="chatty refuses negative values"):
            _infer(client, [-1.0])
        client.close()
    finally:
        cluster.stop()  # stopping logs too: those lines must be JSON as well
    logs = {name: _lines(cluster.log_of(proc), name)
            for name, proc in (("gateway", gateway), ("worker", worker), ("jobs", jobs))}
    assert {d["role"] for d in logs["gateway"]} == {"gateway"}
    assert {d["role"] for d in logs["jobs"]} == {"jobs"}
    # The stub writes to its worker's output: its lines are the worker log's with role "stub".
    assert {d["role"] for d in logs["worker"]} == {"worker", "stub"}

    ready = [d for d in logs["worker"] if d["msg"] == "chatty ready"]
    assert [(d["role"], d["model"], d["version"]) for d in ready] == [("stub", "chatty", 1)]
    sums = [d for d in logs["worker"] if d["msg"].startswith("chatty sums")]
    assert [(d["msg"], d["model"], d["version"], len(d["request_ids"])) for d in sums] == [
        ("chatty sums 2 values", "chatty", 1, 1), ("chatty sums 1 values", "chatty", 1, 1)]
    failed_id = sums[1]["request_ids"][0]
    raised = [d for d in logs["worker"] if "execute() raised" in d["msg"]]
    assert len(raised) == 1 and raised[0]["role"] == "worker" and raised[0]["level"] == "WARNING"
    assert (raised[0]["model"], raised[0]["version"], raised[0]["request_ids"]) == ("chatty", 1, [failed_id])
    assert "chatty refuses negative values" in raised[0]["msg"]
    answered = [d for d in logs["gateway"] if d["msg"].startswith("infer answered")]
    assert [(d["level"], d["model"], d["version"], d["request_id"]) for d in answered] == [
        ("DEBUG", "chatty", 1, failed_id)]
