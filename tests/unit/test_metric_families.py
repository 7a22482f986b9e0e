"""gateway/metric_families.py: plain values in, Prometheus text out, read back with prometheus_client's
parser (what a Prometheus server sees)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from fleet.latency_stats import LATENCY_BOUNDS_US, LatencyWindow
from fleet.stats import CLAIMED, DEAD_LETTERED, REDELIVERED
from gateway.metric_families import (
    RunningJob,
    VersionRow,
    batch_family,
    delivery_families,
    job_families,
    latency_families,
    model_workers_family,
    pending_family,
)

Samples = dict[str, list[tuple[dict[str, str], float]]]


class _Families(Collector):
    def __init__(self, make: Callable[[], Iterable[Metric]]) -> None:
        self.make = make

    def collect(self) -> Iterable[Metric]:
        yield from self.make()


def render(make: Callable[[], Iterable[Metric]]) -> tuple[dict[str, str], Samples]:
    """(family name -> type, sample name -> [(labels, value)])."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(make))
    text = generate_latest(registry).decode()
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return types, samples


H = LATENCY_BOUNDS_US.index(100)  # the (50, 100] µs bucket


def row(raw: dict[str, int], lanes: list[int] | None = None, workers: int = 1) -> VersionRow:
    return VersionRow("m", 1, raw, lanes or [0, 0], workers)


def raw_with(dist: str, bucket_counts: dict[int, int], sum_ns: int) -> dict[str, int]:
    raw = {f"1:lat:{dist}:{i}": n for i, n in bucket_counts.items()}
    sums = {"request": "success:ns", "queue": "queue:ns", "compute_infer": "compute_infer:ns"}
    raw[f"1:{sums[dist]}"] = sum_ns
    return raw


def test_latency_histograms_are_cumulative_with_count_and_sum_in_us() -> None:
    raw = raw_with("request", {H + 1: 3, H + 6: 1, len(LATENCY_BOUNDS_US): 2}, sum_ns=500_000_000)
    types, samples = render(lambda: latency_families([row(raw)], LatencyWindow(), 0.0))
    assert types["fleet_request_duration_us"] == "histogram"
    buckets = {labels["le"]: value for labels, value in samples["fleet_request_duration_us_bucket"]}
    assert buckets["100.0"] == 0 and buckets["150.0"] == 3 and buckets["1000.0"] == 4
    assert buckets["60000000.0"] == 4 and buckets["+Inf"] == 6
    assert samples["fleet_request_duration_us_count"] == [({"model": "m", "version": "1"}, 6.0)]
    assert samples["fleet_request_duration_us_sum"] == [({"model": "m", "version": "1"}, 500_000.0)]
    assert {"fleet_queue_duration_us", "fleet_compute_infer_duration_us"} <= set(types)


def test_tritons_summaries_have_quantiles_count_and_sum() -> None:
    raw = raw_with("queue", {H + 1: 10}, sum_ns=1_250_000)  # ten requests in (100, 150] µs
    types, samples = render(lambda: latency_families([row(raw)], LatencyWindow(), 0.0))
    assert types["nv_inference_queue_summary_us"] == "summary"
    quantiles = {labels["quantile"]: value for labels, value in samples["nv_inference_queue_summary_us"]}
    assert quantiles == {"0.5": 125.0, "0.9": 145.0, "0.95": 147.5, "0.99": 149.5}
    assert samples["nv_inference_queue_summary_us_count"] == [({"model": "m", "version": "1"}, 10.0)]
    assert samples["nv_inference_queue_summary_us_sum"] == [({"model": "m", "version": "1"}, 1250.0)]
    # Nothing recorded: NaN quantiles (as an idle Triton's), zero count.
    nothing = {labels["quantile"]: value for labels, value in samples["nv_inference_request_summary_us"]}
    assert set(nothing) == {"0.5", "0.9", "0.95", "0.99"} and all(math.isnan(v) for v in nothing.values())
    assert {"nv_inference_compute_input_summary_us", "nv_inference_compute_infer_summary_us",
            "nv_inference_compute_output_summary_us"} <= set(types)


def test_summary_quantiles_cover_the_recent_window_only() -> None:
    window = LatencyWindow(window_s=60, every_s=5)
    render(lambda: latency_families([row(raw_with("request", {H + 1: 100}, 0))], window, 0.0))
    # 60 s later ten slower requests arrived; the old hundred are outside the window.
    raw = raw_with("request", {H + 1: 100, H + 12: 10}, 0)
    _, samples = render(lambda: latency_families([row(raw)], window, 60.0))
    p50 = {labels["quantile"]: value for labels, value in samples["nv_inference_request_summary_us"]}["0.5"]
    assert 7_500 < p50 <= 10_000
    assert samples["nv_inference_request_summary_us_count"][0][1] == 110  # the count stays cumulative


def test_batch_size_histogram_counts_executions_and_sums_rows() -> None:
    raw = {"1:batch:1:count": 5, "1:batch:4:count": 2, "1:batch:5:count": 1}
    _, samples = render(lambda: [batch_family([row(raw)])])
    buckets = {labels["le"]: value for labels, value in samples["fleet_batch_size_bucket"]}
    assert buckets == {"1.0": 5, "2.0": 5, "4.0": 7, "8.0": 8, "16.0": 8, "32.0": 8, "64.0": 8, "128.0": 8,
                       "256.0": 8, "+Inf": 8}
    assert samples["fleet_batch_size_count"][0][1] == 8 and samples["fleet_batch_size_sum"][0][1] == 5 + 8 + 5


def test_pending_has_one_series_per_lane_bulk_included_and_workers_per_version() -> None:
    rows = [row({}, lanes=[3, 0, 2], workers=2)]
    _, samples = render(lambda: [pending_family(rows), model_workers_family(rows)])
    assert samples["fleet_pending_requests"] == [({"model": "m", "version": "1", "lane": "0"}, 3.0),
                                                 ({"model": "m", "version": "1", "lane": "1"}, 0.0),
                                                 ({"model": "m", "version": "1", "lane": "2"}, 2.0)]
    assert samples["fleet_model_workers"] == [({"model": "m", "version": "1"}, 2.0)]


def test_claims_and_dead_letters_render_as_counters_with_total_and_a_gauge() -> None:
    models = {"a": {CLAIMED: 4, REDELIVERED: 3, DEAD_LETTERED: 1}, "b": {}}
    types, samples = render(lambda: delivery_families(models, {"a": 1, "b": 0}))
    assert types["fleet_claimed_requests"] == types["fleet_redelivered_requests"] == "counter"
    assert types["fleet_dead_lettered"] == "counter" and types["fleet_dead_letters"] == "gauge"
    assert samples["fleet_claimed_requests_total"] == [({"model": "a"}, 4.0), ({"model": "b"}, 0.0)]
    assert samples["fleet_redelivered_requests_total"] == [({"model": "a"}, 3.0), ({"model": "b"}, 0.0)]
    assert samples["fleet_dead_lettered_total"] == [({"model": "a"}, 1.0), ({"model": "b"}, 0.0)]
    assert samples["fleet_dead_letters"] == [({"model": "a"}, 1.0), ({"model": "b"}, 0.0)]


def test_jobs_per_state_and_progress_of_running_jobs() -> None:
    running = [RunningJob("j1", "m", 40, 100), RunningJob("j2", "m", 3, None)]
    _, samples = render(lambda: job_families({"queued": 2, "running": 2, "completed": 7, "failed": -1}, running))
    assert dict((labels["state"], v) for labels, v in samples["fleet_jobs"]) == {
        "queued": 2, "running": 2, "completed": 7, "failed": 0, "cancelled": 0}
    assert samples["fleet_job_items_done"] == [({"job_id": "j1", "model": "m"}, 40.0),
                                               ({"job_id": "j2", "model": "m"}, 3.0)]
    assert samples["fleet_job_items_total"] == [({"job_id": "j1", "model": "m"}, 100.0)]  # j2's not counted yet
