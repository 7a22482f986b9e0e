"""The tables the status page (gateway/status_page.py) and `fleet status` (fleet/status_cli.py) both
show, as text cells with a tone: each renderer only lays them out and colours the tones its own way, so
the two views cannot drift apart. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from fleet.status_snapshot import JobStatus, ModelStatus, Snapshot, WorkerStatus

NONE = "–"  # a figure that cannot be told yet (no window, no batch executed)


class Tone(StrEnum):
    PLAIN = "plain"
    OK = "ok"
    WARN = "warn"
    BAD = "bad"
    MUTED = "muted"


@dataclass(frozen=True, slots=True)
class Cell:
    text: str
    tone: Tone = Tone.PLAIN


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    columns: tuple[str, ...]
    numeric: frozenset[int]  # right-aligned columns
    rows: tuple[tuple[Cell, ...], ...]
    empty: str  # what to say instead of an empty table


_WORKER_TONES = {"ready": Tone.OK, "idle": Tone.MUTED, "loading": Tone.WARN, "unhealthy": Tone.BAD, "gone": Tone.BAD}
_JOB_TONES = {"completed": Tone.OK, "running": Tone.WARN, "queued": Tone.MUTED, "failed": Tone.BAD,
              "cancelled": Tone.MUTED}


def number(value: float | None, digits: int = 1) -> str:
    return NONE if value is None else f"{value:,.{digits}f}"


def age(seconds: float | None) -> str:
    if seconds is None:
        return NONE
    if seconds < 60:
        return f"{seconds:.1f} s ago"
    return f"{seconds / 60:.0f} min ago"


def clock(at_ms: int) -> str:
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def units_text(worker: WorkerStatus) -> str:
    """The model versions a worker holds, each with its state unless READY."""
    parts = [f"{u.model} v{u.version}" + ("" if u.state == "READY" else f" ({u.state.lower()})") for u in worker.units]
    parts += [f"{m} (failed)" for m in worker.failed]
    return ", ".join(parts) or NONE


def worker_row(w: WorkerStatus) -> tuple[Cell, ...]:
    tone = _WORKER_TONES.get(w.state, Tone.PLAIN)
    return (Cell(w.id), Cell(w.host or NONE), Cell(NONE if w.pid is None else str(w.pid)), Cell(w.device or NONE),
            Cell(w.state, tone), Cell(age(w.heartbeat_age_s), Tone.BAD if w.state == "gone" else Tone.PLAIN),
            Cell(units_text(w)), Cell(str(w.queued)))


def _ready_cell(m: ModelStatus) -> Cell:
    if m.ready:
        return Cell(", ".join(f"v{v}" for v in m.ready_versions), Tone.OK)
    return Cell(m.reason or "not ready", Tone.MUTED if m.reason == "unloaded" else Tone.BAD)


def lanes_text(m: ModelStatus) -> str:
    return " · ".join(f"{lane.lane} {lane.waiting}" for lane in m.lanes) or NONE


def model_row(m: ModelStatus) -> tuple[Cell, ...]:
    rate, c = m.rate, m.counters
    waiting_tone = Tone.WARN if m.waiting else Tone.PLAIN
    return (Cell(m.name), _ready_cell(m), Cell(lanes_text(m), waiting_tone), Cell(str(m.held)), Cell(str(m.in_flight)),
            Cell(number(None if rate is None else rate.requests_per_s)),
            Cell(number(None if rate is None else rate.inferences_per_s)),
            Cell(number(None if rate is None else rate.batch_size, 2)), Cell(number(c.mean_batch_size, 2)),
            Cell(number(c.mean_latency_ms, 2)), Cell(f"{c.success:,}"),
            Cell(f"{c.failed:,}", Tone.BAD if c.failed else Tone.PLAIN),
            Cell(f"{m.dead_letters:,}", Tone.BAD if m.dead_letters else Tone.PLAIN))


def job_row(j: JobStatus) -> tuple[Cell, ...]:
    total = "?" if j.total is None else f"{j.total:,}"
    percent = f" ({100 * j.done / j.total:.0f}%)" if j.total else ""
    return (Cell(j.id), Cell(j.model), Cell(j.state, _JOB_TONES.get(j.state, Tone.PLAIN)),
            Cell(f"{j.done:,}/{total}{percent}"), Cell(f"{j.failed:,}", Tone.BAD if j.failed else Tone.PLAIN),
            Cell(number(j.items_per_s)))


def tables(snapshot: Snapshot) -> tuple[Table, Table, Table]:
    """Workers, models and jobs, in that order."""
    window = NONE if snapshot.window_s is None else f"{snapshot.window_s:.1f} s"
    return (
        Table("Workers", ("worker", "host", "pid", "device", "state", "heartbeat", "models", "queued"),
              frozenset({2, 7}), tuple(worker_row(w) for w in snapshot.workers), "no worker has sent a heartbeat"),
        Table(f"Models (rates over the last {window})",
              ("model", "ready", "waiting per lane", "held", "in flight", "req/s", "inf/s", "batch now",
               "batch avg", "latency ms", "ok", "failed", "dead"),
              frozenset(range(3, 13)), tuple(model_row(m) for m in snapshot.models), "no model in the repository"),
        Table("Bulk jobs (newest first)", ("job", "model", "state", "progress", "failed", "items/s"),
              frozenset({3, 4, 5}), tuple(job_row(j) for j in snapshot.jobs), "no bulk job"),
    )


def summary(snapshot: Snapshot) -> tuple[tuple[str, str], ...]:
    """The headline figures: (label, value) pairs."""
    total = snapshot.rate_total()
    live = sum(w.state != "gone" for w in snapshot.workers)
    running = sum(j.state in ("running", "queued") for j in snapshot.jobs)
    return (("workers", str(live)), ("models ready", f"{sum(m.ready for m in snapshot.models)}/{len(snapshot.models)}"),
            ("req/s", number(None if total is None else total.requests_per_s)),
            ("waiting", f"{sum(m.waiting for m in snapshot.models):,}"),
            ("in flight", f"{sum(m.in_flight for m in snapshot.models):,}"), ("active jobs", str(running)))
