"""`model_warmup`: every sample runs on each instance before the model is advertised ready, with the
data the config asks for; a failing sample fails the load and the index says which and why."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import numpy as np

from fleet.redis_server import LocalServer
from tests.support.system import in_process_system

# Records every execution (shape and values) in calls.jsonl beside its config; fails on all-ones input.
MODEL = textwrap.dedent("""
    import json
    from pathlib import Path
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.log = Path(args["model_repository"]) / "calls.jsonl"

        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                with self.log.open("a") as f:
                    f.write(json.dumps({"shape": list(x.shape), "values": x.reshape(-1).tolist()}) + "\\n")
                if x.size and (x == 1).all():
                    raise pb_utils.TritonModelException("all ones: this model refuses them")
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
            return out
""")
CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


def _model(repo: Path, name: str, warmup: str, files: dict[str, bytes] | None = None) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(MODEL)
    (repo / name / "config.pbtxt").write_text(CONFIG + warmup)
    for file, data in (files or {}).items():
        (repo / name / "warmup").mkdir(exist_ok=True)
        (repo / name / "warmup" / file).write_bytes(data)
    return repo / name


def sample(name: str, batch_size: int, data: str, dims: list[int] | None = None, count: int = 0) -> str:
    value = f"data_type: TYPE_FP32, dims: {dims or [2]}, {data}"
    inputs = f'inputs {{ key: "IN" value: {{ {value} }} }}'
    return f'{{ name: "{name}", batch_size: {batch_size}, count: {count}, {inputs} }}'


def warmup(*samples: str) -> str:
    return "model_warmup [ " + ", ".join(samples) + " ]\n"


def _calls(model_dir: Path) -> list[dict[str, object]]:
    path = model_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_samples_run_before_ready_and_failures_fail_the_load(redis_server: LocalServer, key_prefix: str,
                                                            tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    good = _model(repo, "warmed", warmup(sample("zeros", 2, "zero_data: true", [3], count=3),
                                         sample("noise", 1, "random_data: true"),
                                         sample("file", 1, 'input_data_file: "in.bin"')),
                  {"in.bin": np.array([0.5, 2.5], np.float32).tobytes()})
    failing = _model(repo, "refuses_warmup", warmup(sample("ones", 1, 'input_data_file: "ones.bin"')),
                     {"ones.bin": np.ones(2, np.float32).tobytes()})
    _model(repo, "missing_file", warmup(sample("gone", 1, 'input_data_file: "nope.bin"')))
    _model(repo, "too_big", warmup(sample("big", 9, "zero_data: true")))

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], ready_models=["warmed"],
                                     control_api=True) as s:
            # Ready only after its samples: all five executions are already recorded.
            calls = _calls(good)
            assert [c["shape"] for c in calls] == [[2, 3]] * 3 + [[1, 2], [1, 2]]
            assert calls[0]["values"] == [0.0] * 6
            assert all(0.0 <= v < 1.0 for v in calls[3]["values"])  # type: ignore[attr-defined]
            assert calls[4]["values"] == [0.5, 2.5]
            body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [[3, 4]]}]}
            r = await s.client.post("/v2/models/warmed/infer", json=body)
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [6.0, 8.0]
            reasons: dict[str, str] = {}
            for _ in range(100):  # the reasons arrive with the worker's heartbeat
                index = (await s.client.post("/v2/repository/index", json={})).json()
                reasons = {i["name"]: i.get("reason", "") for i in index if i["state"] != "READY"}
                if all(reasons.get(m) for m in ("refuses_warmup", "missing_file", "too_big")):
                    break
                await asyncio.sleep(0.05)
            refused = "warmup sample 'ones' failed: TritonModelException: all ones: this model refuses them"
            assert refused in reasons["refuses_warmup"]
            assert "warmup sample 'gone': input 'IN': cannot read warmup/nope.bin" in reasons["missing_file"]
            assert "warmup sample 'big': batch_size 9 must be between 1 and 4" in reasons["too_big"]
            assert _calls(failing) == [{"shape": [1, 2], "values": [1.0, 1.0]}]
            assert (await s.client.post("/v2/models/refuses_warmup/infer", json=body)).status_code != 200

    asyncio.run(main())
