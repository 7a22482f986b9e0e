"""A Python-backend instance driven by the worker's event loop (workers/instance.py, workers/execute.py's
LoopRun): the loop writes each call to the stub and is woken by its reply, with no instance thread
between. A call that needs a thread (here an error reply: its requests are run again one at a time) is
finished on the instance's thread, and the calls after it go back to the loop. Real Redis, the gateway
app and a real worker, in process."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest

from fleet.redis_server import LocalServer
from tests.support.system import InProcessSystem, in_process_system
from workers.execute import LoopRun

CONFIG = """backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""
# Doubles its inputs, slowly enough for requests to queue behind a call; a negative input fails the call.
MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.01)
        xs = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        if any((x < 0).any() for x in xs):
            raise ValueError("a negative input")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]) for x in xs]
"""


def _instance_threads() -> list[str]:
    """The instance's own thread (its executor's), if it ever ran a call."""
    return [t.name for t in threading.enumerate() if t.name.startswith("twice_0_")]


async def _wave(s: InProcessSystem, values: list[float]) -> list[httpx.Response]:
    return await asyncio.gather(*(s.client.post("/v2/models/twice/infer", json={
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [v]}]}) for v in values))


def test_the_loop_makes_the_calls_and_hands_a_failed_one_to_the_thread(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[bool] = []
    begin = LoopRun.begin

    def counted(self: LoopRun, *args: object) -> bool:
        started.append(begin(self, *args))  # type: ignore[arg-type]
        return started[-1]

    monkeypatch.setattr(LoopRun, "begin", counted)
    (tmp_path / "twice" / "1").mkdir(parents=True)
    (tmp_path / "twice" / "config.pbtxt").write_text(CONFIG)
    (tmp_path / "twice" / "1" / "model.py").write_text(MODEL)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [tmp_path]) as s:
            for wave in range(3):
                values = [float(wave * 10 + k) for k in range(6)]
                for v, r in zip(values, await _wave(s, values), strict=True):
                    assert r.status_code == 200, r.text
                    assert r.json()["outputs"][0]["data"] == [2 * v]
            stats = (await s.client.get("/v2/models/twice/stats")).json()["model_stats"][0]
            assert stats["inference_count"] == 18 and stats["execution_count"] < 18  # batched
            # Every call so far was made from the loop: the instance's thread never ran.
            assert started and all(started) and len(started) == stats["execution_count"]
            assert _instance_threads() == []

            # A call whose reply is an error: finished on the thread (each request run again alone).
            values = [1.0, -1.0, 2.0, 3.0]
            responses = await _wave(s, values)
            for v, r in zip(values, responses, strict=True):
                if v < 0:
                    assert r.status_code == 500 and "a negative input" in r.json()["error"], r.text
                else:
                    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2 * v], r.text
            assert len(_instance_threads()) == 1

            # And the calls after it are the loop's again.
            before = len(started)
            for v, r in zip(range(8), await _wave(s, [float(v) for v in range(8)]), strict=True):
                assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0 * v], r.text
            assert len(started) > before and all(started[before:])

    asyncio.run(main())
