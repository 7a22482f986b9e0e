"""What a finished batch (or a set of timed-out requests) adds to the model's statistics in Redis."""

from __future__ import annotations

import time

from fleet.envelope import RequestEnvelope
from fleet.stats import BatchSample
from workers.execute import BatchOutcome
from workers.held import HeldRequest


def batch_sample(version: int, held: list[HeldRequest], outcome: BatchOutcome, offset_us: int, started_us: int,
                 now_us: int) -> BatchSample:
    """`started_us` and `now_us` on this process's clock, `offset_us` Redis's from it (RedisClock.offset_us:
    each request's enqueue time is on Redis's). A request's rows are its scheduler entry's (workers/held.py)."""
    # One pass (per request of every batch): a request enqueued after `now_us` (clocks a little apart)
    # counts 0, not a negative time.
    request_us: list[int] = []
    queue_us: list[int] = []
    rows = failed = failed_us = 0
    for h, reply in zip(held, outcome.replies, strict=True):
        t = h.env.enqueued_at_us - offset_us  # enqueue_times's, in the same pass
        if reply.error_code:
            failed += 1
            failed_us += now_us - t if now_us > t else 0
            continue
        request_us.append(now_us - t if now_us > t else 0)
        queue_us.append(started_us - t if started_us > t else 0)
        rows += h.pending.rows
    return BatchSample(
        version=version, batch_size=rows, requests_ok=len(request_us),
        requests_failed=failed,
        request_ns_ok=sum(request_us) * 1000,
        request_ns_failed=failed_us * 1000,
        queue_ns=sum(queue_us) * 1000,
        compute_input_ns=outcome.compute_input_ns, compute_infer_ns=outcome.compute_infer_ns,
        compute_output_ns=outcome.compute_output_ns, finished_ms=int(time.time() * 1000),
        request_us=tuple(request_us), queue_us=tuple(queue_us), resource_wait_ns=outcome.resource_wait_ns,
        parts=tuple(outcome.parts) if rows else (),
    )


def rejected_samples(envs: list[RequestEnvelope], enqueued_us: list[int], now_us: int) -> list[BatchSample]:
    """Timed-out requests count as failures (reason REJECTED) and never as executions; one per version."""
    by_version: dict[int, list[int]] = {}
    for env, t in zip(envs, enqueued_us, strict=True):
        by_version.setdefault(env.version, []).append(t)
    return [BatchSample(version=v, batch_size=0, requests_ok=0, requests_failed=len(group), request_ns_ok=0,
                        request_ns_failed=sum(max(0, now_us - t) for t in group) * 1000, queue_ns=0,
                        compute_input_ns=0, compute_infer_ns=0, compute_output_ns=0, finished_ms=now_us // 1000,
                        requests_rejected=len(group))
            for v, group in by_version.items()]
