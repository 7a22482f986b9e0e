"""`fleet jobs-worker` outlives Redis outages: a real valkey server (AOF) stopped and restarted on the same
port while a jobs-worker process runs: before its start, while it idles and in the middle of a job. It
never exits, and runs jobs to the right outputs once Redis is back (a job that was running resumes from
its progress record).

The subject is the jobs-worker process alone: the test plays the model worker over the real streams
(tests/support/lane_worker.py), so it can stop answering to hold a job mid-way for the outage."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from bench.procs import stop
from fleet.admission import bulk_lane
from fleet.envelope import RequestEnvelope
from fleet.jobs.records import JobStore
from fleet.keys import Keys
from fleet.repository import scan
from fleet.settings import Settings
from gateway.jobs.service import create_job, jobs_context
from tests.support.lane_worker import ANSWER, HOLD, LaneWorker, answer_all
from tests.support.processes import ROOT, Cluster

pytestmark = pytest.mark.e2e

MODELS = ROOT / "tests" / "models"
PREFIX = "outage"
ENV = {"FLEET_KEY_PREFIX": PREFIX, "FLEET_JOB_LEASE_MS": "2000"}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    repo = tmp_path / "models"
    shutil.copytree(MODELS / "doubler", repo / "doubler")
    cluster = Cluster(tmp_path, repo, ENV)
    yield cluster
    cluster.stop()


@pytest.fixture
def jobs_worker(cluster: Cluster) -> Iterator[subprocess.Popen[bytes]]:
    """One `fleet jobs-worker` process, started while Redis is not running yet."""
    log = cluster.tmp / "jobs-worker.log"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")} | cluster.env
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fleet", "jobs-worker", "--redis-url", cluster.redis_url,
                                 "--model-repository", str(cluster.repository), "--jobs-dir",
                                 str(cluster.tmp / "jobs")], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    yield proc
    stop(proc, signal.SIGTERM, timeout_s=20)


def alive(proc: subprocess.Popen[bytes], cluster: Cluster) -> None:
    log = (cluster.tmp / "jobs-worker.log").read_text(errors="replace")[-4000:]
    assert proc.poll() is None, f"the jobs-worker exited with {proc.returncode}:\n{log}"


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, cluster: Cluster,
             lane: LaneWorker | None = None, decide: Callable[[RequestEnvelope, int], str] = answer_all) -> None:
    """Until `check()`, serving the job's requests meanwhile if `lane` is given."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if lane is not None:
                lane.poll(decide)
            if check():
                return
        except redis.RedisError:
            pass
        log = (cluster.tmp / "jobs-worker.log").read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n{log}"
        time.sleep(0.02)


def submit(cluster: Cluster, x: np.ndarray) -> str:
    """A JSONL job of one doubler request per row, created as the gateway's /v2/jobs does."""
    source = cluster.tmp / f"in-{len(x)}.jsonl"
    source.write_text("".join(json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, x.shape[1]],
                                                      "data": row.tolist()}]}) + "\n" for row in x))
    settings = Settings(redis_url=cluster.redis_url, key_prefix=PREFIX, jobs_dir=cluster.tmp / "jobs",
                        model_repositories=(cluster.repository,), job_input_dirs=(cluster.tmp,), job_lease_ms=2000)
    ctx = jobs_context(redis.Redis.from_url(cluster.redis_url, protocol=2), settings)
    try:
        spec = scan([cluster.repository]).models["doubler"].spec
        record, _ = create_job(ctx, {"model": "doubler", "input": str(source)}, spec, 1)
    finally:
        ctx.client.close()
    return str(record["id"])


def record_of(cluster: Cluster, job_id: str) -> dict[str, Any]:
    client = redis.Redis.from_url(cluster.redis_url, protocol=2)
    try:
        record = JobStore(client, Keys(PREFIX)).get(job_id)
    finally:
        client.close()
    assert record is not None
    return record


def check_output(record: dict[str, Any], x: np.ndarray) -> None:
    lines = [json.loads(line) for line in Path(record["output"]).read_text().splitlines()]
    assert [d["line"] for d in lines] == list(range(1, len(x) + 1))
    np.testing.assert_array_equal(np.array([d["outputs"][0]["data"] for d in lines], dtype=np.float32), x * 2)


def rq_workers(cluster: Cluster) -> int:
    client = redis.Redis.from_url(cluster.redis_url, protocol=2)
    try:
        return int(client.scard("rq:workers"))
    finally:
        client.close()


def test_the_jobs_worker_outlives_redis_outages_and_runs_jobs_after_them(
        cluster: Cluster, jobs_worker: subprocess.Popen[bytes]) -> None:
    time.sleep(2.0)  # Redis is not there yet
    alive(jobs_worker, cluster)

    cluster.start_redis()
    assert cluster.redis is not None
    wait_for("the jobs-worker registers with RQ", lambda: rq_workers(cluster) >= 1, 15, cluster)
    cluster.redis.stop()  # while it waits for a job
    time.sleep(3.0)
    alive(jobs_worker, cluster)
    cluster.start_redis()  # same port and data dir: the AOF brings everything back
    spec = scan([cluster.repository]).models["doubler"].spec
    stream = Keys(PREFIX).queue("doubler", bulk_lane(spec), version=1)
    lane = LaneWorker(redis.Redis.from_url(cluster.redis_url, protocol=2), stream)
    x = np.random.default_rng(0).standard_normal((50, 3)).astype(np.float32)
    small = submit(cluster, x)
    wait_for("the first job completes", lambda: record_of(cluster, small)["state"] == "completed", 30, cluster, lane)
    check_output(record_of(cluster, small), x)

    big_x = np.random.default_rng(1).standard_normal((2000, 3)).astype(np.float32)
    big = submit(cluster, big_x)
    half = lane.rows + len(big_x) // 2

    def first_half(env: RequestEnvelope, sends: int) -> str:  # the rest stays queued: the job is held mid-way
        return ANSWER if lane.rows <= half else HOLD

    wait_for("the second job makes progress", lambda: record_of(cluster, big)["done"] > 0, 30, cluster, lane,
             first_half)
    at_outage = record_of(cluster, big)
    cluster.redis.stop()
    time.sleep(3.0)
    alive(jobs_worker, cluster)
    cluster.start_redis()
    assert at_outage["state"] == "running" and at_outage["done"] < len(big_x), at_outage
    wait_for("the interrupted job completes", lambda: record_of(cluster, big)["state"] == "completed", 60, cluster,
             lane)
    record = record_of(cluster, big)
    assert record["done"] == len(big_x) and record["failed"] == 0 and record["attempts"] >= 2, record
    check_output(record, big_x)
    alive(jobs_worker, cluster)
