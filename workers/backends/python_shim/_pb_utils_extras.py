"""The less central parts of the `triton_python_backend_utils` shim: Logger and custom
metrics (ModelConfig, for `auto_complete_config`, is in _pb_utils_config.py). Re-exported by
triton_python_backend_utils; models never import this module directly.

Behaviour follows Triton's python_backend (`Logger` and `MetricFamily`/`Metric` in `pb_stub.cc`,
`pb_metric_reporter`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from _pb_utils_types import TritonModelException

from fleet import custom_metrics as _metrics

_model_log = logging.getLogger("triton_python_backend_utils")


# --- Logger -------------------------------------------------------------------------------------


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_LOGGING_LEVEL = {
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.VERBOSE: logging.DEBUG,
}


class Logger:
    """`pb_utils.Logger.log_info("...")`: model log lines, sent to the `logging` module."""

    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        _model_log.log(_LOGGING_LEVEL[LogLevel(level)], "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        _model_log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _model_log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _model_log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _model_log.debug("%s", message)


# --- custom metrics -----------------------------------------------------------------------------
# Kept in this (stub) process; the stub reports `_snapshot()` to its worker whenever `_changes()` moved
# (with an execute reply, or from its flusher thread: workers/backends/python_stub.py), and the worker
# publishes it for the gateways' metrics port (fleet/custom_metrics.py has the combining rules).


class _MetricError(TritonModelException, ValueError):  # type: ignore[misc]  # the shim's own module
    """What Triton raises (TritonModelException); also a ValueError, as this shim raised before."""


_state = {"changes": 0}  # bumped by every change a snapshot would show


def _changed() -> None:
    _state["changes"] += 1


class MetricFamily:
    """A named metric family; `family.Metric(labels=...)` returns the metric for those labels. Families
    of one name are one family (the first description is kept); another kind under a used name raises."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    name: str
    description: str
    kind: int

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise _MetricError(f"metric family '{name}': unknown kind {kind}")
        if not isinstance(name, str) or not _metrics.valid_name(name):
            raise _MetricError(f"metric family name {name!r} is not a valid Prometheus metric name")
        existing = _families.get(name)
        if existing is not None and existing.kind != kind:
            raise _MetricError(f"metric family '{name}' already exists with a different kind")
        self.name = name
        self.description = description
        self.kind = kind
        # Families with the same name share their metrics, as they would in one registry.
        self._metrics: dict[tuple[tuple[str, str], ...], Metric] = existing._metrics if existing is not None else {}
        if existing is None:
            _families[name] = self
            _changed()

    def Metric(self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None) -> Metric:
        for label, value in (labels or {}).items():
            if not isinstance(label, str) or not isinstance(value, str) or not _metrics.valid_label(label):
                raise _MetricError(f"metric '{self.name}': invalid label {label!r}: {value!r}")
        key = tuple(sorted((labels or {}).items()))
        metric = self._metrics.get(key)
        if metric is None:
            metric = Metric(self, dict(key), buckets)
            self._metrics[key] = metric
            _changed()
        return metric


class Metric:
    """One labelled counter, gauge or histogram."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: Sequence[float] | None) -> None:
        if family.kind == MetricFamily.HISTOGRAM:
            if buckets is None:
                raise _MetricError(f"histogram metric '{family.name}' needs buckets")
            bounds = [float(b) for b in buckets]
            if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
                raise _MetricError(f"histogram metric '{family.name}': buckets must be strictly ascending")
            self.buckets: list[float] | None = bounds
            self.bucket_counts = [0] * (len(bounds) + 1)  # last is +Inf
        elif buckets is not None:
            raise _MetricError(f"metric '{family.name}': buckets apply to histograms only")
        else:
            self.buckets = None
        self.family = family
        self.labels = labels
        self._value = 0.0
        self.count = 0
        self.sum = 0.0

    def increment(self, value: float) -> None:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise _MetricError("increment() is not supported for histograms")
        if self.family.kind == MetricFamily.COUNTER and value < 0:
            raise _MetricError("a counter cannot be incremented by a negative value")
        self._value += value
        _changed()

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise _MetricError("set() is supported for gauges only")
        self._value = float(value)
        _changed()

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM or self.buckets is None:
            raise _MetricError("observe() is supported for histograms only")
        self.count += 1
        self.sum += value
        index = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.bucket_counts[index] += 1
        _changed()

    def value(self) -> float:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise _MetricError("value() is not supported for histograms")
        return self._value


_families: dict[str, MetricFamily] = {}


def _changes() -> int:
    """How many changes the families have seen: the stub reports a snapshot when this moved."""
    return _state["changes"]


def _snapshot() -> list[Any]:
    """Every family's metrics in fleet.custom_metrics' wire form."""
    families = []
    for f in list(_families.values()):  # a model thread may add one meanwhile
        series = [
            _metrics.Series(tuple(m.labels.items()), bounds=tuple(m.buckets), counts=tuple(m.bucket_counts),
                            sum=m.sum, count=m.count) if m.buckets is not None
            else _metrics.Series(tuple(m.labels.items()), m._value)
            for m in list(f._metrics.values())
        ]
        families.append(_metrics.Family(f.name, f.description, _metrics.Kind(f.kind), tuple(series)))
    return _metrics.encode(families)
