"""Latency distributions in a model's stats hash (fleet/stats.py): bucket counters the workers add to in
the same script call that counts a batch, and what the gateway makes of them at scrape time (Prometheus
histograms, Triton's summary quantiles estimated from the buckets, the batch-size histogram).

Fields: `{version}:lat:{dist}:{i}` counts the requests whose `dist` duration was <= LATENCY_BOUNDS_US[i]
and above the bound before it (not cumulative: one HINCRBY per distinct bucket); index
len(LATENCY_BOUNDS_US) counts the rest (+Inf). The bounds are part of the format: changing them
re-labels what is stored, so a new set needs new field names. The sums are the existing `{dist}:ns`
fields. Pure: no I/O, no clock (the window takes `now_s`)."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# 1-2-5 per decade below 100 µs (compute_input/output and an idle queue's wait live there), then
# 1-1.5-2-3-5-7.5 per decade from 100 µs, then up to 60 s. A quantile interpolated linearly inside a
# bucket is off by at most that bucket's width: below 100 µs up to 2.5x, above it up to 50 %.
LATENCY_BOUNDS_US: tuple[int, ...] = (
    1, 2, 5, 10, 20, 50,
    *(int(m * 10 ** e) for e in range(2, 7) for m in (1, 1.5, 2, 3, 5, 7.5)),
    10_000_000, 15_000_000, 20_000_000, 30_000_000, 60_000_000,
)
# Triton's statistics names; "request" is the end-to-end time of successful requests ("success").
DISTRIBUTIONS = ("request", "queue", "compute_input", "compute_infer", "compute_output")
SUM_FIELDS = {"request": "success:ns", "queue": "queue:ns", "compute_input": "compute_input:ns",
              "compute_infer": "compute_infer:ns", "compute_output": "compute_output:ns"}
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUANTILES = (0.5, 0.9, 0.95, 0.99)


def bucket_index(value_us: int) -> int:
    """The bucket that `value_us` falls in (len(LATENCY_BOUNDS_US): +Inf)."""
    return bisect.bisect_left(LATENCY_BOUNDS_US, value_us)


def bucket_name(dist: str, value_us: int) -> str:
    """The (version-less) field of the bucket that `value_us` falls in."""
    return f"lat:{dist}:{bucket_index(value_us)}"


def bucket_deltas(dist: str, values_us: Iterable[int], weight: int = 1) -> dict[str, int]:
    """The HINCRBY deltas for `values_us` (each counted `weight` times), one per distinct bucket."""
    out: dict[str, int] = {}
    for value in values_us:
        name = bucket_name(dist, value)
        out[name] = out.get(name, 0) + weight
    return out


def bucket_counts(raw: Mapping[str, int], version: int, dist: str) -> list[int]:
    """Per-bucket (not cumulative) counts of one distribution, the last one +Inf."""
    return [raw.get(f"{version}:lat:{dist}:{i}", 0) for i in range(len(LATENCY_BOUNDS_US) + 1)]


def cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[float, int]]:
    """(upper bound, cumulative count) pairs, ending with +Inf: Prometheus's histogram buckets."""
    out: list[tuple[float, int]] = []
    total = 0
    for bound, count in zip((*bounds, math.inf), counts, strict=True):
        total += count
        out.append((float(bound), total))
    return out


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float:
    """The q-quantile of bucketed values, interpolated linearly inside its bucket (from 0 for the
    first): what PromQL's histogram_quantile does. NaN without values; a rank in the +Inf bucket gives
    the highest finite bound (the buckets cannot say more)."""
    n = sum(counts)
    if n == 0:
        return math.nan
    rank = q * n
    below = 0
    for i, count in enumerate(counts):
        if count and below + count >= rank:
            if i == len(bounds):
                return float(bounds[-1])
            lower = float(bounds[i - 1]) if i else 0.0
            return lower + (float(bounds[i]) - lower) * (rank - below) / count
        below += count
    return float(bounds[-1])


def batch_buckets(raw: Mapping[str, int], version: int) -> tuple[list[int], int]:
    """Executions per BATCH_BOUNDS bucket (not cumulative, the last +Inf) and the rows they ran, from
    the statistics extension's exact `{version}:batch:{size}:count` fields."""
    counts = [0] * (len(BATCH_BOUNDS) + 1)
    rows = 0
    prefix = f"{version}:batch:"
    for key, value in raw.items():
        if key.startswith(prefix) and key.endswith(":count"):
            size = int(key[len(prefix):-len(":count")])
            counts[bisect.bisect_left(BATCH_BOUNDS, size)] += value
            rows += size * value
    return counts, rows


@dataclass
class LatencyWindow:
    """Recent bucket counts from cumulative ones, for summary quantiles over a sliding window.

    Each call passes the cumulative counts of one series as read now; what comes back is the counts
    added since a baseline: the newest earlier reading at least `window_s` old, else the oldest one
    (the window is shorter after a start), else nothing (since start, at the first reading). Readings
    are kept at most every `every_s`, so memory is bounded by window_s / every_s per series. Counts
    that went down (the hash was deleted) start the series anew."""

    window_s: float = 60.0
    every_s: float = 5.0
    _history: dict[tuple[str, ...], deque[tuple[float, tuple[int, ...]]]] = field(default_factory=dict)
    _touched: set[tuple[str, ...]] = field(default_factory=set)

    def recent(self, key: tuple[str, ...], counts: Sequence[int], now_s: float) -> list[int]:
        now = tuple(counts)
        history = self._history.setdefault(key, deque())
        self._touched.add(key)
        if history and any(c < b for c, b in zip(now, history[-1][1], strict=True)):
            history.clear()
        while len(history) >= 2 and now_s - history[1][0] >= self.window_s:
            history.popleft()
        base = history[0][1] if history else (0,) * len(now)
        if not history or now_s - history[-1][0] >= self.every_s:
            history.append((now_s, now))
        return [c - b for c, b in zip(now, base, strict=True)]

    def forget_untouched(self) -> None:
        """Drop the series not read since the last call (a model unloaded): once per scrape."""
        self._history = {k: v for k, v in self._history.items() if k in self._touched}
        self._touched = set()
