"""The metric families fleet adds to Triton's counters (gateway/metrics.py reads Redis; this module turns
plain values into Prometheus families, no I/O): latency histograms and Triton's summaries, the
batch-size histogram, pending requests per lane, workers per model, claims and dead letters, bulk-job
progress, GPU readings.

Triton's `nv_inference_*_summary_us` are per-process sliding windows (prometheus-cpp summaries over
the last minute or so, exact quantiles of that process's requests). Ours are fleet-wide: quantiles
estimated from the fleet's latency buckets (linear interpolation inside a bucket, so within a bucket's
width of the truth) over the counts added since this gateway's reading about `window_s` (60 s) earlier
(fleet/latency_stats.py LatencyWindow; since start at a gateway's first scrape). Their `_count` and
`_sum` are cumulative since start, as a summary's must be.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from fleet.gpu_metrics import GPU_METRICS, GpuReading, gpu_samples
from fleet.latency_stats import (
    BATCH_BOUNDS,
    LATENCY_BOUNDS_US,
    QUANTILES,
    SUM_FIELDS,
    LatencyWindow,
    batch_buckets,
    bucket_counts,
    cumulative,
    quantile,
)
from fleet.stats import CLAIMED, DEAD_LETTERED, REDELIVERED


class TritonCounterFamily(Metric):
    """A counter under Triton's exact name. prometheus_client renders a CounterMetricFamily's samples as
    `<name>_total`; Triton's (prometheus-cpp) carry no suffix, and dashboards and alerts written for
    Triton query `nv_inference_request_success`, not `nv_inference_request_success_total`. The samples
    keep the name; generate_latest still writes `_total` in the family's HELP and TYPE lines, which
    `triton_headers` puts back."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name, documentation, "counter")
        self._labelnames = tuple(labels)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.add_sample(self.name, dict(zip(self._labelnames, labels, strict=True)), value)


def triton_headers(page: bytes, names: Iterable[str]) -> bytes:
    """`# HELP name_total` / `# TYPE name_total counter` -> `name`, for the TritonCounterFamily names."""
    for name in names:
        for kind in (b"HELP", b"TYPE"):
            page = page.replace(b"# %s %s_total " % (kind, name.encode()), b"# %s %s " % (kind, name.encode()), 1)
    return page


# (metric, help, distribution)
HISTOGRAMS = (
    ("fleet_request_duration_us", "End-to-end duration of successful inference requests, in microseconds",
     "request"),
    ("fleet_queue_duration_us", "Queue duration of successful inference requests, in microseconds", "queue"),
    ("fleet_compute_infer_duration_us", "Compute inference duration of successful inference requests, in "
     "microseconds", "compute_infer"),
)
SUMMARIES = (
    ("nv_inference_request_summary_us", "Summary of inference request duration in microseconds", "request"),
    ("nv_inference_queue_summary_us", "Summary of inference queuing duration in microseconds", "queue"),
    ("nv_inference_compute_input_summary_us", "Summary of compute input duration in microseconds",
     "compute_input"),
    ("nv_inference_compute_infer_summary_us", "Summary of compute inference duration in microseconds",
     "compute_infer"),
    ("nv_inference_compute_output_summary_us", "Summary of compute output duration in microseconds",
     "compute_output"),
)
JOB_STATES = ("queued", "running", "completed", "failed", "cancelled")
MODEL_VERSION = ["model", "version"]


@dataclass(frozen=True, slots=True)
class VersionRow:
    """What the scrape read for one model version."""

    model: str
    version: int
    raw: Mapping[str, int]  # the model's decoded stats hash (shared by its versions)
    pending_by_lane: Sequence[int]  # queued, not executing, per lane (index = lane; the last is bulk)
    workers: int  # live workers advertising it ready


@dataclass(frozen=True, slots=True)
class RunningJob:
    job: str
    model: str
    done: int
    total: int | None  # unknown until the input is counted


def _le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


def latency_families(rows: Sequence[VersionRow], window: LatencyWindow, now_s: float) -> Iterator[Metric]:
    for name, doc, dist in HISTOGRAMS:
        hist = HistogramMetricFamily(name, doc, labels=MODEL_VERSION)
        for r in rows:
            buckets = cumulative(LATENCY_BOUNDS_US, bucket_counts(r.raw, r.version, dist))
            hist.add_metric([r.model, str(r.version)], [(_le(b), c) for b, c in buckets],
                            sum_value=r.raw.get(f"{r.version}:{SUM_FIELDS[dist]}", 0) // 1000)
        yield hist
    for name, doc, dist in SUMMARIES:
        summary = Metric(name, doc, "summary")
        for r in rows:
            labels = {"model": r.model, "version": str(r.version)}
            counts = bucket_counts(r.raw, r.version, dist)
            recent = window.recent((r.model, str(r.version), dist), counts, now_s)
            for q in QUANTILES:
                summary.add_sample(name, {**labels, "quantile": _le(q)},
                                   quantile(LATENCY_BOUNDS_US, recent, q))
            summary.add_sample(f"{name}_count", labels, sum(counts))
            summary.add_sample(f"{name}_sum", labels, r.raw.get(f"{r.version}:{SUM_FIELDS[dist]}", 0) // 1000)
        yield summary


def batch_family(rows: Sequence[VersionRow]) -> HistogramMetricFamily:
    hist = HistogramMetricFamily("fleet_batch_size", "Rows per model execution (successful executions)",
                                 labels=MODEL_VERSION)
    for r in rows:
        counts, total_rows = batch_buckets(r.raw, r.version)
        buckets = cumulative(BATCH_BOUNDS, counts)
        hist.add_metric([r.model, str(r.version)], [(_le(b), c) for b, c in buckets],
                        sum_value=total_rows)
    return hist


def pending_family(rows: Sequence[VersionRow]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily("fleet_pending_requests", "Requests queued and not executing, per lane (0 = the "
                              "highest priority, the last = bulk jobs): unread in Redis plus held by workers",
                              labels=[*MODEL_VERSION, "lane"])
    for r in rows:
        for lane, n in enumerate(r.pending_by_lane):
            gauge.add_metric([r.model, str(r.version), str(lane)], n)
    return gauge


def model_workers_family(rows: Sequence[VersionRow]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily("fleet_model_workers", "Live workers serving the model version (advertising it "
                              "ready)", labels=MODEL_VERSION)
    for r in rows:
        gauge.add_metric([r.model, str(r.version)], r.workers)
    return gauge


def delivery_families(models: Mapping[str, Mapping[str, int]], dead: Mapping[str, int]) -> Iterator[Metric]:
    """`models`: each model's decoded stats hash; `dead`: each model's dead-letter stream length."""
    for name, doc, key in (
            ("fleet_claimed_requests", "Requests taken over from a dead or stalled worker (XAUTOCLAIM)", CLAIMED),
            ("fleet_redelivered_requests", "Claimed requests computed again (not dead-lettered)", REDELIVERED),
            ("fleet_dead_lettered", "Requests moved to the dead-letter stream", DEAD_LETTERED)):
        counter = CounterMetricFamily(name, doc, labels=["model"])
        for model in sorted(models):
            counter.add_metric([model], models[model].get(key, 0))
        yield counter
    gauge = GaugeMetricFamily("fleet_dead_letters", "Entries in the model's dead-letter stream now",
                              labels=["model"])
    for model in sorted(dead):
        gauge.add_metric([model], dead[model])
    yield gauge


def job_families(states: Mapping[str, int], running: Sequence[RunningJob]) -> Iterator[Metric]:
    gauge = GaugeMetricFamily("fleet_jobs", "Bulk jobs per state", labels=["state"])
    for state in JOB_STATES:
        gauge.add_metric([state], max(0, states.get(state, 0)))
    yield gauge
    done = GaugeMetricFamily("fleet_job_items_done", "Items a running bulk job has finished",
                             labels=["job_id", "model"])
    total = GaugeMetricFamily("fleet_job_items_total", "Items in a running bulk job's input (once counted)",
                              labels=["job_id", "model"])
    for job in running:
        done.add_metric([job.job, job.model], job.done)
        if job.total is not None:
            total.add_metric([job.job, job.model], job.total)
    yield done
    yield total


def gpu_families(readings: Sequence[GpuReading]) -> Iterator[Metric]:
    """Triton's GPU gauges; none at all without readings (no GPU, or no NVML, on any live worker)."""
    samples = gpu_samples(readings)
    for name, doc, _ in GPU_METRICS:
        mine = [(uuid, value) for metric, uuid, value in samples if metric == name]
        if not mine:
            continue
        gauge = GaugeMetricFamily(name, doc, labels=["gpu_uuid"])
        for uuid, value in mine:
            gauge.add_metric([uuid], value)
        yield gauge
