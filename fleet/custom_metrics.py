"""Python models' own metrics (`pb_utils.MetricFamily` counters, gauges, histograms) as plain values:
the snapshot a stub reports, how snapshots and workers' contributions combine, and their Prometheus
text. Pure: no I/O, no clock. The stub (workers/backends/python_stub.py) reports its families to its
worker, the worker (workers/custom_metrics.py) publishes its part per model to Redis, and any gateway
(gateway/custom_metrics.py) exports the fleet's total.

As in Triton, a family is exported under the name, help and labels the model gave it: Triton adds no
`model`/`version` labels of its own (its custom_metrics example passes them in `labels`). Families are
server-wide in Triton (same name: same family, the first description kept, another kind refused); here
every stub has its own, so combining does the same: the first (by name order of the parts) help and kind
win, a same-named family of another kind is dropped.

Combining is a sum, series by series (same family name, same labels): counters, histogram buckets,
sums and counts add up, so do gauges (a fleet is one server to its users; a gauge such as "requests in
flight" or "KV blocks used" means the whole fleet's, which is what Triton shows for one server where
every instance's increments land on the one gauge). Histograms combine only with the same bucket
bounds; a series with other bounds is dropped.

Wire form (msgpack-able lists, never pickle), one entry per family:
    [name, help, kind, [[labels, value], ...]]                  counter / gauge
    [name, help, kind, [[labels, bounds, counts, sum, count], ...]]  histogram
`labels` is a list of [name, value] pairs sorted by name; `bounds` the ascending upper bounds (no +Inf);
`counts` the observations per bucket (not cumulative), one more than `bounds` (the last: above every
bound). `decode` validates and bounds what it is given: a model's metrics cannot grow a worker's memory,
Redis or a scrape without limit.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

# Caps per model (and per worker's contribution, and for the fleet's total of one model): beyond them
# families and series are dropped, in name order, so the same ones are kept every time.
MAX_FAMILIES = 64
MAX_SERIES = 1024  # over all the model's families
MAX_BUCKETS = 64  # per histogram
MAX_LABELS = 16  # per series
MAX_TEXT = 512  # characters of a label value or a help text (longer ones are cut)

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

Labels = tuple[tuple[str, str], ...]


class Kind(enum.IntEnum):
    """Triton's `pb_utils.MetricFamily` kinds, with their values."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


@dataclass(frozen=True, slots=True)
class Series:
    labels: Labels  # sorted by label name
    value: float = 0.0  # counters and gauges
    bounds: tuple[float, ...] = ()  # histograms: ascending upper bounds, +Inf implied
    counts: tuple[int, ...] = ()  # histograms: per bucket, len(bounds) + 1
    sum: float = 0.0
    count: int = 0


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    help: str
    kind: Kind
    series: tuple[Series, ...]


def valid_name(name: str) -> bool:
    """A Prometheus metric name (what Triton's registry accepts)."""
    return bool(_NAME.match(name))


def valid_label(name: str) -> bool:
    """A Prometheus label name, not one of the reserved `__` names nor `le` (histograms' own)."""
    return bool(_LABEL.match(name)) and not name.startswith("__") and name != "le"


# --- wire form ----------------------------------------------------------------------------------


def encode(families: Iterable[Family]) -> list[Any]:
    out: list[Any] = []
    for f in families:
        if f.kind == Kind.HISTOGRAM:
            rows = [[[list(p) for p in s.labels], list(s.bounds), list(s.counts), s.sum, s.count] for s in f.series]
        else:
            rows = [[[list(p) for p in s.labels], s.value] for s in f.series]
        out.append([f.name, f.help, int(f.kind), rows])
    return out


def decode(raw: object) -> list[Family]:
    """Families from their wire form, sorted by name, bounded by the caps above; entries that are
    malformed (bad names, kinds, numbers, a negative counter) are dropped, never raised on."""
    if not isinstance(raw, list):
        return []
    families: dict[str, Family] = {}
    for entry in raw:
        family = _family(entry)
        if family is not None and family.name not in families:
            families[family.name] = family
    return _bounded(families[n] for n in sorted(families))


def _family(entry: object) -> Family | None:
    if not (isinstance(entry, list) and len(entry) == 4):
        return None
    name, help_text, kind, rows = entry
    if not (isinstance(name, str) and valid_name(name) and isinstance(help_text, str) and isinstance(rows, list)):
        return None
    try:
        kind = Kind(kind)
    except ValueError:
        return None
    series: dict[Labels, Series] = {}
    for row in rows:
        s = _series(kind, row)
        if s is not None:
            series.setdefault(s.labels, s)
    return Family(name, help_text[:MAX_TEXT], kind, tuple(series[k] for k in sorted(series)))


def _labels(raw: object) -> Labels | None:
    if not isinstance(raw, list) or len(raw) > MAX_LABELS:
        return None
    pairs: dict[str, str] = {}
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], str)):
            return None
        if not valid_label(pair[0]) or pair[0] in pairs:
            return None
        pairs[pair[0]] = pair[1][:MAX_TEXT]
    return tuple(sorted(pairs.items()))


def _number(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if not math.isnan(x) else None


def _series(kind: Kind, row: object) -> Series | None:
    if not isinstance(row, list) or not row:
        return None
    labels = _labels(row[0])
    if labels is None:
        return None
    if kind != Kind.HISTOGRAM:
        value = _number(row[1]) if len(row) == 2 else None
        if value is None or (kind == Kind.COUNTER and value < 0):
            return None
        return Series(labels, value)
    if len(row) != 5 or not isinstance(row[1], list) or not isinstance(row[2], list):
        return None
    bounds = [_number(b) for b in row[1]]
    counts = row[2]
    total, count = _number(row[3]), row[4]
    if (len(bounds) > MAX_BUCKETS or len(counts) != len(bounds) + 1 or total is None
            or not isinstance(count, int) or count < 0):
        return None
    if any(b is None or math.isinf(b) for b in bounds) or any(not isinstance(c, int) or c < 0 for c in counts):
        return None
    floats = tuple(b for b in bounds if b is not None)
    if any(a >= b for a, b in zip(floats, floats[1:], strict=False)):
        return None
    return Series(labels, bounds=floats, counts=tuple(counts), sum=total, count=count)


def _bounded(families: Iterable[Family]) -> list[Family]:
    out: list[Family] = []
    room = MAX_SERIES
    for f in families:
        if len(out) == MAX_FAMILIES or room == 0:
            break
        kept = f.series[:room]
        room -= len(kept)
        out.append(f if len(kept) == len(f.series) else replace(f, series=kept))
    return out


# --- combining ----------------------------------------------------------------------------------


def combine(parts: Iterable[Sequence[Family]], bounded: bool = True) -> list[Family]:
    """The sum of several parts (stubs of one worker, or workers of the fleet), series by series;
    sorted by family name and labels, bounded by the caps (one model's parts; `bounded=False` for the
    sum of models each already bounded). The first part to name a family sets its help and kind; a
    same-named family of another kind, or a histogram series with other bounds, in a later part is
    dropped."""
    heads: dict[str, Family] = {}
    merged: dict[str, dict[Labels, Series]] = {}
    for part in parts:
        for f in part:
            head = heads.setdefault(f.name, f)
            if head.kind != f.kind:
                continue
            into = merged.setdefault(f.name, {})
            for s in f.series:
                have = into.get(s.labels)
                into[s.labels] = s if have is None else _add(head.kind, have, s)
    families = [Family(n, heads[n].help, heads[n].kind, tuple(merged[n][k] for k in sorted(merged[n])))
                for n in sorted(heads)]
    return _bounded(families) if bounded else families


def _add(kind: Kind, a: Series, b: Series) -> Series:
    if kind != Kind.HISTOGRAM:
        return replace(a, value=a.value + b.value)
    if a.bounds != b.bounds:
        return a
    counts = tuple(x + y for x, y in zip(a.counts, b.counts, strict=True))
    return replace(a, counts=counts, sum=a.sum + b.sum, count=a.count + b.count)


def lasting(families: Iterable[Family]) -> list[Family]:
    """What a stopped stub or a dead worker leaves behind: its counters and histograms (so the fleet's
    totals never go backwards), not its gauges (a value of a process that is gone means nothing)."""
    return [f for f in families if f.kind != Kind.GAUGE]


# --- Prometheus text ----------------------------------------------------------------------------


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number_text(x: float) -> str:
    """As Triton's exporter writes numbers: integral values without a fraction (`3`, `0`), others
    exactly (`7.55`), and Prometheus's spellings of infinities."""
    x = float(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


def _sample(name: str, labels: Labels, value: float, le: str | None = None) -> str:
    pairs = [f'{k}="{_escape_value(v)}"' for k, v in labels]
    if le is not None:
        pairs.append(f'le="{le}"')
    inner = "{" + ",".join(pairs) + "}" if pairs else ""
    return f"{name}{inner} {_number_text(value)}\n"


def sample_names(family: Family) -> tuple[str, ...]:
    """The names a family's samples take in the text format."""
    if family.kind == Kind.HISTOGRAM:
        return family.name, f"{family.name}_bucket", f"{family.name}_count", f"{family.name}_sum"
    return (family.name,)


def render(families: Iterable[Family], taken: frozenset[str] = frozenset()) -> str:
    """Prometheus text format 0.0.4, as Triton writes custom metrics: `# HELP`, `# TYPE` (counter,
    gauge, histogram) under the family's own name (no `_total` added), labels sorted by name, histogram
    buckets cumulative with `le` last. Families with a name in `taken` (the server's own families and
    samples) are left out: two families of one name would make the whole page unreadable."""
    out: list[str] = []
    for f in families:
        if any(n in taken for n in sample_names(f)):
            continue
        out.append(f"# HELP {f.name} {_escape_help(f.help)}\n# TYPE {f.name} {f.kind.name.lower()}\n")
        for s in f.series:
            if f.kind != Kind.HISTOGRAM:
                out.append(_sample(f.name, s.labels, s.value))
                continue
            running = 0
            for bound, n in zip((*s.bounds, math.inf), s.counts, strict=True):
                running += n
                out.append(_sample(f"{f.name}_bucket", s.labels, running, _number_text(bound)))
            out.append(_sample(f"{f.name}_sum", s.labels, s.sum))
            out.append(_sample(f"{f.name}_count", s.labels, s.count))
    return "".join(out)
