"""What a finished batch (or a set of timed-out requests) adds to the model's statistics in Redis."""

from __future__ import annotations

import time

from fleet.envelope import RequestEnvelope
from fleet.stats import BatchSample
from workers.execute import BatchOutcome


def batch_sample(version: int, batched: bool, envs: list[RequestEnvelope], outcome: BatchOutcome,
                 started_us: int, now_us: int) -> BatchSample:
    ok = [e for e, r in zip(envs, outcome.replies, strict=True) if r.ok]
    bad = [e for e, r in zip(envs, outcome.replies, strict=True) if not r.ok]
    return BatchSample(
        version=version, batch_size=sum(e.batch_rows(batched) for e in ok), requests_ok=len(ok),
        requests_failed=len(bad),
        request_ns_ok=sum(now_us - e.enqueued_at_us for e in ok) * 1000,
        request_ns_failed=sum(now_us - e.enqueued_at_us for e in bad) * 1000,
        queue_ns=sum(max(0, started_us - e.enqueued_at_us) for e in ok) * 1000,
        compute_input_ns=outcome.compute_input_ns, compute_infer_ns=outcome.compute_infer_ns,
        compute_output_ns=outcome.compute_output_ns, finished_ms=int(time.time() * 1000),
    )


def rejected_samples(envs: list[RequestEnvelope], now_us: int) -> list[BatchSample]:
    """Timed-out requests count as failures (reason REJECTED) and never as executions; one per version."""
    by_version: dict[int, list[RequestEnvelope]] = {}
    for env in envs:
        by_version.setdefault(env.version, []).append(env)
    return [BatchSample(version=v, batch_size=0, requests_ok=0, requests_failed=len(group), request_ns_ok=0,
                        request_ns_failed=sum(now_us - e.enqueued_at_us for e in group) * 1000, queue_ns=0,
                        compute_input_ns=0, compute_infer_ns=0, compute_output_ns=0, finished_ms=now_us // 1000,
                        requests_rejected=len(group))
            for v, group in by_version.items()]
