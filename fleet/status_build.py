"""From what a gateway read in Redis to a status Snapshot (fleet/status_snapshot.py). Pure: the reading
is plain values (gateway/status_routes.py does the reading), the time is in it.

Where each figure comes from:
- workers: the registry (`fleet:workers`, id -> expiry) and each worker's heartbeat hash
  (workers/heartbeat.py, workers/control.py `report`); a registered worker whose heartbeat expired
  is shown as gone until the gateways drop it from the registry;
- a model's lanes: per version and lane, the stream's length less what the consumer group delivered
  and has not acknowledged (acknowledged entries are deleted) is what waits for a worker; the
  delivered rest is in flight (held by a worker, or executing);
- held: what the workers' heartbeats say they hold queued;
- counters: the stats hash (fleet/stats.py), summed over versions;
- jobs: the records as the jobs API shows them (fleet/jobs/records.py `view`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.status_snapshot import (
    Counters,
    JobStatus,
    LaneDepth,
    ModelStatus,
    Snapshot,
    WorkerStatus,
    WorkerUnit,
)

# stats hash field (after "<version>:") -> Counters field
_COUNTER_FIELDS = {"success:count": "success", "fail:count": "failed", "rejected:count": "rejected",
                   "inference_count": "inferences", "execution_count": "executions", "success:ns": "success_ns"}


@dataclass(frozen=True, slots=True)
class StreamReading:
    """One lane stream of one model version: XLEN, and XPENDING's count for the workers' group."""

    version: int
    lane: int
    length: int
    delivered: int

    @property
    def waiting(self) -> int:
        """Entries no worker has read yet (acknowledged entries are deleted, so the rest are delivered)."""
        return max(0, self.length - self.delivered)


@dataclass(frozen=True, slots=True)
class ModelReading:
    name: str
    versions: tuple[int, ...]
    ready_versions: tuple[int, ...]
    lanes: int  # lane count (fleet/admission.py lane_count); 0 when the gateway has no config for it
    reason: str = ""
    stats: Mapping[str, int] | None = None  # the decoded stats hash
    streams: tuple[StreamReading, ...] = ()
    dead_letters: int = 0


@dataclass(frozen=True, slots=True)
class Reading:
    now_ms: int
    heartbeat_ttl_ms: int  # to date a heartbeat that carries no time of its own (an older worker)
    registry: Mapping[str, int]  # worker id -> when its heartbeat expires (epoch ms)
    beats: Mapping[str, Mapping[str, str]]  # worker id -> its heartbeat hash; expired ones absent
    models: Sequence[ModelReading] = ()
    jobs: Sequence[Mapping[str, Any]] = ()  # fleet/jobs/records.py view(), newest first


def lane_name(lane: int, lanes: int) -> str:
    """The last lane is the bulk lane; the others are Triton's priority levels (one: "online")."""
    if lane == lanes - 1:
        return "bulk"
    return "online" if lanes == 2 else f"p{lane + 1}"


def counters_of(stats: Mapping[str, int]) -> Counters:
    sums = dict.fromkeys(_COUNTER_FIELDS.values(), 0)
    for key, value in stats.items():
        version, _, name = key.partition(":")
        if version.isdigit() and name in _COUNTER_FIELDS:
            sums[_COUNTER_FIELDS[name]] += int(value)
    return Counters(**sums)


def _json(beat: Mapping[str, str], name: str, default: Any) -> Any:
    try:
        return json.loads(beat.get(name) or "null") or default
    except ValueError:
        return default  # a worker of another fleet version: its other fields still count


def held_by_model(beats: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    held: dict[str, int] = {}
    for beat in beats.values():
        for model, per_version in _json(beat, "queued", {}).items():
            held[model] = held.get(model, 0) + sum(int(n) for n in per_version.values())
    return held


def worker_status(worker_id: str, beat: Mapping[str, str] | None, expiry_ms: int, now_ms: int,
                  ttl_ms: int) -> WorkerStatus:
    if not beat:
        return WorkerStatus(worker_id, "", None, "", "gone", max(0.0, (now_ms - expiry_ms + ttl_ms) / 1000))
    advertised = {(m[0], int(m[1])) for m in _json(beat, "models", [])}
    units = []
    for model, version, _gen, state in _json(beat, "units", []):
        if state == "READY" and (model, int(version)) not in advertised:
            state = "UNAVAILABLE"  # loaded, but its loop is not healthy (gateway/catalog.py says the same)
        units.append(WorkerUnit(model, int(version), state))
    states = {u.state for u in units}
    if "UNAVAILABLE" in states:
        state = "unhealthy"
    elif "LOADING" in states:
        state = "loading"
    else:
        state = "ready" if "READY" in states else "idle"
    beat_ms = int(beat["at_ms"]) if beat.get("at_ms", "").isdigit() else expiry_ms - ttl_ms
    pid = beat.get("pid", "")
    return WorkerStatus(
        id=worker_id, host=beat.get("host", ""), pid=int(pid) if pid.isdigit() else None,
        device=beat.get("device", ""), state=state, heartbeat_age_s=max(0.0, (now_ms - beat_ms) / 1000),
        units=tuple(units), queued=sum(sum(int(n) for n in per.values()) for per in _json(beat, "queued", {}).values()),
        failed=tuple(sorted(_json(beat, "failed", {}))))


def model_status(reading: ModelReading, held: int) -> ModelStatus:
    waiting = [0] * reading.lanes
    in_flight = 0
    for s in reading.streams:
        if 0 <= s.lane < reading.lanes:
            waiting[s.lane] += s.waiting
        in_flight += s.delivered
    return ModelStatus(
        name=reading.name, versions=reading.versions, ready_versions=reading.ready_versions, reason=reading.reason,
        lanes=tuple(LaneDepth(lane_name(i, reading.lanes), n) for i, n in enumerate(waiting)), held=held,
        in_flight=in_flight, dead_letters=reading.dead_letters, counters=counters_of(reading.stats or {}))


def job_status(view: Mapping[str, Any]) -> JobStatus:
    total = view.get("total")
    return JobStatus(str(view.get("id", "")), str(view.get("model", "")), str(view.get("state", "")),
                     int(view.get("done") or 0), None if total is None else int(total), int(view.get("failed") or 0),
                     float(view.get("throughput") or 0.0))


def build_snapshot(reading: Reading) -> Snapshot:
    """Workers sorted by id (every registered one, gone ones included), models by name, jobs as read."""
    ids = sorted(set(reading.registry) | set(reading.beats))
    workers = tuple(worker_status(i, reading.beats.get(i), reading.registry.get(i, reading.now_ms), reading.now_ms,
                                  reading.heartbeat_ttl_ms) for i in ids)
    held = held_by_model(reading.beats)
    models = tuple(model_status(m, held.get(m.name, 0)) for m in sorted(reading.models, key=lambda m: m.name))
    return Snapshot(at_ms=reading.now_ms, workers=workers, models=models,
                    jobs=tuple(job_status(j) for j in reading.jobs))
