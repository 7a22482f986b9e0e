"""fleet/latency_stats.py: bucketing, the batch's bucket deltas, quantile estimation, the recent window."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from fleet.latency_stats import (
    BATCH_BOUNDS,
    LATENCY_BOUNDS_US,
    LatencyWindow,
    batch_buckets,
    bucket_counts,
    bucket_deltas,
    bucket_name,
    cumulative,
    quantile,
)
from fleet.stats import BatchSample, field, increments

INF = len(LATENCY_BOUNDS_US)
HUNDRED = LATENCY_BOUNDS_US.index(100)


def test_bounds_are_log_spaced_from_1_us_to_60_s() -> None:
    assert LATENCY_BOUNDS_US[0] == 1 and LATENCY_BOUNDS_US[-1] == 60_000_000
    above = LATENCY_BOUNDS_US[LATENCY_BOUNDS_US.index(100):]
    assert all(b / a <= 2.5 for a, b in zip(LATENCY_BOUNDS_US, LATENCY_BOUNDS_US[1:], strict=False))
    assert all(b / a <= 2.0 for a, b in zip(above, above[1:], strict=False))
    assert list(LATENCY_BOUNDS_US) == sorted(set(LATENCY_BOUNDS_US))


def test_a_value_falls_in_the_first_bucket_whose_bound_it_does_not_exceed() -> None:
    assert bucket_name("queue", 0) == "lat:queue:0"
    assert bucket_name("queue", 1) == "lat:queue:0"
    assert bucket_name("queue", 2) == "lat:queue:1"
    assert bucket_name("queue", 100) == f"lat:queue:{HUNDRED}"
    assert bucket_name("queue", 101) == f"lat:queue:{HUNDRED + 1}"
    assert bucket_name("queue", 60_000_000) == f"lat:queue:{INF - 1}"
    assert bucket_name("queue", 60_000_001) == f"lat:queue:{INF}"  # +Inf


def test_bucket_deltas_count_each_value_once_per_weight() -> None:
    assert bucket_deltas("request", [90, 95, 1_000]) == {f"lat:request:{HUNDRED}": 2,
                                                         f"lat:request:{HUNDRED + 6}": 1}
    assert bucket_deltas("compute_infer", [120], weight=4) == {f"lat:compute_infer:{HUNDRED + 1}": 4}
    assert bucket_deltas("request", []) == {}


def sample(**overrides: object) -> BatchSample:
    values: dict[str, object] = dict(version=2, batch_size=3, requests_ok=3, requests_failed=0,
                                     request_ns_ok=0, request_ns_failed=0, queue_ns=0, compute_input_ns=50_000,
                                     compute_infer_ns=2_500_000, compute_output_ns=40_000, finished_ms=1,
                                     request_us=(3_000, 3_100, 9_000), queue_us=(10, 20, 30))
    values.update(overrides)
    return BatchSample(**values)  # type: ignore[arg-type]


def test_a_batch_adds_one_request_and_queue_count_per_request_and_its_compute_times_once_per_request() -> None:
    d = increments(sample())
    buckets = {k: v for k, v in d.items() if ":lat:" in k}
    assert buckets == {
        field(2, f"lat:request:{HUNDRED + 9}"): 1,  # 3000 µs: (2000, 3000]
        field(2, f"lat:request:{HUNDRED + 10}"): 1,  # 3100 µs: (3000, 5000]
        field(2, f"lat:request:{HUNDRED + 12}"): 1,  # 9000 µs: (7500, 10000]
        field(2, "lat:queue:3"): 1,  # 10 µs: (5, 10]
        field(2, "lat:queue:4"): 1,  # 20 µs: (10, 20]
        field(2, "lat:queue:5"): 1,  # 30 µs: (20, 50]
        field(2, "lat:compute_input:5"): 3,  # 50 µs, once per request: (20, 50]
        field(2, f"lat:compute_infer:{HUNDRED + 9}"): 3,  # 2500 µs
        field(2, "lat:compute_output:5"): 3,  # 40 µs
    }
    assert bucket_counts(d, 2, "compute_infer")[HUNDRED + 9] == 3


def test_a_batch_of_failures_or_rejections_adds_no_bucket() -> None:
    d = increments(sample(requests_ok=0, requests_failed=3, request_us=(), queue_us=()))
    assert not [k for k in d if ":lat:" in k]


def test_quantile_interpolates_inside_its_bucket() -> None:
    counts = [0] * (INF + 1)
    counts[HUNDRED + 1] = 10  # (100, 150]
    assert quantile(LATENCY_BOUNDS_US, counts, 0.5) == 125.0
    assert quantile(LATENCY_BOUNDS_US, counts, 1.0) == 150.0
    counts[HUNDRED] = 10  # (75 .. 50, 100]
    assert quantile(LATENCY_BOUNDS_US, counts, 0.25) == 75.0
    assert quantile(LATENCY_BOUNDS_US, counts, 0.75) == 125.0
    tiny = [0] * (INF + 1)
    tiny[0] = 4  # [0, 1]: a 1 µs time reads as at most 1 µs, not 50
    assert quantile(LATENCY_BOUNDS_US, tiny, 0.5) == 0.5


def test_quantile_of_nothing_is_nan_and_past_the_last_bound_is_the_last_bound() -> None:
    assert math.isnan(quantile(LATENCY_BOUNDS_US, [0] * (INF + 1), 0.5))
    counts = [0] * (INF + 1)
    counts[INF] = 1
    assert quantile(LATENCY_BOUNDS_US, counts, 0.99) == 60_000_000.0


@given(st.lists(st.integers(min_value=0, max_value=70_000_000), min_size=1, max_size=200),
       st.sampled_from([0.5, 0.9, 0.95, 0.99]))
def test_the_estimate_lies_in_the_bucket_of_the_true_quantile(values: list[int], q: float) -> None:
    counts = [0] * (INF + 1)
    for v in values:
        counts[int(bucket_name("x", v).rsplit(":", 1)[1])] += 1
    estimate = quantile(LATENCY_BOUNDS_US, counts, q)
    true = sorted(values)[max(0, math.ceil(q * len(values)) - 1)]
    i = int(bucket_name("x", true).rsplit(":", 1)[1])
    lower = LATENCY_BOUNDS_US[i - 1] if i else 0
    upper = LATENCY_BOUNDS_US[i] if i < INF else LATENCY_BOUNDS_US[-1]
    assert lower <= estimate <= upper


@given(st.lists(st.integers(min_value=0, max_value=5), min_size=INF + 1, max_size=INF + 1))
def test_quantiles_never_decrease_with_q(counts: list[int]) -> None:
    if sum(counts):
        estimates = [quantile(LATENCY_BOUNDS_US, counts, q) for q in (0.1, 0.5, 0.9, 0.95, 0.99, 1.0)]
        assert estimates == sorted(estimates)


def test_cumulative_ends_with_inf_and_the_total() -> None:
    assert cumulative((1, 2), [3, 0, 2]) == [(1.0, 3), (2.0, 3), (math.inf, 5)]


def test_batch_sizes_come_from_the_exact_batch_statistics() -> None:
    raw = {"1:batch:1:count": 3, "1:batch:3:count": 2, "1:batch:300:count": 1, "1:batch:3:compute_infer": 99,
           "2:batch:8:count": 7}
    counts, rows = batch_buckets(raw, 1)
    assert len(counts) == len(BATCH_BOUNDS) + 1
    assert counts[0] == 3 and counts[BATCH_BOUNDS.index(4)] == 2 and counts[-1] == 1 and sum(counts) == 6
    assert rows == 3 + 6 + 300


def test_the_window_reports_since_start_then_since_a_baseline_window_s_old() -> None:
    w = LatencyWindow(window_s=60, every_s=5)
    key = ("m", "1", "request")
    assert w.recent(key, [4, 0], now_s=0) == [4, 0]  # first reading: since start
    assert w.recent(key, [6, 1], now_s=15) == [2, 1]  # baseline: the reading at 0 (the oldest)
    assert w.recent(key, [7, 1], now_s=30) == [3, 1]
    assert w.recent(key, [9, 2], now_s=61) == [5, 2]  # the reading at 0 is still the newest >= 60 s old
    assert w.recent(key, [9, 9], now_s=76) == [3, 8]  # now the one at 15
    assert w.recent(key, [9, 9], now_s=77) == [3, 8]  # within every_s: not kept, same baseline


def test_the_window_starts_anew_when_counts_go_down_and_forgets_series_not_read() -> None:
    w = LatencyWindow(window_s=60, every_s=5)
    key = ("m", "1", "queue")
    w.recent(key, [10], now_s=0)
    assert w.recent(key, [3], now_s=10) == [3]  # the hash was deleted: since the new start
    w.forget_untouched()
    w.forget_untouched()  # not read since: forgotten
    assert w.recent(key, [5], now_s=20) == [5]
