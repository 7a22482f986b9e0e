"""Decoupled Python models (workers/backends/decoupled.py) with a real worker: responses sent from
execute() and from a thread after it returned, each reaching the caller as its own reply; Triton's
generate extension (one response, and server-sent events); /infer when exactly one response results;
BLS into a decoupled model (exec(decoupled=True)); a model whose execute() raises mid-stream."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

from fleet.redis_server import LocalServer
from tests.support.system import in_process_system

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "composition_models"


def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    repo.mkdir()
    for name in ("square", "ticker", "square_sum"):
        shutil.copytree(MODELS / name, repo / name)
    return repo


def events(body: str) -> list[dict[str, Any]]:
    assert body.endswith("\n\n"), body
    chunks = body.split("\n\n")[:-1]
    assert all(c.startswith("data: ") for c in chunks), body
    return [json.loads(c[len("data: "):]) for c in chunks]


def infer_body(name: str, value: int) -> dict[str, Any]:
    return {"inputs": [{"name": name, "datatype": "INT32", "shape": [1], "data": [value]}]}


def test_decoupled_responses_reach_the_caller(redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repository(tmp_path)]) as s:
            # Sent from a thread after execute() returned; the final flag alone ends the stream.
            r = await s.client.post("/v2/models/square/generate_stream", json={"IN": 3, "id": "q1"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
            assert events(r.text) == [{"model_name": "square", "model_version": "1", "id": "q1", "OUT": 3}] * 3
            # Sent from execute(), the last response carrying the final flag.
            r = await s.client.post("/v2/models/ticker/generate_stream", json={"N": 4})
            assert [e["TICK"] for e in events(r.text)] == [0, 1, 2, 3]
            # Zero responses: an empty stream.
            r = await s.client.post("/v2/models/square/generate_stream", json={"IN": 0})
            assert r.status_code == 200 and r.text == ""

            # /generate and /infer take a decoupled model that gives exactly one response.
            r = await s.client.post("/v2/models/square/generate", json={"IN": 1})
            assert r.status_code == 200 and r.json() == {"model_name": "square", "model_version": "1", "OUT": 1}
            r = await s.client.post("/v2/models/square/generate", json={"IN": 2})
            assert r.status_code == 500 and "exactly 1 response" in r.json()["error"], r.text
            r = await s.client.post("/v2/models/square/infer", json=infer_body("IN", 1))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1], r.text
            # Its one response's output as its top classes: classified once, like any model's.
            r = await s.client.post("/v2/models/square/infer", json={
                **infer_body("IN", 1), "outputs": [{"name": "OUT", "parameters": {"classification": 1}}]})
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == ["1:0"], r.text
            r = await s.client.post("/v2/models/square/infer", json=infer_body("IN", 3))
            assert r.status_code == 500 and "produced 3 responses" in r.json()["error"], r.text

            # BLS into a decoupled model: n responses of n add up to n squared.
            r = await s.client.post("/v2/models/square_sum/infer", json=infer_body("IN", 4))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [16], r.text

            # A non-decoupled model through generate_stream: its one response as one event.
            r = await s.client.post("/v2/models/square_sum/generate_stream", json={"IN": 2})
            assert events(r.text) == [{"model_name": "square_sum", "model_version": "1", "SUM": 4}]

            # Bad generate input: a clear 400 before anything runs.
            r = await s.client.post("/v2/models/square/generate_stream", json={"IN": "three"})
            assert r.status_code == 400 and "cannot be read as INT32" in r.json()["error"], r.text
            r = await s.client.post("/v2/models/square/generate_stream", json={"NOPE": 1})
            assert r.status_code == 400 and "IN" in r.json()["error"], r.text

            # Many streams at once, each complete and in order.
            replies = await asyncio.gather(*[s.client.post("/v2/models/ticker/generate_stream", json={"N": n})
                                             for n in (1, 5, 3, 2, 6)])
            assert [[e["TICK"] for e in events(r.text)] for r in replies] == [list(range(n)) for n in (1, 5, 3, 2, 6)]

    asyncio.run(main())
