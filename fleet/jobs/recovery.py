"""Queueing a bulk job's runs on RQ, and re-queueing jobs whose runner died (the job workers' janitor).

A run is one RQ job (`<job id>-run<attempt>`); the job record keeps the current run and the attempt
count, so `recover_orphans` can tell a run still waiting in the queue from one that was lost with its
job worker (killed, or dropped by a Redis outage mid-job)."""

from __future__ import annotations

import logging
import time

import redis

from fleet.jobs.records import TERMINAL, JobStore
from fleet.jobs.rq_setup import enqueue_run, fetch
from fleet.jobs.runner import JobOptions
from fleet.keys import Keys

log = logging.getLogger(__name__)

_WAITING = frozenset({"queued", "deferred", "scheduled"})  # RQ statuses of a run not yet picked up


def queue_run(client: redis.Redis, keys: Keys, options: JobOptions, job_id: str, attempt: int) -> None:
    """Queue run `attempt` of job `job_id` and record it (the record's `rq_job` and `attempts`)."""
    rq_id = enqueue_run(client, keys, job_id, attempt, options.to_json())
    JobStore(client, keys).update(job_id, {"rq_job": rq_id, "attempts": attempt})


def recover_orphans(client: redis.Redis, keys: Keys, options: JobOptions, now: float | None = None) -> list[str]:
    """Re-queue jobs that should be running but whose runner is gone; returns their ids.

    A job is orphaned when it is queued or running, nobody holds its lease, its record has not been
    updated for a lease period, and its current RQ run is not waiting in the queue (a job worker died
    with it, or RQ lost it). One job worker wins the recovery key and queues the next attempt."""
    now = time.time() if now is None else now
    store = JobStore(client, keys)
    lease_s = options.lease_ms / 1000
    recovered = []
    # Only the unfinished jobs: the history of finished ones is never read again here.
    for record in store.get_many(store.unfinished_ids()):
        job_id = record["id"]
        if record["state"] in TERMINAL:
            continue
        if client.exists(keys.job_lease(job_id)):
            continue
        last = max(record.get("updated_at") or 0, record.get("created_at") or 0)
        if now - last < lease_s:
            continue
        run = fetch(client, record["rq_job"]) if record.get("rq_job") else None
        if run is not None and run.get_status(refresh=True) in _WAITING:
            continue
        if not client.set(keys.job_recovery(job_id), "1", nx=True, px=options.lease_ms):
            continue
        attempt = int(record.get("attempts") or 0) + 1
        log.warning("job %s: its runner is gone (last progress %.0f s ago); queueing run %d",
                    job_id, now - last, attempt)
        queue_run(client, keys, options, job_id, attempt)
        store.update(job_id, {"updated_at": now})
        recovered.append(job_id)
    return recovered
