"""BLS (workers/bls.py) with a real worker and real stubs: sync and async calls through the callees'
streams, the callee's error reaching the caller, calls batching with the callee's direct traffic, a
model calling itself (nested instances) and a cycle, both up to FLEET_BLS_MAX_DEPTH and refused past it
with the chain in the error."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

from fleet.redis_server import LocalServer
from tests.support.system import in_process_system

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "composition_models"


def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    repo.mkdir()
    for name in ("bls_sync", "bls_async", "torch_add_sub", "countdown"):
        shutil.copytree(MODELS / name, repo / name)
    shutil.copytree(ROOT / "model_repository" / "add_sub", repo / "add_sub")
    # A cycle: ping calls pong calls ping ..., the same model code under two names.
    for name, other in (("ping", "pong"), ("pong", "ping")):
        shutil.copytree(MODELS / "countdown", repo / name)
        config = (repo / name / "config.pbtxt").read_text().replace('string_value: "countdown"',
                                                                     f'string_value: "{other}"')
        (repo / name / "config.pbtxt").write_text(config)
    return repo


def add_sub_body(model: str | None = None) -> dict[str, Any]:
    inputs: list[dict[str, Any]] = [
        {"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1.0, 2.0, 3.0, 4.0]},
        {"name": "INPUT1", "datatype": "FP32", "shape": [4], "data": [0.5, 0.5, 0.5, 0.5]},
    ]
    if model is not None:
        inputs.insert(0, {"name": "MODEL_NAME", "datatype": "BYTES", "shape": [1], "data": [model]})
    return {"inputs": inputs}


def outputs(doc: dict[str, Any]) -> dict[str, list[float]]:
    return {o["name"]: o["data"] for o in doc["outputs"]}


def countdown(n: int) -> dict[str, Any]:
    return {"inputs": [{"name": "N", "datatype": "INT32", "shape": [1], "data": [n]}]}


def test_bls_calls_through_the_queue(redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repository(tmp_path)], bls_max_depth=4) as s:
            want = {"OUTPUT0": [1.5, 2.5, 3.5, 4.5], "OUTPUT1": [0.5, 1.5, 2.5, 3.5]}
            for callee in ("add_sub", "torch_add_sub"):
                r = await s.client.post("/v2/models/bls_sync/infer", json=add_sub_body(callee))
                assert r.status_code == 200, r.text
                assert outputs(r.json()) == want
            r = await s.client.post("/v2/models/bls_async/infer", json=add_sub_body())
            assert r.status_code == 200, r.text
            assert outputs(r.json()) == want

            # The callee's error reaches the model, which fails its request with it.
            r = await s.client.post("/v2/models/bls_sync/infer", json=add_sub_body("no_such_model"))
            assert r.status_code == 500 and "'no_such_model' is not found" in r.json()["error"], r.text
            r = await s.client.post("/v2/models/bls_sync/infer", json=add_sub_body("countdown"))
            assert r.status_code == 500 and "unexpected inference input 'INPUT0'" in r.json()["error"], r.text

            # BLS calls are requests on add_sub's stream: they count in its statistics with direct calls.
            before = (await s.client.get("/v2/models/add_sub/stats")).json()["model_stats"][0]["inference_count"]
            replies = await asyncio.gather(*[s.client.post(f"/v2/models/{m}/infer", json=body)
                                             for m, body in [("bls_sync", add_sub_body("add_sub")),
                                                             ("add_sub", add_sub_body())] * 5])
            assert all(r.status_code == 200 and outputs(r.json()) == want for r in replies)
            after = (await s.client.get("/v2/models/add_sub/stats")).json()["model_stats"][0]["inference_count"]
            assert after - before == 10

            # A model calling itself: each level waits on the one below, each runs on its own instance.
            r = await s.client.post("/v2/models/countdown/infer", json=countdown(3))
            assert r.status_code == 200, r.text
            assert outputs(r.json())["DEPTH"] == [3]
            # A cycle of two models, as deep as the limit allows (4 models waiting at most).
            r = await s.client.post("/v2/models/ping/infer", json=countdown(4))
            assert r.status_code == 200, r.text
            assert outputs(r.json())["DEPTH"] == [4]
            # One deeper is refused, with the chain in the error, and the request still gets its answer.
            r = await s.client.post("/v2/models/countdown/infer", json=countdown(5))
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert "FLEET_BLS_MAX_DEPTH" in error and "countdown:1 -> countdown:1" in error, error
            # And the worker still serves everything after all this.
            r = await s.client.post("/v2/models/add_sub/infer", json=add_sub_body())
            assert r.status_code == 200 and outputs(r.json()) == want

    asyncio.run(main())


def test_concurrent_cyclic_calls_do_not_wait_for_each_others_threads(redis_server: LocalServer, key_prefix: str,
                                                                      tmp_path: Path) -> None:
    """Two instances of a model calling itself two deep at once (FLEET_BLS_MAX_DEPTH 2): both depth-1 calls
    run on nested instances while their depth-2 calls run on others. With one pool of max(2, depth) threads
    for every depth, the two depth-1 calls held both threads waiting for depth-2 calls that had none: a hang."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(MODELS / "countdown", repo / "countdown")
    config = repo / "countdown" / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1", "count: 2"))

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], bls_max_depth=2) as s:
            replies = await asyncio.wait_for(asyncio.gather(
                *[s.client.post("/v2/models/countdown/infer", json=countdown(2)) for _ in range(4)]), 60)
            assert [(r.status_code, outputs(r.json())["DEPTH"]) for r in replies] == [(200, [2])] * 4

    asyncio.run(main())


def test_a_reloaded_models_nested_instances_are_retired(tmp_path: Path, key_prefix: str) -> None:
    """Nested instances (cyclic calls) are kept per config: a call made with the config of a reload (a new
    spec) closes the idle ones of the old and starts its own, so the model's old code and config never
    answer again (they lived until the worker stopped)."""
    import struct

    from fleet.envelope import RequestEnvelope, WireTensor
    from fleet.keys import Keys
    from fleet.model_config import parse_config
    from fleet.settings import Settings
    from workers.backends.base import LoadContext
    from workers.bls import BlsService

    model_dir = tmp_path / "countdown"
    shutil.copytree(MODELS / "countdown", model_dir)
    text = (model_dir / "config.pbtxt").read_text()
    loop = asyncio.new_event_loop()
    bls = BlsService(Settings(key_prefix=key_prefix), Keys(key_prefix), None, "w", loop,  # type: ignore[arg-type]
                     lambda model, version: None)

    def context() -> LoadContext:
        return LoadContext(spec=parse_config(text, source="test", model_name="countdown"), model_dir=model_dir,
                           version=1, instance_name="countdown_0", device="cpu")

    def call(ctx: LoadContext) -> Any:
        env = RequestEnvelope(id="r", model="countdown", version=1, reply_to="x", enqueued_at_us=0,
                              inputs=[WireTensor("N", "INT32", (1,), struct.pack("<i", 0))])
        assert bls._run_nested(ctx.spec, env, 1, ctx).ok
        ((_, idle),) = bls._nested.values()
        (backend,) = idle
        return backend

    try:
        first = context()
        old = call(first)
        assert call(first) is old  # idle, reused
        new = call(context())  # the same text parsed again: another load's config
        assert new is not old and new._proc is not None
        deadline = time.monotonic() + 10  # the old one is closed aside
        while old._proc is not None:
            assert time.monotonic() < deadline, "the old config's nested instance was not closed"
            time.sleep(0.05)
    finally:
        bls.close()
        loop.close()
