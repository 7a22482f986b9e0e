"""The fleet at a glance (`GET /`, `GET /v2/fleet/status`, `fleet status`): one plain snapshot of the
workers, the models with their lanes and counters, and the bulk jobs; its JSON form; and throughput,
derived from two snapshots and the time between them.

Pure: no Redis, no clock. fleet/status_build.py builds a Snapshot from what a gateway read from Redis;
gateway/status_routes.py keeps a RateWindow per process; the page and the terminal view render it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerUnit:
    """One model version on one worker: READY, LOADING, UNLOADING or UNAVAILABLE (loaded, not healthy)."""

    model: str
    version: int
    state: str


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    id: str
    host: str
    pid: int | None
    device: str
    state: str  # ready, loading, unhealthy, idle, or gone (registered, heartbeat expired)
    heartbeat_age_s: float | None
    units: tuple[WorkerUnit, ...] = ()
    queued: int = 0  # requests it holds, read from its streams, not yet executing
    failed: tuple[str, ...] = ()  # models it could not load


@dataclass(frozen=True, slots=True)
class LaneDepth:
    lane: str  # "online" (or "p1".."pN" with priority levels), then "bulk"
    waiting: int  # in the lane's streams, not read by any worker yet


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative, fleet-wide, summed over the model's versions (fleet/stats.py)."""

    success: int = 0
    failed: int = 0
    rejected: int = 0  # of failed: timed out in the queue, never executed
    inferences: int = 0  # rows executed (Triton's inference_count)
    executions: int = 0  # batches executed (Triton's execution_count)
    success_ns: int = 0  # sum of the successful requests' end-to-end times

    @property
    def mean_batch_size(self) -> float | None:
        return self.inferences / self.executions if self.executions else None

    @property
    def mean_latency_ms(self) -> float | None:
        return self.success_ns / self.success / 1e6 if self.success else None


@dataclass(frozen=True, slots=True)
class Rate:
    """Throughput over a window: successful requests and inferences per second, and the mean batch size
    of the batches executed in it (None when none was)."""

    requests_per_s: float
    inferences_per_s: float
    batch_size: float | None


@dataclass(frozen=True, slots=True)
class ModelStatus:
    name: str
    versions: tuple[int, ...]
    ready_versions: tuple[int, ...]
    reason: str = ""  # why it does not serve, when it does not
    lanes: tuple[LaneDepth, ...] = ()
    held: int = 0  # read by workers, queued there, not yet executing
    in_flight: int = 0  # read by workers and not yet answered (held + executing)
    dead_letters: int = 0
    counters: Counters = field(default_factory=Counters)
    rate: Rate | None = None  # None until there is a window to measure over

    @property
    def ready(self) -> bool:
        return bool(self.ready_versions)

    @property
    def waiting(self) -> int:
        return sum(lane.waiting for lane in self.lanes)


@dataclass(frozen=True, slots=True)
class JobStatus:
    id: str
    model: str
    state: str
    done: int
    total: int | None
    failed: int
    items_per_s: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    at_ms: int  # epoch ms, the reading's time
    workers: tuple[WorkerStatus, ...] = ()
    models: tuple[ModelStatus, ...] = ()
    jobs: tuple[JobStatus, ...] = ()
    window_s: float | None = None  # what the models' rates were measured over

    def rate_total(self) -> Rate | None:
        """The fleet's throughput: the sum over the models that have a rate (None when none has)."""
        rates = [m.rate for m in self.models if m.rate is not None]
        if not rates:
            return None
        return Rate(sum(r.requests_per_s for r in rates), sum(r.inferences_per_s for r in rates), None)


# ---------------------------------------------------------------- throughput


def rate_between(before: Counters, after: Counters, elapsed_s: float) -> Rate | None:
    """The rate over `elapsed_s` between two readings of one model's counters; None when it cannot be
    told: no time passed, or a counter went down (Redis lost the stats hash, or it was flushed)."""
    if elapsed_s <= 0 or after.success < before.success or after.inferences < before.inferences \
            or after.executions < before.executions:
        return None
    executions = after.executions - before.executions
    inferences = after.inferences - before.inferences
    return Rate((after.success - before.success) / elapsed_s, inferences / elapsed_s,
                inferences / executions if executions else None)


def with_rates(before: Snapshot, after: Snapshot, elapsed_s: float) -> Snapshot:
    """`after` with each model's rate since `before`, `elapsed_s` earlier. A model `before` lacks gets
    no rate: its counters may predate the window."""
    earlier = {m.name: m.counters for m in before.models}
    models = tuple(replace(m, rate=rate_between(earlier[m.name], m.counters, elapsed_s) if m.name in earlier
                           else None) for m in after.models)
    return replace(after, models=models, window_s=elapsed_s)


class RateWindow:
    """The snapshots one process served lately, each with its monotonic time (seconds), to measure the
    next one's throughput against: the newest that is at least `min_s` old, so that clients polling
    often (a page and a terminal at once) still get a rate over a second or more, never over a few ms.
    Samples older than `max_s` are dropped: after a quiet spell the first rate is unknown, not an
    average over an hour. Not thread-safe: one per event loop."""

    def __init__(self, min_s: float = 1.0, max_s: float = 60.0, max_samples: int = 256) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self._samples: deque[tuple[float, Snapshot]] = deque(maxlen=max_samples)

    def observe(self, snapshot: Snapshot, now_s: float) -> Snapshot:
        """`snapshot` with rates (when a sample qualifies), remembered for the next calls."""
        while self._samples and now_s - self._samples[0][0] > self.max_s:
            self._samples.popleft()
        base = next((s for s in reversed(self._samples) if now_s - s[0] >= self.min_s), None)
        self._samples.append((now_s, snapshot))
        return snapshot if base is None else with_rates(base[1], snapshot, now_s - base[0])


# ---------------------------------------------------------------- JSON


def to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as JSON-able values, with the figures derived from it spelled out for readers
    other than from_json (curl, dashboards): ready, waiting, mean batch size and latency, totals."""
    doc = asdict(snapshot)
    for model, out in zip(snapshot.models, doc["models"], strict=True):
        out.update(ready=model.ready, waiting=model.waiting, mean_batch_size=model.counters.mean_batch_size,
                   mean_latency_ms=model.counters.mean_latency_ms)
    total = snapshot.rate_total()
    doc["totals"] = {"workers": sum(w.state != "gone" for w in snapshot.workers),
                     "models_ready": sum(m.ready for m in snapshot.models), "models": len(snapshot.models),
                     "rate": None if total is None else asdict(total)}
    return doc


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values or ())


def _worker(doc: Mapping[str, Any]) -> WorkerStatus:
    return WorkerStatus(
        id=str(doc["id"]), host=str(doc.get("host", "")), pid=doc.get("pid"), device=str(doc.get("device", "")),
        state=str(doc.get("state", "")), heartbeat_age_s=doc.get("heartbeat_age_s"),
        units=tuple(WorkerUnit(str(u["model"]), int(u["version"]), str(u["state"])) for u in doc.get("units", ())),
        queued=int(doc.get("queued", 0)), failed=tuple(str(f) for f in doc.get("failed", ())))


def _model(doc: Mapping[str, Any]) -> ModelStatus:
    rate = doc.get("rate")
    return ModelStatus(
        name=str(doc["name"]), versions=_ints(doc.get("versions")), ready_versions=_ints(doc.get("ready_versions")),
        reason=str(doc.get("reason", "")),
        lanes=tuple(LaneDepth(str(lane["lane"]), int(lane["waiting"])) for lane in doc.get("lanes", ())),
        held=int(doc.get("held", 0)), in_flight=int(doc.get("in_flight", 0)),
        dead_letters=int(doc.get("dead_letters", 0)),
        counters=Counters(**{k: int(v) for k, v in (doc.get("counters") or {}).items() if k in Counters.__slots__}),
        rate=None if rate is None else Rate(float(rate["requests_per_s"]), float(rate["inferences_per_s"]),
                                            rate.get("batch_size")))


def _job(doc: Mapping[str, Any]) -> JobStatus:
    total = doc.get("total")
    return JobStatus(str(doc["id"]), str(doc.get("model", "")), str(doc.get("state", "")), int(doc.get("done", 0)),
                     None if total is None else int(total), int(doc.get("failed", 0)),
                     float(doc.get("items_per_s", 0.0)))


def from_json(doc: Mapping[str, Any]) -> Snapshot:
    """The inverse of to_json (derived figures are recomputed, not read). Raises KeyError, TypeError or
    ValueError on a document of another shape."""
    return Snapshot(at_ms=int(doc["at_ms"]), workers=tuple(_worker(w) for w in doc.get("workers", ())),
                    models=tuple(_model(m) for m in doc.get("models", ())),
                    jobs=tuple(_job(j) for j in doc.get("jobs", ())), window_s=doc.get("window_s"))
