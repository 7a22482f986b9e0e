"""The response cache (gateway/response_cache.py): in Redis, so one gateway's computed response answers
the same request at another gateway; errors never cached; statistics and metrics as Triton's; bounded
by its byte budget with least-recently-used eviction."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.errors import ConfigError
from fleet.kserve import ParsedInfer
from fleet.redis_server import LocalServer
from gateway.app import create_app
from gateway.response_cache import cache_key, parse_cache_config
from tests.support.system import in_process_system

# Counts its executions in calls.txt beside its config; fails on negative input.
MODEL = textwrap.dedent("""
    from pathlib import Path
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.log = Path(args["model_repository"]) / "calls.txt"

        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                with self.log.open("a") as f:
                    f.write("x\\n")
                if (x < 0).any():
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
                else:
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
            return out
""")
CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""


def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    for name, extra in (("cached", "response_cache { enable: true }\n"), ("plain", "")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL)
        (repo / name / "config.pbtxt").write_text(CONFIG + extra)
    return repo


def calls(repo: Path, name: str) -> int:
    path = repo / name / "calls.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def body(values: list[float]) -> dict[str, Any]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, len(values)], "data": values}]}


async def infer(client: httpx.AsyncClient, model: str, values: list[float]) -> httpx.Response:
    return await client.post(f"/v2/models/{model}/infer", json=body(values))


def stats_of(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["model_stats"][0]  # type: ignore[no-any-return]


def test_cache_config_is_tritons_flag() -> None:
    assert parse_cache_config("") == 0
    assert parse_cache_config("local,size=1048576") == 1048576
    for bad in ("local", "local,size=abc", "memcached,size=10", "local,size=0"):
        with pytest.raises(ConfigError):
            parse_cache_config(bad)


def test_the_key_covers_what_changes_the_answer() -> None:
    from fleet.envelope import WireTensor

    def req(data: bytes, outputs: list[str] | None = None, parameters: dict[str, Any] | None = None,
            priority: int = 0) -> ParsedInfer:
        return ParsedInfer("", [WireTensor("IN", "FP32", [1, 1], data)], outputs, frozenset(), True,
                           parameters or {}, priority)

    base = cache_key("m", 1, req(b"\0\0\x80?"))
    assert cache_key("m", 1, req(b"\0\0\x80?", priority=2)) == base  # priority does not change the answer
    assert len({base, cache_key("m", 2, req(b"\0\0\x80?")), cache_key("n", 1, req(b"\0\0\x80?")),
                cache_key("m", 1, req(b"\0\0\0@")), cache_key("m", 1, req(b"\0\0\x80?", ["OUT"])),
                cache_key("m", 1, req(b"\0\0\x80?", parameters={"p": 1}))}) == 6


def test_a_response_is_shared_by_two_gateways_and_errors_are_not_cached(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    repo = repository(tmp_path)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], cache_config="local,size=1048576") as s:
            other = create_app(s.settings)  # a second gateway on the same Redis
            await other.state.fleet.start()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=other),
                                             base_url="http://gw2") as client2:
                    first = await infer(s.client, "cached", [1.0, 2.0])
                    assert first.status_code == 200 and first.json()["outputs"][0]["data"] == [2.0, 4.0]
                    await s.state.cache.drain()  # the insert runs off the request path
                    second = await infer(client2, "cached", [1.0, 2.0])
                    assert second.status_code == 200 and second.json()["outputs"][0]["data"] == [2.0, 4.0]
                    assert second.json()["model_version"] == "1"
                    assert calls(repo, "cached") == 1  # the second was never computed
                    # A different request, and a model without the cache, are computed every time.
                    assert (await infer(client2, "cached", [3.0])).json()["outputs"][0]["data"] == [6.0]
                    for _ in range(2):
                        assert (await infer(s.client, "plain", [1.0])).status_code == 200
                    assert calls(repo, "cached") == 2 and calls(repo, "plain") == 2
                    # Errors are never cached.
                    for _ in range(2):
                        assert (await infer(s.client, "cached", [-1.0])).status_code == 500  # TritonError: INTERNAL
                    await s.state.cache.drain()
                    await other.state.fleet.cache.drain()
                    assert calls(repo, "cached") == 4
                    assert (await s.state.cache.usage())[0] == 2

                    stats = stats_of((await client2.get("/v2/models/cached/stats")).json())
                    inference = stats["inference_stats"]
                    assert inference["cache_hit"]["count"] == 1 and inference["cache_hit"]["ns"] > 0
                    assert inference["cache_miss"]["count"] == 2 and inference["cache_miss"]["ns"] > 0
                    assert inference["success"]["count"] == 3  # two computed, one from the cache
                    assert stats["execution_count"] == 2
                    metrics = (await client2.get("/metrics")).text
                    assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 1.0' in metrics
                    assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 2.0' in metrics
            finally:
                await other.state.fleet.stop()

    asyncio.run(main())


def test_the_budget_evicts_the_least_recently_used(redis_server: LocalServer, key_prefix: str,
                                                   tmp_path: Path) -> None:
    repo = repository(tmp_path)

    async def main() -> None:
        # One reply of 8 floats is 64 bytes encoded: room for three.
        async with in_process_system(redis_server.url, key_prefix, [repo], cache_config="local,size=200") as s:
            async def ask(x: float) -> None:
                assert (await infer(s.client, "cached", [x] * 8)).status_code == 200
                await s.state.cache.drain()

            for x in (1.0, 2.0, 3.0):
                await ask(x)
            assert calls(repo, "cached") == 3
            await ask(1.0)  # a hit: 1 is now the most recently used
            await ask(4.0)  # evicts 2, the least recently used
            entries, used = await s.state.cache.usage()
            assert used <= 200 and entries == 3
            assert calls(repo, "cached") == 4
            await ask(1.0)
            assert calls(repo, "cached") == 4  # still cached
            await ask(2.0)
            assert calls(repo, "cached") == 5  # was evicted

    asyncio.run(main())


def test_metrics_text_is_valid_with_the_cache_families(redis_server: LocalServer, key_prefix: str,
                                                       tmp_path: Path) -> None:
    repo = repository(tmp_path)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            text = (await s.client.get("/metrics")).text
            assert "# TYPE nv_cache_num_hits_per_model counter" in text
            # No --cache-config: a model that enables the cache is computed every time.
            for _ in range(2):
                assert (await infer(s.client, "cached", [5.0])).status_code == 200
            assert calls(repo, "cached") == 2
            assert json.dumps(stats_of((await s.client.get("/v2/models/cached/stats")).json()))

    asyncio.run(main())
