"""Prometheus metrics with Triton's names, computed at scrape time from the counters the workers keep
in Redis, so every gateway reports the fleet-wide totals (no per-process state to aggregate)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet.admission import lane_count
from fleet.keys import GROUP
from fleet.llm_stats import ITL_BUCKETS_S, TTFT_BUCKETS_S, gauges, has_generation, histogram, llm_field
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
    def __init__(self, rows: list[tuple[str, int, dict[str, int], int]], workers: int, unclaimed: int,
                 serving: dict[tuple[str, int], list[str]] | None = None) -> None:
        self.rows = rows  # (model, version, decoded stats hash, pending requests)
        self.workers = workers
        self.unclaimed = unclaimed
        self.serving = serving or {}  # (model, version) -> live workers serving it

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
        yield from self._generation()
        yield GaugeMetricFamily("fleet_workers", "Live workers (fresh heartbeat)", value=self.workers)
        yield CounterMetricFamily("fleet_unclaimed_replies", "Replies this gateway received for requests no longer "
                                  "waiting: duplicates (a message computed twice after a claim), or late (after 504 "
                                  "or a disconnect); dropped", value=self.unclaimed)


    def _generation(self) -> Any:
        """Generative models' metrics under vLLM's names (what Triton's vLLM backend exports and LLM
        dashboards read), with Triton's model/version labels."""
        rows = [(m, v, raw) for m, v, raw, _ in self.rows if has_generation(raw, v)]
        if not rows:
            return
        labels = ["model", "version"]
        for name, doc, key, bounds in (
                ("vllm:time_to_first_token_seconds", "Time to first token in seconds", "ttft", TTFT_BUCKETS_S),
                ("vllm:time_per_output_token_seconds", "Inter-token latency in seconds", "itl", ITL_BUCKETS_S)):
            hist = HistogramMetricFamily(name, doc, labels=labels)
            for m, v, raw in rows:
                buckets, _, total = histogram(raw, v, key, bounds)
                hist.add_metric([m, str(v)], [("+Inf" if b == float("inf") else repr(b), c) for b, c in buckets],
                                sum_value=total)
            yield hist
        for name, doc, key in (("vllm:prompt_tokens", "Prompt tokens processed", "prompt_tokens"),
                               ("vllm:generation_tokens", "Generated tokens", "generation_tokens"),
                               ("vllm:num_preemptions", "Sequences preempted (KV cache full)", "preemptions")):
            counter = CounterMetricFamily(name, doc, labels=labels)
            for m, v, raw in rows:
                counter.add_metric([m, str(v)], raw.get(llm_field(v, key), 0))
            yield counter
        success = CounterMetricFamily("vllm:request_success", "Finished generations by reason",
                                      labels=[*labels, "finished_reason"])
        for m, v, raw in rows:
            for why in ("length", "stop", "cancelled", "expired"):
                success.add_metric([m, str(v), why], raw.get(llm_field(v, f"finished:{why}"), 0))
        yield success
        states = [(m, v, gauges(raw, v, set(self.serving.get((m, v), [])))) for m, v, raw in rows]
        for name, doc, key in (("vllm:num_requests_running", "Sequences in the running batch", "running"),
                               ("vllm:num_requests_waiting", "Sequences waiting in the engines", "waiting")):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            for m, v, g in states:
                gauge.add_metric([m, str(v)], g[key])
            yield gauge
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache blocks in use (1 = full)", labels=labels)
        for m, v, g in states:
            usage.add_metric([m, str(v)], g["kv_used"] / g["kv_total"] if g["kv_total"] else 0.0)
        yield usage


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
    registry.register(_Snapshot(rows, st.catalog.workers, st.broker.unclaimed_replies, catalog.serving))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE)


def metrics_route() -> Route:
    return Route("/metrics", metrics, methods=["GET"])
