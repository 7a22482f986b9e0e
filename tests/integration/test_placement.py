"""A CPU worker does not serve a KIND_GPU-only model and says why; the models it can serve are served."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from fleet.redis_server import LocalServer
from tests.support.system import in_process_system

MODELS = Path(__file__).resolve().parents[1] / "models"


def test_a_gpu_only_model_is_unavailable_on_a_cpu_worker_with_its_reason(redis_server: LocalServer, key_prefix: str,
                                                                         tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "doubler", repo / "doubler")
    shutil.copytree(MODELS / "doubler", repo / "gpu_doubler")
    config = repo / "gpu_doubler" / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], ready_models=["doubler"],
                                     control_api=True) as s:
            body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [[1, 2]]}]}
            assert (await s.client.post("/v2/models/doubler/infer", json=body)).status_code == 200
            for _ in range(100):  # the reason arrives with the worker's heartbeat
                index = (await s.client.post("/v2/repository/index", json={})).json()
                gpu = [item for item in index if item["name"] == "gpu_doubler"]
                if gpu and "reason" in gpu[0]:
                    break
                await asyncio.sleep(0.05)
            assert gpu[0]["state"] == "UNAVAILABLE"
            assert "KIND_GPU" in gpu[0]["reason"] and "no GPU" in gpu[0]["reason"], gpu
            assert {"name": "doubler", "version": "1", "state": "READY"} in index
            r = await s.client.post("/v2/models/gpu_doubler/infer", json=body)
            assert r.status_code != 200 and r.json()["error"], r.text
            assert (await s.client.get("/v2/models/gpu_doubler/ready")).status_code != 200

    asyncio.run(main())
