"""Generation statistics in a model's stats hash (fleet/stats.py), the field names workers write and the
gateway reads: `{version}:llm:{name}` counters (added by every worker), histogram buckets
`{version}:llm:{ttft|itl}:{i}` (not cumulative; bucket i counts values <= bounds[i], the last one the
rest), and per-worker gauges `{version}:llm@{worker}:{name}` (summed over live workers by the reader)."""

from __future__ import annotations

from typing import Any

# vLLM's buckets (seconds), so its dashboards read fleet's histograms unchanged.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GAUGES = ("running", "waiting", "kv_used", "kv_total")
COUNTERS = ("requests", "prompt_tokens", "generation_tokens", "preemptions", "iterations", "iteration_us",
            "decode_tokens", "prefill_tokens", "cancel_requests")


def llm_field(version: int, name: str) -> str:
    return f"{version}:llm:{name}"


def gauge_field(version: int, name: str, worker: str) -> str:
    return f"{version}:llm@{worker}:{name}"


def histogram(raw: dict[str, int], version: int, name: str, bounds: tuple[float, ...]
              ) -> tuple[list[tuple[float, int]], int, float]:
    """Cumulative (upper bound, count) pairs ending with +Inf, the count and the sum in seconds."""
    out: list[tuple[float, int]] = []
    total = 0
    for i, bound in enumerate((*bounds, float("inf"))):
        total += raw.get(llm_field(version, f"{name}:{i}"), 0)
        out.append((bound, total))
    return out, raw.get(llm_field(version, f"{name}:count"), 0), raw.get(llm_field(version, f"{name}:sum_us"), 0) / 1e6


def has_generation(raw: dict[str, int], version: int) -> bool:
    return llm_field(version, "requests") in raw


def gauges(raw: dict[str, int], version: int, workers: set[str] | None) -> dict[str, int]:
    """Each gauge summed over `workers` (None: every worker that wrote one)."""
    sums = dict.fromkeys(GAUGES, 0)
    prefix = f"{version}:llm@"
    for key, value in raw.items():
        if key.startswith(prefix):
            worker, _, name = key[len(prefix):].rpartition(":")
            if name in sums and (workers is None or worker in workers):
                sums[name] += value
    return sums


def render_generation(raw: dict[str, int], version: int, workers: set[str] | None) -> dict[str, Any]:
    """The `generation` object of a model's /stats entry."""
    out: dict[str, Any] = {name: raw.get(llm_field(version, name), 0) for name in COUNTERS}
    out["finished"] = {why: raw.get(llm_field(version, f"finished:{why}"), 0)
                       for why in ("length", "stop", "cancelled", "expired")}
    for name, bounds in (("ttft", TTFT_BUCKETS_S), ("itl", ITL_BUCKETS_S)):
        buckets, count, total = histogram(raw, version, name, bounds)
        out[name] = {"count": count, "sum_s": round(total, 6),
                     "buckets": [{"le": "+Inf" if b == float("inf") else b, "count": c} for b, c in buckets]}
    out.update(gauges(raw, version, workers))
    return out
