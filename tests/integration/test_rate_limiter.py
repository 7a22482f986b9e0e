"""The rate limiter (workers/rate_limiter.py) with real workers: two models whose instances need one
resource of count 1 never execute at once; a global resource keeps two workers from executing at
once; with --rate-limit off the same models do overlap (so the check can fail)."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.errors import ConfigError
from fleet.model_spec import InstanceLimit, ResourceNeed
from fleet.redis_server import LocalServer
from fleet.settings import Settings
from tests.support.system import in_process_system
from workers.main import run_worker
from workers.rate_limiter import RateLimiter, parse_resource_flags

# Records (start, end) of every execution in spans.jsonl beside its config, after sleeping 50 ms.
MODEL = textwrap.dedent("""
    import json, time
    from pathlib import Path
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            self.log = Path(args["model_repository"]).parent / "spans.jsonl"
            self.name = args["model_name"]

        def execute(self, requests):
            start = time.time()
            time.sleep(0.05)
            with self.log.open("a") as f:
                f.write(json.dumps([self.name, start, time.time()]) + "\\n")
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                                .as_numpy())]) for r in requests]
""")


def config(resource: str) -> str:
    return ('backend: "python"\nmax_batch_size: 0\n'
            'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
            'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
            f'instance_group [ {{ count: 1, kind: KIND_CPU, rate_limiter {{ resources [ {resource} ] }} }} ]\n')


def repository(tmp_path: Path, names: list[str], resource: str) -> Path:
    repo = tmp_path / "models"
    for name in names:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL)
        (repo / name / "config.pbtxt").write_text(config(resource))
    return repo


def spans(tmp_path: Path) -> list[tuple[str, float, float]]:
    return [tuple(json.loads(line)) for line in (tmp_path / "models" / "spans.jsonl").read_text().splitlines()]  # type: ignore[misc]


def overlaps(items: list[tuple[str, float, float]]) -> int:
    ordered = sorted(items, key=lambda s: s[1])
    return sum(1 for a, b in zip(ordered, ordered[1:], strict=False) if b[1] < a[2] - 0.002)


async def burst(client: Any, names: list[str], n: int) -> None:
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    replies = await asyncio.gather(*(client.post(f"/v2/models/{name}/infer", json=body)
                                     for name in names for _ in range(n)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]


def limiter_figures(text: str) -> dict[str, dict[str, float]]:
    """fleet_rate_limiter_{waits,wait_us}_total by model, from a metrics page."""
    out: dict[str, dict[str, float]] = {"waits": {}, "wait_us": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in out:
                if sample.name == f"fleet_rate_limiter_{name}_total":
                    out[name][sample.labels["model"]] = sample.value
    return out


@pytest.mark.parametrize("rate_limit", ["execution_count", "off"])
def test_two_models_sharing_a_resource_never_execute_at_once(redis_server: LocalServer, key_prefix: str,
                                                             tmp_path: Path, rate_limit: str) -> None:
    repo = repository(tmp_path, ["a", "b"], '{ name: "R", count: 1 }')

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], rate_limit=rate_limit) as s:
            await burst(s.client, ["a", "b"], 6)
            # The rate limiter's figures per model on the metrics port: every execution went through it,
            # and with one R for two models some waited for it.
            deadline = time.monotonic() + 10
            while True:
                figures = limiter_figures((await s.client.get("/metrics")).text)
                if rate_limit == "off" or sum(figures["waits"].values()) >= 12 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            if rate_limit == "execution_count":
                assert figures["waits"] == {"a": 6, "b": 6}, figures
                # One R, two models, 50 ms executions: some batches waited out another's execution.
                assert sum(figures["wait_us"].values()) >= 50_000, figures
            else:
                assert figures == {"waits": {"a": 0, "b": 0}, "wait_us": {"a": 0, "b": 0}}

    asyncio.run(main())
    found = spans(tmp_path)
    assert len(found) >= 4 and {s[0] for s in found} == {"a", "b"}
    if rate_limit == "execution_count":
        assert overlaps(found) == 0, found
    else:
        assert overlaps(found) > 0, "without the limiter the two models run at once (else this proves nothing)"


def test_a_global_resource_holds_across_workers(redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    repo = repository(tmp_path, ["g"], '{ name: "G", global: true, count: 1 }')

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], rate_limit="execution_count") as s:
            second = Settings(**{**s.settings.model_dump(), "worker_id": "second-worker"})
            stop = asyncio.Event()
            task = asyncio.create_task(run_worker(second, "cpu", stop))
            try:
                for _ in range(100):  # both workers serve g
                    await s.state.refresh_readiness()
                    if len({u.worker for u in s.state.catalog.units if u.state == "READY"}) == 2:
                        break
                    await asyncio.sleep(0.1)
                await burst(s.client, ["g"], 12)
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert overlaps(spans(tmp_path)) == 0, spans(tmp_path)


def test_resource_counts_and_flags() -> None:
    assert parse_resource_flags(["R:4", "G:2:cpu", "H:1:cuda:0"], "cpu") == {"R": 4, "G": 2}
    with pytest.raises(ConfigError):
        parse_resource_flags(["R"], "cpu")
    limiter = RateLimiter({"R": 1}, None, "t", "w")
    with pytest.raises(ConfigError, match="needs 2"):
        limiter.register([InstanceLimit((ResourceNeed("R", 2, False),), 0)])
    limiter = RateLimiter({}, None, "t", "w")
    limiter.register([InstanceLimit((ResourceNeed("R", 2, False),), 0)])  # the default: the most asked for
    held = limiter.acquire(InstanceLimit((ResourceNeed("R", 2, False),), 0))
    limiter.release(held)
    limiter.close()
