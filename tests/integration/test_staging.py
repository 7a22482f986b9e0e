"""Partial staging end to end (batching/scheduler.py, `stage_partial`): on a model whose compute leaves the
host CPU alone (the sleep backend), batches staged behind a running one grow with what arrives, and every
request still gets exactly its own answer. Real Redis, the gateway app and a real worker, in process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleet.redis_server import LocalServer
from tests.support.system import in_process_system
from workers.instance import Instance, Job

CONFIG = """backend: "sleep"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
parameters { key: "execute_delay_us" value { string_value: "30000" } }
parameters { key: "execute_delay_per_item_us" value { string_value: "1000" } }
"""


def body(i: int) -> dict[str, object]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [i, -i]}]}


def test_staged_batches_grow_while_the_instance_computes_and_every_request_gets_its_answer(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grown: list[bool] = []
    restage = Instance.restage

    def counted(self: Instance, old: Job, new: Job) -> bool:
        grown.append(restage(self, old, new))
        return grown[-1]

    monkeypatch.setattr(Instance, "restage", counted)
    (tmp_path / "gpuish" / "1").mkdir(parents=True)
    (tmp_path / "gpuish" / "config.pbtxt").write_text(CONFIG)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [tmp_path]) as s:
            async def one(i: int) -> list[float]:
                r = await s.client.post("/v2/models/gpuish/infer", json=body(i))
                assert r.status_code == 200, r.text
                out = r.json()["outputs"]
                assert [o["name"] for o in out] == ["OUT"]
                return list(out[0]["data"])

            tasks = []
            for wave in range(6):  # arrivals spread over the first batches' compute (30 ms and more each)
                tasks += [asyncio.create_task(one(wave * 10 + k)) for k in range(5)]
                await asyncio.sleep(0.008)
            answers = await asyncio.gather(*tasks)
            assert answers == [[float(i), float(-i)] for w in range(6) for i in range(w * 10, w * 10 + 5)]
            stats = (await s.client.get("/v2/models/gpuish/stats")).json()["model_stats"][0]
            assert stats["inference_count"] == 30
            # Batched, and not one request at a time: 30 requests in far fewer executions.
            assert stats["execution_count"] <= 12, stats["batch_stats"]
        assert any(grown), f"no staged batch grew ({len(grown)} tries)"

    asyncio.run(main())
