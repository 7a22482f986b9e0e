"""Ensembles driven by the gateway (gateway/ensembles.py) with a real worker: the graph's answer, steps
batching with direct traffic to the same model, a failing step failing the request with its error, an
ensemble whose plan is wrong reported in the index, and the caller's priority and deadline carried into
every step."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

from fleet.kserve import ParsedInfer
from fleet.redis_server import LocalServer
from tests.support.system import in_process_system

# OUT = IN * FACTOR + OFFSET (from the config's parameters); refuses negative input.
MODEL = textwrap.dedent("""
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            params = json.loads(args["model_config"])["parameters"]
            self.factor = float(params["FACTOR"]["string_value"])
            self.offset = float(params["OFFSET"]["string_value"])

        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                if (x < 0).any():
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input refused")))
                else:
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", (x * self.factor + self.offset)
                                                                           .astype(np.float32))]))
            return out
""")


def affine(repo: Path, name: str, factor: float, offset: float) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(MODEL)
    (repo / name / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 16\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        'dynamic_batching { max_queue_delay_microseconds: 20000 }\n'
        f'parameters [ {{ key: "FACTOR", value: {{ string_value: "{factor}" }} }},'
        f' {{ key: "OFFSET", value: {{ string_value: "{offset}" }} }} ]\n')


def ensemble(repo: Path, name: str, steps: list[tuple[str, str, str]]) -> None:
    """steps: (model, input tensor, output tensor); the ensemble's IN and OUT are tensors too."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "README").write_text("ensembles have empty version directories\n")
    body = "".join(f'step {{ model_name: "{m}" model_version: -1 input_map {{ key: "IN" value: "{i}" }} '
                   f'output_map {{ key: "OUT" value: "{o}" }} }} ' for m, i, o in steps)
    (repo / name / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 16\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
        f'ensemble_scheduling {{ {body}}}\n')


def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    affine(repo, "double", 2.0, 0.0)
    affine(repo, "inc", 1.0, 1.0)
    ensemble(repo, "pipeline", [("double", "IN", "doubled"), ("inc", "doubled", "OUT")])
    ensemble(repo, "nested", [("pipeline", "IN", "once"), ("pipeline", "once", "OUT")])
    ensemble(repo, "broken", [("double", "IN", "mid"), ("missing_model", "mid", "OUT")])
    return repo


def body(values: list[float], **parameters: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": values}]}
    if parameters:
        doc["parameters"] = parameters
    return doc


def test_an_ensemble_runs_its_steps_through_the_queue(redis_server: LocalServer, key_prefix: str,
                                                      tmp_path: Path) -> None:
    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repository(tmp_path)],
                                     ready_models=["double", "inc"]) as s:
            for _ in range(50):  # the ensembles' readiness follows their steps'
                if s.state.catalog.ready_versions("nested"):
                    break
                await asyncio.sleep(0.1)
            r = await s.client.post("/v2/models/pipeline/infer", json=body([1.0, 2.5]))
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["data"] == [3.0, 6.0] and r.json()["model_name"] == "pipeline"
            r = await s.client.post("/v2/models/nested/infer", json=body([1.0, 2.0]))
            assert r.json()["outputs"][0]["data"] == [7.0, 11.0]  # ((x*2+1)*2+1)

            # Steps batch with direct traffic to the same model: 12 ensemble calls and 12 direct calls
            # to 'double', all at once, take fewer executions of 'double' than calls.
            before = (await s.client.get("/v2/models/double/stats")).json()["model_stats"][0]
            replies = await asyncio.gather(*[s.client.post(f"/v2/models/{m}/infer", json=body([float(i), 0.0]))
                                             for i in range(12) for m in ("pipeline", "double")])
            assert all(r.status_code == 200 for r in replies)
            after = (await s.client.get("/v2/models/double/stats")).json()["model_stats"][0]
            calls = after["inference_count"] - before["inference_count"]
            executions = after["execution_count"] - before["execution_count"]
            assert calls == 24 and executions < calls, (calls, executions)
            await s.state.ensembles.drain()
            stats = (await s.client.get("/v2/models/pipeline/stats")).json()["model_stats"][0]
            # 1 + 12 direct, and 2 as the steps of 'nested' (a nested ensemble counts as Triton counts it)
            assert stats["inference_stats"]["success"]["count"] == 15
            last_success = stats["last_inference"]
            assert last_success > 0

            # A failing step fails the request with that step's error (and is not an inference: Triton's
            # last_inference stays at the last success).
            r = await s.client.post("/v2/models/pipeline/infer", json=body([-1.0, 1.0]))
            assert r.status_code == 500 and "negative input refused" in r.json()["error"], r.text
            await s.state.ensembles.drain()
            stats = (await s.client.get("/v2/models/pipeline/stats")).json()["model_stats"][0]
            assert stats["inference_stats"]["fail"]["count"] == 1
            assert stats["last_inference"] == last_success

            # An ensemble whose plan cannot hold says why, in the index and to requests.
            r = await s.client.post("/v2/models/broken/infer", json=body([1.0, 1.0]))
            assert r.status_code == 503 and "missing_model" in r.json()["error"], r.text
            ready = (await s.client.get("/v2/health/ready")).status_code
            assert ready != 200  # 'broken' is a model of the repository that cannot serve

    asyncio.run(main(), debug=False)


def test_priority_and_deadline_reach_every_step(redis_server: LocalServer, key_prefix: str,
                                                tmp_path: Path) -> None:
    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repository(tmp_path)],
                                     ready_models=["double", "inc"]) as s:
            for _ in range(50):
                if s.state.catalog.ready_versions("pipeline"):
                    break
                await asyncio.sleep(0.1)
            seen: list[ParsedInfer] = []
            real = s.state.dataplane._step

            async def spy(model: str, v: int, spec: Any, req: ParsedInfer, timeout_s: float | None,
                          gen: str) -> Any:
                seen.append(req)
                return await real(model, v, spec, req, timeout_s, gen)

            s.state.dataplane._step = spy  # type: ignore[method-assign]
            r = await s.client.post("/v2/models/pipeline/infer", json=body([1.0, 1.0], priority=1, timeout=5_000_000))
            assert r.status_code == 200, r.text
            assert [q.priority for q in seen] == [1, 1]
            assert all(0 < q.timeout_us <= 5_000_000 for q in seen)
            assert seen[1].timeout_us <= seen[0].timeout_us  # what remains of it, step by step

    asyncio.run(main())
