"""Prometheus metrics with Triton's names, computed at scrape time from the counters the workers keep
in Redis, so every gateway reports the fleet-wide totals: scrape any one gateway, or all of them and
take one (`max by` the series' labels), never sum across gateways.

Besides Triton's counters: latency histograms and Triton's summaries, batch sizes, pending requests
per lane, workers per model, claims and dead letters, bulk jobs, GPUs (gateway/metric_families.py).
Per gateway process, not fleet-wide: `fleet_unclaimed_replies` (the replies this gateway dropped),
`fleet_resent_requests` (the requests it sent again after Redis lost them) and the window of its
summaries' quantiles (the baseline it keeps between scrapes)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet.latency_stats import LatencyWindow
from fleet.llm_stats import ITL_BUCKETS_S, TTFT_BUCKETS_S, gauges, has_generation, histogram, llm_field
from fleet.stats import field
from gateway.custom_metrics import custom_metrics_text
from gateway.metric_families import (
    RunningJob,
    TritonCounterFamily,
    VersionRow,
    batch_family,
    delivery_families,
    gpu_families,
    job_families,
    latency_families,
    model_workers_family,
    pending_family,
    triton_headers,
)
from gateway.queue_reading import decoded, queue_reads, streams_of, take_reads, text

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_JOBS_SCANNED = 1000  # unfinished bulk jobs looked at per scrape
MAX_JOBS_LISTED = 50  # running jobs with their own progress series

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

# fleet's own per-model counters (rendered with `_total`): the rate limiter's figures (Triton exports none).
_FLEET_COUNTERS = [
    ("fleet_rate_limiter_waits", "Model executions that went through the rate limiter (acquired its resources)",
     "rate_limit:count"),
    ("fleet_rate_limiter_wait_us", "Cumulative time executions waited for rate-limiter resources, in microseconds "
     "(part of the queue time)", "rate_limit:ns"),
]

# Triton's own counters, rendered under its exact names (no `_total`).
TRITON_COUNTERS = (*(metric for metric, _, _ in _COUNTERS), "nv_inference_request_failure")


class _Snapshot(Collector):
    def __init__(self, rows: list[tuple[str, int, dict[str, int], int]], workers: int, unclaimed: int,
                 serving: dict[tuple[str, int], list[str]] | None = None, resent: int = 0) -> None:
        self.rows = rows  # (model, version, decoded stats hash, pending requests)
        self.workers = workers
        self.unclaimed = unclaimed
        self.resent = resent
        self.serving = serving or {}  # (model, version) -> live workers serving it

    def collect(self) -> Any:
        labels = ["model", "version"]
        families: list[tuple[TritonCounterFamily | CounterMetricFamily, str]] = [
            (TritonCounterFamily(metric, doc, labels), key) for metric, doc, key in _COUNTERS]
        families += [(CounterMetricFamily(metric, doc, labels=labels), key) for metric, doc, key in _FLEET_COUNTERS]
        for fam, key in families:
            for model, version, raw, _ in self.rows:
                value = raw.get(field(version, key), 0)
                fam.add_metric([model, str(version)], value // 1000 if key.endswith(":ns") else value)
            yield fam
        fail = TritonCounterFamily("nv_inference_request_failure", "Number of failed inference requests",
                                   ["model", "version", "reason"])
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
        yield CounterMetricFamily("fleet_resent_requests", "Requests this gateway sent again because Redis had lost "
                                  "them (a restart or failover that lost writes it had acknowledged)",
                                  value=self.resent)


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


class _Fleet(Collector):
    """fleet's own families (gateway/metric_families.py) over what one scrape read."""

    def __init__(self, rows: list[VersionRow], models: dict[str, dict[str, int]], dead: dict[str, int],
                 jobs: dict[str, int], running: list[RunningJob], catalog: Any, window: LatencyWindow) -> None:
        self.rows, self.models, self.dead, self.jobs, self.running = rows, models, dead, jobs, running
        self.gpus = catalog.gpus
        self.window = window

    def collect(self) -> Any:
        yield from latency_families(self.rows, self.window, time.monotonic())
        self.window.forget_untouched()
        yield batch_family(self.rows)
        yield pending_family(self.rows)
        yield model_workers_family(self.rows)
        yield from delivery_families(self.models, self.dead)
        yield from job_families(self.jobs, self.running)
        yield from gpu_families(self.gpus)


async def _running_jobs(st: Any, ids: object) -> list[RunningJob]:
    """The running ones among `ids` (at most MAX_JOBS_LISTED, by id): one more round trip, and only
    where there are unfinished jobs."""
    if not isinstance(ids, list) or not ids:
        return []
    names = sorted(text(i) for i in ids)
    pipe = st.client.pipeline(transaction=False)
    for job_id in names:
        pipe.hmget(st.keys.job(job_id), "state", "model", "done", "total")
    out = []
    for job_id, fields in zip(names, await pipe.execute(raise_on_error=False), strict=True):
        if not isinstance(fields, list) or text(fields[0]) != "running":
            continue
        total = text(fields[3])
        out.append(RunningJob(job_id, text(fields[1]), int(text(fields[2]) or 0),
                              int(total) if total.isdigit() else None))
    return out[:MAX_JOBS_LISTED]


async def metrics(request: Request, window: LatencyWindow) -> Response:
    """`nv_inference_pending_request_count` is Triton's: accepted, not yet executing, once per model
    version (the autoscaling signal): requests the workers hold, from their heartbeats, plus those no
    worker has read yet from the version's own streams; `fleet_pending_requests` is the same per lane.
    One pipelined round trip (two with unfinished bulk jobs)."""
    st = request.app.state.fleet
    catalog = st.catalog
    names = sorted(catalog.views)
    pipe = st.client.pipeline(transaction=False)
    streams = {n: streams_of(catalog, n) for n in names}
    for n in names:
        queue_reads(pipe, st.keys, n, streams[n])
    pipe.hgetall(st.keys.job_states())
    # Unfinished jobs (queued or running) are few; a random MAX_JOBS_SCANNED of them where not.
    pipe.srandmember(st.keys.jobs_unfinished(), MAX_JOBS_SCANNED)
    results = iter(await pipe.execute(raise_on_error=False))
    rows = []
    fleet_rows = []
    models: dict[str, dict[str, int]] = {}
    dead: dict[str, int] = {}
    for n in names:
        read = take_reads(results, n, streams[n])
        raw = models[n] = read.stats
        dead[n] = read.dead_letters
        for v in catalog.view(n).entry.versions:
            waiting = read.waiting(v)
            rows.append((n, v, raw, catalog.queued.get((n, v), 0) + sum(waiting)))
            by_lane = [catalog.queued_lanes.get((n, v, lane), 0) + w for lane, w in enumerate(waiting)]
            fleet_rows.append(VersionRow(n, v, raw, by_lane, len(catalog.serving.get((n, v), []))))
    jobs = decoded(next(results))
    running = await _running_jobs(st, next(results))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(rows, st.catalog.workers, st.broker.unclaimed_replies, catalog.serving,
                                st.broker.resent_requests))
    registry.register(_Fleet(fleet_rows, models, dead, jobs, running, catalog, window))
    body = triton_headers(generate_latest(registry), TRITON_COUNTERS)
    # Python models' own pb_utils metrics, under their own names (gateway/custom_metrics.py; one more round trip).
    live = {worker for ids in catalog.serving.values() for worker in ids}
    body += await custom_metrics_text(st.client, st.keys, names, live, body)
    return Response(body, media_type=CONTENT_TYPE)


def metrics_route() -> Route:
    window = LatencyWindow()  # this route's summary baselines (the main and the metrics port each have one)

    async def endpoint(request: Request) -> Response:
        return await metrics(request, window)

    return Route("/metrics", endpoint, methods=["GET"])
