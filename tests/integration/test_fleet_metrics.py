"""fleet's metrics beyond Triton's counters, through a real worker and Redis: latency histograms and
summaries, batch sizes, pending per lane (the bulk lane included), workers per model, claims and dead
letters, bulk-job states. Scraped as Prometheus would, parsed with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from fleet.envelope import RequestEnvelope, WireTensor, encode_request
from fleet.jobs.records import CANCELLED, COMPLETED, QUEUED, RUNNING, JobStore
from fleet.keys import GROUP, Keys
from fleet.redis_server import LocalServer
from tests.support.queue_models import sleeper_repository
from tests.support.system import InProcessSystem, in_process_system
from tests.support.timed_repo import timed_repository, timed_request
from tests.support.waiting import until

MODELS = Path(__file__).resolve().parents[1] / "models"
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(s: InProcessSystem) -> Series:
    """Every sample of /metrics by (name, sorted labels)."""
    await s.state.refresh_readiness()
    text = (await s.client.get("/metrics")).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(series: Series, name: str, **labels: str) -> float:
    return series[(name, tuple(sorted(labels.items())))]



def one_row(model: str, version: int, reply_to: str, request_id: str, value_: float) -> bytes:
    env = RequestEnvelope(id=request_id, model=model, version=version,
                          inputs=[WireTensor("IN", "FP32", (1, 1), struct.pack("<f", value_))],
                          reply_to=reply_to, enqueued_at_us=0)
    return encode_request(env)


def test_latency_and_batch_size_distributions_match_the_requests_sent(redis_server: LocalServer, key_prefix: str,
                                                                      tmp_path: Path) -> None:
    repo = sleeper_repository(tmp_path, "lat", sleep_ms=30, max_batch_size=4,
                              dynamic_batching="max_queue_delay_microseconds: 5000")
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            replies = await asyncio.gather(*(s.client.post("/v2/models/lat/infer", json=body) for _ in range(10)))
            for _ in range(5):
                replies.append(await s.client.post("/v2/models/lat/infer", json=body))
            assert [r.status_code for r in replies] == [200] * 15
            mv = {"model": "lat", "version": "1"}
            series: Series = {}

            async def counted() -> bool:
                nonlocal series
                series = await scrape(s)
                return value(series, "fleet_request_duration_us_count", **mv) == 15

            await until(counted, 10, "15 requests in the request histogram", every_s=0.05)
            assert value(series, "nv_inference_request_success_total", **mv) == 15
            assert value(series, "fleet_request_duration_us_sum", **mv) == \
                value(series, "nv_inference_request_duration_us_total", **mv)
            assert value(series, "fleet_request_duration_us_bucket", le="+Inf", **mv) == 15
            # Every request slept 30 ms in its execution: none is faster, in any latency.
            assert value(series, "fleet_request_duration_us_bucket", le="20000.0", **mv) == 0
            assert value(series, "fleet_compute_infer_duration_us_bucket", le="20000.0", **mv) == 0
            assert value(series, "fleet_compute_infer_duration_us_count", **mv) == 15
            assert value(series, "fleet_queue_duration_us_count", **mv) == 15
            # Batch sizes: one observation per execution, rows summed.
            assert value(series, "fleet_batch_size_count", **mv) == value(series, "nv_inference_exec_count_total", **mv)
            assert value(series, "fleet_batch_size_sum", **mv) == value(series, "nv_inference_count_total", **mv) == 15
            assert value(series, "fleet_batch_size_count", **mv) < 15  # the ten concurrent ones did share batches
            # Triton's summaries: quantiles from the buckets, count and sum as the counters'.
            for q in ("0.5", "0.9", "0.95", "0.99"):
                assert 20_000 <= value(series, "nv_inference_request_summary_us", quantile=q, **mv) <= 60_000_000
                assert value(series, "nv_inference_compute_infer_summary_us", quantile=q, **mv) >= 20_000
            p50 = value(series, "nv_inference_request_summary_us", quantile="0.5", **mv)
            assert p50 <= value(series, "nv_inference_request_summary_us", quantile="0.99", **mv)
            assert value(series, "nv_inference_request_summary_us_count", **mv) == 15
            assert value(series, "nv_inference_queue_summary_us_sum", **mv) == \
                value(series, "nv_inference_queue_duration_us_total", **mv)
            assert not math.isnan(value(series, "nv_inference_compute_output_summary_us", quantile="0.5", **mv))
            assert value(series, "fleet_model_workers", **mv) == 1 and value(series, "fleet_workers") == 1
            assert not [name for name, _ in series if name.startswith("nv_gpu_")]  # no GPU here: no series

    asyncio.run(main())


def test_pending_requests_per_lane_with_the_bulk_lane(redis_server: LocalServer, key_prefix: str,
                                                      tmp_path: Path) -> None:
    """Lane 0 = priority level 1, lane 1 = level 2 (the default), lane 2 = bulk: while one request runs
    (5 s: the heartbeat reports read-ahead requests within a second, and both reads below must fall inside
    the run), two wait on lane 0, one on lane 1 and one on the bulk lane, whether still in Redis or read
    ahead by the worker."""
    repo = timed_repository(tmp_path, "prio", max_batch_size=1,
                            dynamic_batching="priority_levels: 2 default_priority_level: 2")
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            def post(sleep_ms: float, **params: Any) -> asyncio.Task[object]:
                body = timed_request(sleep_ms, **params)
                return asyncio.create_task(s.client.post("/v2/models/prio/infer", json=body))

            blocker = post(5000)
            await until(lambda: _executing(s, "prio"), 10, "the blocker to run", every_s=0.05)
            waiting = [post(10, priority=1), post(11, priority=1), post(12)]
            client.xadd(keys.queue("prio", 2, version=1), {b"d": one_row("prio", 1, keys.reply("test"), "bulk-1", 13)})

            async def lanes() -> dict[str, float]:
                series = await scrape(s)
                return {dict(labels)["lane"]: v for (name, labels), v in series.items()
                        if name == "fleet_pending_requests" and dict(labels)["model"] == "prio"}

            async def all_waiting() -> bool:
                return await lanes() == {"0": 2, "1": 1, "2": 1}

            await until(all_waiting, 4, "two pending on lane 0, one on lane 1, one on the bulk lane", every_s=0.05)
            series = await scrape(s)
            assert value(series, "nv_inference_pending_request_count", model="prio", version="1") == 4
            await asyncio.gather(blocker, *waiting)

            async def none_waiting() -> bool:
                return await lanes() == {"0": 0, "1": 0, "2": 0}

            await until(none_waiting, 10, "every lane empty", every_s=0.05)

    asyncio.run(main())


async def _executing(s: InProcessSystem, model: str) -> bool:
    """Whether a worker holds and has started a request of `model` (read, nothing left in Redis)."""
    r = s.state.client
    queue = s.state.keys.queue(model, 1, version=1)
    try:
        pending = await r.xpending(queue, GROUP)
    except redis.ResponseError as exc:  # no stream or group yet (asked before the request's XADD): not yet
        if "NOGROUP" not in str(exc):
            raise
        return False
    return bool(pending["pending"]) and await r.xlen(queue) == pending["pending"]


def test_claims_redeliveries_and_dead_letters_are_counted(redis_server: LocalServer, key_prefix: str,
                                                          tmp_path: Path) -> None:
    """Two requests a dead consumer read: one delivered once (claimed and computed again), one delivered
    twice already (claimed, past max_deliveries=2: dead-lettered)."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "doubler", repo / "doubler")
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)
    queue = keys.queue("doubler", version=1)
    client.xgroup_create(queue, GROUP, id="0", mkstream=True)
    for request_id in ("again", "poison"):
        client.xadd(queue, {b"d": one_row("doubler", 1, keys.reply("test"), request_id, 2.0)})
    read: Any = client.xreadgroup(GROUP, "dead-worker", {queue: ">"}, count=2)
    assert len(read[0][1]) == 2
    (first,) = client.xpending_range(queue, GROUP, "-", "+", 1)
    client.xclaim(queue, GROUP, "dead-worker", 0, [first["message_id"]])  # "poison": a second delivery
    poison_id = first["message_id"]

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], claim_idle_ms=200, claim_interval_s=0.1,
                                     max_deliveries=2) as s:
            counts: dict[str, float] = {}

            async def counted() -> bool:
                series = await scrape(s)
                counts.update({name: v for (name, labels), v in series.items()
                               if dict(labels).get("model") == "doubler" and name in (
                                   "fleet_claimed_requests_total", "fleet_redelivered_requests_total",
                                   "fleet_dead_lettered_total", "fleet_dead_letters")})
                return counts.get("fleet_dead_letters") == 1 and counts.get("fleet_claimed_requests_total") == 2

            await until(counted, 15, "both claimed and one dead-lettered", every_s=0.05)
            assert counts == {"fleet_claimed_requests_total": 2, "fleet_redelivered_requests_total": 1,
                              "fleet_dead_lettered_total": 1, "fleet_dead_letters": 1}
            letters: Any = client.xrange(keys.dead("doubler"))
            (letter,) = letters
            assert letter[1][b"id"] == poison_id

    asyncio.run(main())


def test_bulk_jobs_per_state_and_running_jobs_progress(redis_server: LocalServer, key_prefix: str,
                                                       tmp_path: Path) -> None:
    """The job records' own scripts keep the per-state counts (fleet/jobs/records.py)."""
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    store = JobStore(client, Keys(key_prefix))
    for job_id in ("done-1", "run-1", "run-2", "wait-1", "gone-1"):
        assert store.create(job_id, {"model": "doubler", "version": 1})
    assert not store.create("done-1", {"model": "doubler"})  # a resubmission counts nothing
    for job_id in ("done-1", "run-1", "run-2"):
        assert store.transition(job_id, RUNNING, (QUEUED,))
    assert store.transition("run-1", RUNNING, (QUEUED, RUNNING))  # a recovered run: still one running
    assert store.transition("done-1", COMPLETED, (RUNNING,))
    assert store.transition("gone-1", CANCELLED, (QUEUED, RUNNING))
    store.update("run-1", {"done": 40, "total": 100})
    store.update("run-2", {"done": 3})

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [MODELS], worker=False) as s:
            series = await scrape(s)
            states = {dict(labels)["state"]: v for (name, labels), v in series.items() if name == "fleet_jobs"}
            assert states == {"queued": 1, "running": 2, "completed": 1, "failed": 0, "cancelled": 1}
            assert value(series, "fleet_job_items_done", job_id="run-1", model="doubler") == 40
            assert value(series, "fleet_job_items_total", job_id="run-1", model="doubler") == 100
            assert value(series, "fleet_job_items_done", job_id="run-2", model="doubler") == 3
            assert ("fleet_job_items_total", (("job_id", "run-2"), ("model", "doubler"))) not in series
            assert not [labels for name, labels in series if name == "fleet_job_items_done"
                        and dict(labels)["job_id"] in ("wait-1", "done-1")]

    asyncio.run(main())
