"""`fleet analyze`'s pure part: the configurations to try, the config each one is, and the choice.

Triton's Model Analyzer (the guide's tuning step) sweeps instance counts and dynamic-batching settings
against a running server with perf_analyzer loads and names the best configuration within a latency
budget. The same here, without I/O: `plan` lists the points (the cartesian product of what to sweep, the
model's current values first), `configure` turns the model's JSON config into the one a point loads,
`best` picks among the measurements.

A point's score is its highest throughput among the concurrencies whose p99 stays within the budget (all
of them without a budget); the best point has the highest score, ties going to the lower p99 and then to
the earlier point. The current config is kept unless another beats it by more than `min_gain` (a noisy
machine must not turn a 3 % wobble into a config change).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Triton's parameter for a CPU instance's intra-op threads, per backend (pytorch: INTRA_OP_THREAD_COUNT;
# onnxruntime: intra_op_thread_count); the Python backend has none.
THREAD_PARAMETERS = {"pytorch": "INTRA_OP_THREAD_COUNT", "onnxruntime": "intra_op_thread_count"}


class SweepError(ValueError):
    """What was asked cannot be swept on this model (the CLI prints it and exits 2)."""


@dataclass(frozen=True, slots=True)
class Point:
    instances: int
    max_queue_delay_us: int | None  # None: no dynamic batching (a model that cannot batch)
    preferred: tuple[int, ...]  # preferred_batch_size; () = none
    threads: int | None  # intra-op threads per instance; None = the backend has no such setting

    def label(self) -> str:
        parts = [f"{self.instances} inst"]
        if self.max_queue_delay_us is not None:
            parts.append(f"delay {self.max_queue_delay_us} µs")
            parts.append("pref " + ("/".join(map(str, self.preferred)) if self.preferred else "-"))
        if self.threads is not None:
            parts.append(f"{self.threads} thr")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Measurement:
    point: Point
    concurrency: int
    infer_s: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    errors: int = 0


def backend_of(config: dict[str, Any]) -> str:
    backend = str(config.get("backend", ""))
    return backend or {"pytorch_libtorch": "pytorch", "onnxruntime_onnx": "onnxruntime"}.get(
        str(config.get("platform", "")), "")


def current_point(config: dict[str, Any]) -> Point:
    """The point the model's config is now (its instance count summed over its groups)."""
    groups = config.get("instance_group") or [{}]
    instances = sum(int(g.get("count", 1) or 1) for g in groups)
    dyn = config.get("dynamic_batching")
    delay = int(dyn.get("max_queue_delay_microseconds", 0) or 0) if isinstance(dyn, dict) else None
    preferred = tuple(int(x) for x in dyn.get("preferred_batch_size", [])) if isinstance(dyn, dict) else ()
    key = THREAD_PARAMETERS.get(backend_of(config))
    threads = None
    if key is not None:
        raw = (config.get("parameters") or {}).get(key, {}).get("string_value", "1")
        threads = int(raw) if str(raw).isdigit() else 1
    return Point(instances, delay, preferred, threads)


def sweeps_batching(config: dict[str, Any]) -> bool:
    """Whether the model has dynamic-batching settings to sweep (it batches, and not by sequence)."""
    return int(config.get("max_batch_size", 0) or 0) > 0 and "sequence_batching" not in config


def plan(config: dict[str, Any], instances: Sequence[int] = (), delays_us: Sequence[int] = (),
         preferred: Sequence[tuple[int, ...]] = (), threads: Sequence[int] = ()) -> list[Point]:
    """Every combination of the values given (an empty sequence keeps the current value), the current
    config's point first, no point twice. Raises SweepError where the model cannot take a value."""
    name = config.get("name", "")
    if config.get("platform") == "ensemble":
        raise SweepError(f"'{name}' is an ensemble: it has no instances or batcher of its own; analyze the models "
                         "it composes")
    if backend_of(config) == "llm":
        raise SweepError(f"'{name}' is a generative model: its engine batches by iteration (continuous batching), "
                         "not by these settings; measure it with bench/llm.py")
    now = current_point(config)
    max_batch = int(config.get("max_batch_size", 0) or 0)
    if (delays_us or preferred) and "sequence_batching" in config:
        raise SweepError(f"'{name}' uses the sequence batcher: there are no dynamic-batching settings to sweep "
                         "(sweep --instances only)")
    if (delays_us or preferred) and max_batch <= 0:
        raise SweepError(f"model '{name}' has max_batch_size 0: it cannot batch, so there are no "
                         "batching settings to sweep (sweep --instances only)")
    if threads and now.threads is None:
        raise SweepError(f"the {backend_of(config) or 'model'}'s backend has no intra-op thread setting to sweep")
    for n in instances:
        if n < 1:
            raise SweepError(f"an instance count must be at least 1, got {n}")
    for d in delays_us:
        if d < 0:
            raise SweepError(f"a queue delay must not be negative, got {d}")
    for pref in preferred:
        if any(p < 1 or p > max_batch for p in pref):
            raise SweepError(f"preferred batch sizes must lie in 1..max_batch_size ({max_batch}), got {list(pref)}")
    for t in threads:
        if t < 1:
            raise SweepError(f"a thread count must be at least 1, got {t}")
    # A model that batches gets dynamic batching at every point that sweeps it (Triton's analyzer does too).
    default_delay = now.max_queue_delay_us if now.max_queue_delay_us is not None else (
        0 if sweeps_batching(config) else None)
    axis_delays: list[int | None] = list(delays_us) or [default_delay]
    axis_threads: list[int | None] = list(threads) or [now.threads]
    points = [now]
    for n, delay, pref, thr in itertools.product(list(instances) or [now.instances], axis_delays,
                                                 list(preferred) or [now.preferred], axis_threads):
        point = Point(n, delay, pref if delay is not None else (), thr)
        if point not in points:
            points.append(point)
    return points


def configure(config: dict[str, Any], point: Point) -> dict[str, Any]:
    """The model's JSON config set to `point` (a copy; the rest unchanged). The instances become one
    group of the first group's kind: a sweep measures counts, not placements."""
    out = copy.deepcopy(config)
    groups = out.get("instance_group") or [{"kind": "KIND_CPU"}]
    first = dict(groups[0])
    first["count"] = point.instances
    first.pop("name", None)  # Triton names groups after the model; an edited group gets its own default
    out["instance_group"] = [first]
    if point.max_queue_delay_us is not None:
        dyn = dict(out.get("dynamic_batching") or {})
        dyn["max_queue_delay_microseconds"] = point.max_queue_delay_us
        if point.preferred:
            dyn["preferred_batch_size"] = list(point.preferred)
        else:
            dyn.pop("preferred_batch_size", None)
        out["dynamic_batching"] = dyn
    if point.threads is not None:
        key = THREAD_PARAMETERS[backend_of(config)]
        params = dict(out.get("parameters") or {})
        params[key] = {"string_value": str(point.threads)}
        out["parameters"] = params
    return out


def score(rows: Sequence[Measurement], budget_ms: float | None) -> Measurement | None:
    """A point's best measurement within the budget (the highest throughput; ties: the lower p99)."""
    ok = [m for m in rows if m.errors == 0 and (budget_ms is None or m.p99_ms <= budget_ms)]
    return max(ok, key=lambda m: (m.infer_s, -m.p99_ms), default=None)


def points_of(measurements: Sequence[Measurement]) -> list[Point]:
    """The points measured, in the order they were first measured (the current config first)."""
    return list(dict.fromkeys(m.point for m in measurements))


def scores(measurements: Sequence[Measurement], budget_ms: float | None) -> list[tuple[Point, Measurement | None]]:
    """Each point (points_of's order) with its score (None: nothing within the budget)."""
    return [(p, score([m for m in measurements if m.point == p], budget_ms)) for p in points_of(measurements)]


def best(measurements: Sequence[Measurement], budget_ms: float | None, min_gain: float = 0.0) -> Measurement | None:
    """The best point's best measurement; None when no measurement meets the budget. The first point
    measured is the current config: another replaces it only with a score above (1 + min_gain) times its
    own, so that noise between equal configs does not change a working config."""
    tops = [top for _, top in scores(measurements, budget_ms)]
    chosen: Measurement | None = None
    for top in tops:
        if top is not None and (chosen is None or (top.infer_s, -top.p99_ms) > (chosen.infer_s, -chosen.p99_ms)):
            chosen = top
    current = tops[0] if tops else None
    if min_gain > 0 and chosen is not None and current is not None \
            and chosen.infer_s <= current.infer_s * (1 + min_gain):
        return current
    return chosen


def estimate_s(points: int, concurrencies: int, seconds: float, warmup_s: float, load_s: float) -> float:
    """How long a sweep takes: each point is loaded once, then measured at each concurrency."""
    return points * (load_s + concurrencies * (warmup_s + seconds))
