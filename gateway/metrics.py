"""Prometheus metrics with Triton's names, computed at scrape time from the counters the workers keep
in Redis, so every gateway reports the fleet-wide totals (no per-process state to aggregate)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet.admission import lane_count
from fleet.keys import GROUP
from fleet.stats import field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = [
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", "success:count"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", "inference_count"),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     "execution_count"),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds", "success:ns"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds", "queue:ns"),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds",
     "compute_input:ns"),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
     "compute_infer:ns"),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds",
     "compute_output:ns"),
    # The response cache (gateway/response_cache.py), per model as Triton's.
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", "cache_hit:count"),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", "cache_miss:count"),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds", "cache_hit:ns"),
    ("nv_cache_miss_duration_per_model", "Total cache miss (lookup and insert) duration per model, in microseconds",
     "cache_miss:ns"),
]


class _Snapshot(Collector):
    def __init__(self, rows: list[tuple[str, int, dict[str, int], int]], workers: int, unclaimed: int) -> None:
        self.rows = rows  # (model, version, decoded stats hash, pending requests)
        self.workers = workers
        self.unclaimed = unclaimed

    def collect(self) -> Any:
        labels = ["model", "version"]
        for metric, doc, key in _COUNTERS:
            fam = CounterMetricFamily(metric, doc, labels=labels)
            for model, version, raw, _ in self.rows:
                value = raw.get(field(version, key), 0)
                fam.add_metric([model, str(version)], value // 1000 if key.endswith(":ns") else value)
            yield fam
        fail = CounterMetricFamily("nv_inference_request_failure", "Number of failed inference requests",
                                   labels=["model", "version", "reason"])
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Instantaneous number of pending requests awaiting execution per-model.",
                                    labels=labels)
        for model, version, raw, depth in self.rows:
            rejected = raw.get(field(version, "rejected:count"), 0)
            fail.add_metric([model, str(version), "REJECTED"], rejected)
            fail.add_metric([model, str(version), "BACKEND"], raw.get(field(version, "fail:count"), 0) - rejected)
            pending.add_metric([model, str(version)], depth)
        yield fail
        yield pending
        yield GaugeMetricFamily("fleet_workers", "Live workers (fresh heartbeat)", value=self.workers)
        yield CounterMetricFamily("fleet_unclaimed_replies", "Replies this gateway received for requests no longer "
                                  "waiting: duplicates (a message computed twice after a claim), or late (after 504 "
                                  "or a disconnect); dropped", value=self.unclaimed)


def _undelivered(length: object, pending: object) -> int:
    """Entries of a lane no worker has read yet: its length less what the group has delivered and not
    acknowledged (acknowledged entries are deleted). No group yet: all of them."""
    n = int(length) if isinstance(length, int) else 0
    if isinstance(pending, dict):
        n -= int(pending.get("pending", 0))
    return max(0, n)


async def metrics(request: Request) -> Response:
    """`nv_inference_pending_request_count` is Triton's: accepted, not yet executing, once per model
    version (the autoscaling signal): requests the workers hold, from their heartbeats, plus those no
    worker has read yet from the version's own streams."""
    st = request.app.state.fleet
    catalog = st.catalog
    names = sorted(catalog.views)
    pipe = st.client.pipeline(transaction=False)
    lanes = {n: lane_count(catalog.view(n).entry.spec) for n in names}
    for n in names:
        pipe.hgetall(st.keys.stats(n))
        for v in catalog.view(n).entry.versions:
            for lane in range(lanes[n]):
                pipe.xlen(st.keys.queue(n, lane, version=v))
                pipe.xpending(st.keys.queue(n, lane, version=v), GROUP)
    results = iter(await pipe.execute(raise_on_error=False))
    rows = []
    for n in names:
        stats = next(results)
        raw = {k.decode(): int(v) for k, v in stats.items()} if isinstance(stats, dict) else {}
        for v in catalog.view(n).entry.versions:
            waiting = sum(_undelivered(next(results), next(results)) for _ in range(lanes[n]))
            rows.append((n, v, raw, catalog.queued.get((n, v), 0) + waiting))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(rows, st.catalog.workers, st.broker.unclaimed_replies))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE)


def metrics_route() -> Route:
    return Route("/metrics", metrics, methods=["GET"])
