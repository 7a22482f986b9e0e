"""Bulk job records against a real Redis: idempotent creation, state transitions, progress with error
samples and counts, survival across a server restart with AOF, the recovery of a job whose runner died,
and what becomes of a cancelled or failed job's output."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.errors import NotFound, NotReadyYet
from fleet.jobs.records import (
    CANCELLED,
    COMPLETED,
    FAILED,
    MAX_ERROR_CHARS,
    MAX_ERROR_KINDS,
    OTHER_ERRORS,
    QUEUED,
    RUNNING,
    ErrorCounts,
    JobStore,
    check_id,
    view,
)
from fleet.jobs.recovery import recover_orphans
from fleet.jobs.rq_setup import fetch, jobs_queue
from fleet.jobs.runner import JobOptions
from fleet.keys import Keys
from fleet.redis_server import LocalServer, start_server
from gateway.jobs import service
from gateway.jobs.service import JobsContext

FIELDS = {"model": "mlp", "version": 1, "priority": 0, "input": "/x.npy", "input_kind": "array",
          "output": "/o.npy", "output_format": "npy", "max_failures": -1}


def test_create_is_idempotent_and_transitions_are_compare_and_set(redis_server: LocalServer,
                                                                 key_prefix: str) -> None:
    store = JobStore(redis.Redis.from_url(redis_server.url, protocol=2), Keys(key_prefix))
    assert store.create("job-1", FIELDS)
    assert not store.create("job-1", {**FIELDS, "model": "other"})
    record = store.get("job-1")
    assert record is not None and record["model"] == "mlp" and record["state"] == QUEUED and record["done"] == 0
    assert store.transition("job-1", RUNNING, (QUEUED,), {"started_at": 5.0})
    assert not store.transition("job-1", RUNNING, (QUEUED,))
    assert store.transition("job-1", CANCELLED, (QUEUED, RUNNING))
    assert not store.transition("job-1", COMPLETED, (RUNNING,))  # a cancelled job stays cancelled
    assert not store.transition("missing", RUNNING, (QUEUED,))
    store.update("job-1", {"done": 7, "failed": 2}, [(3, "bad"), (9, "worse")])
    assert store.errors("job-1") == [{"line": 3, "error": "bad"}, {"line": 9, "error": "worse"}]
    assert store.ids() == ["job-1"]


def test_view_reports_throughput_and_eta() -> None:
    record = {"id": "j", "state": RUNNING, "total": 1000, "done": 600, "run_done_start": 100,
              "run_started_at": 100.0, "created_at": 90.0}
    doc = view(record, [], now=110.0)
    assert doc["throughput"] == 50.0 and doc["eta_s"] == 8.0
    assert view({**record, "state": COMPLETED, "finished_at": 105.0}, [], now=200.0)["throughput"] == 100.0


@pytest.mark.parametrize("bad", ["", "a b", "../x", "x" * 65, "-x", "a.b"])
def test_job_ids_are_safe_names(bad: str) -> None:
    with pytest.raises(Exception, match="invalid job id"):
        check_id(bad)


def test_records_survive_a_restart_with_aof(tmp_path: Path) -> None:
    server = start_server(tmp_path / "data")
    try:
        store = JobStore(redis.Redis.from_url(server.url, protocol=2), Keys("aof"))
        store.create("kept", FIELDS)
        store.update("kept", {"done": 42}, [(1, "x")])
        port = server.port
    finally:
        server.stop()
    server = start_server(tmp_path / "data", port)
    try:
        store = JobStore(redis.Redis.from_url(server.url, protocol=2), Keys("aof"))
        record = store.get("kept")
        assert record is not None and record["done"] == 42 and store.errors("kept") == [{"line": 1, "error": "x"}]
    finally:
        server.stop()


def test_a_job_whose_runner_died_is_queued_again_once(redis_server: LocalServer, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)
    options = JobOptions(key_prefix, [], 64, lease_ms=1000)
    store = JobStore(client, keys)
    store.create("orphan", FIELDS)
    store.transition("orphan", RUNNING, (QUEUED,), {"created_at": time.time() - 9, "updated_at": time.time() - 5,
                                                   "attempts": 1})
    store.create("alive", FIELDS)
    store.transition("alive", RUNNING, (QUEUED,), {"created_at": time.time() - 9, "updated_at": time.time() - 5})
    client.set(keys.job_lease("alive"), "runner", px=10_000)  # its runner holds the lease
    store.create("fresh", FIELDS)  # just created: its first run is not late yet
    assert recover_orphans(client, keys, options) == ["orphan"]
    assert recover_orphans(client, keys, options) == []  # the recovery key and the queued run keep others off it
    record = store.get("orphan")
    assert record is not None and record["attempts"] == 2 and record["rq_job"] == "orphan-run2"
    run = fetch(client, "orphan-run2")
    assert run is not None and run.args == ["orphan", JobOptions(key_prefix, [], 64, 1000).to_json()]
    assert jobs_queue(client, keys).count == 1


def test_job_options_travel_as_json_and_older_runs_get_the_default_reply_timeout() -> None:
    options = JobOptions("p", ["/repo"], 64, lease_ms=1000, reply_timeout_s=2.5)
    assert JobOptions.from_json(options.to_json()) == options
    queued_before = {k: v for k, v in options.to_json().items() if k != "reply_timeout_s"}  # an RQ job queued
    assert JobOptions.from_json(queued_before).reply_timeout_s == 60.0  # by a version without the option
    older = {k: v for k, v in options.to_json().items() if k != "max_line_bytes"}
    assert JobOptions.from_json(older).max_line_bytes == 16 * 1024 * 1024


def test_error_counts_rank_messages_and_stay_bounded() -> None:
    counts = ErrorCounts()
    counts.add("shape", 3)
    counts.add("json")
    counts.add("shape")
    counts.add("x" * (MAX_ERROR_CHARS + 50))
    assert counts.most_common(2) == [("shape", 4), ("json", 1)]
    assert max(len(m) for m in counts.counts) == MAX_ERROR_CHARS + 3
    for i in range(3 * MAX_ERROR_KINDS):  # a file of garbage: every line its own message
        counts.add(f"garbage at column {i}")
    assert len(counts.counts) == MAX_ERROR_KINDS + 1 and counts.counts[OTHER_ERRORS] == 3 * MAX_ERROR_KINDS - 47
    assert ErrorCounts.from_json(counts.to_json()).counts == counts.counts
    assert ErrorCounts.from_json("not json").counts == {} and ErrorCounts.from_json(None).counts == {}
    assert counts.most_common_text("lines") == f"most common error (103 lines): {OTHER_ERRORS}"


def test_the_job_view_lists_the_most_common_errors() -> None:
    record = {"id": "j", "state": COMPLETED, "failed": 9, "error_counts": '{"a": 1, "b": 5, "c": 3}'}
    assert view(record, [])["common_errors"] == [{"error": "b", "count": 5}, {"error": "c", "count": 3},
                                                 {"error": "a", "count": 1}]
    assert view({"id": "j", "state": COMPLETED}, [])["common_errors"] == []


def job_with_output(ctx: JobsContext, job_id: str, state: str) -> Path:
    output = ctx.jobs_dir / job_id / "output.jsonl"
    output.parent.mkdir(parents=True)
    output.write_text('{"line": 1, "error": "x"}\n')
    ctx.store.create(job_id, {**FIELDS, "output": str(output), "output_format": "jsonl"})
    if state != QUEUED:
        ctx.store.transition(job_id, state, (QUEUED,))
    return output


@pytest.fixture
def ctx(redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> Iterator[JobsContext]:
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    yield JobsContext(client, Keys(key_prefix), tmp_path.resolve(), JobOptions(key_prefix, [], 16, lease_ms=1000))
    client.close()


def test_cancelling_a_job_no_runner_holds_deletes_its_output_here(ctx: JobsContext) -> None:
    orphan = job_with_output(ctx, "orphan", RUNNING)  # its job worker died: nobody else would clean up
    assert service.cancel_job(ctx, "orphan")["state"] == CANCELLED
    assert not orphan.exists() and not orphan.parent.exists()
    held = job_with_output(ctx, "held", RUNNING)
    ctx.client.set(ctx.keys.job_lease("held"), "runner", px=10_000)  # its runner deletes it when it stops
    service.cancel_job(ctx, "held")
    assert held.exists()
    with pytest.raises(NotReadyYet, match="was cancelled; its partial output was deleted"):
        service.results_path(ctx, "orphan")


def test_a_failed_jobs_output_is_served_when_it_wrote_one(ctx: JobsContext) -> None:
    output = job_with_output(ctx, "partial", RUNNING)
    ctx.store.transition("partial", FAILED, (RUNNING,))
    assert service.results_path(ctx, "partial") == (output, "jsonl")
    output.unlink()
    with pytest.raises(NotFound, match="failed without an output"):
        service.results_path(ctx, "partial")
    job_with_output(ctx, "busy", RUNNING)
    with pytest.raises(NotReadyYet, match="is running"):
        service.results_path(ctx, "busy")
