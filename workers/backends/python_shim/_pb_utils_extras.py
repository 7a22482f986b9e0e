"""The less central parts of the `triton_python_backend_utils` shim: Logger and in-process custom
metrics (ModelConfig, for `auto_complete_config`, is in _pb_utils_config.py). Re-exported by
triton_python_backend_utils; models never import this module directly.

Behaviour follows Triton's python_backend (`Logger` and `MetricFamily`/`Metric` in `pb_stub.cc`,
`pb_metric_reporter`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence

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


# --- custom metrics (in-process; the worker may export `_families` later) ------------------------


class MetricFamily:
    """A named metric family; `family.Metric(labels=...)` returns the metric for those labels."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    name: str
    description: str
    kind: int

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise ValueError(f"metric family '{name}': unknown kind {kind}")
        existing = _families.get(name)
        if existing is not None and existing.kind != kind:
            raise ValueError(f"metric family '{name}' already exists with a different kind")
        self.name = name
        self.description = description
        self.kind = kind
        # Families with the same name share their metrics, as they would in one registry.
        self._metrics: dict[tuple[tuple[str, str], ...], Metric] = existing._metrics if existing is not None else {}
        _families[name] = self

    def Metric(self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None) -> Metric:
        key = tuple(sorted((labels or {}).items()))
        metric = self._metrics.get(key)
        if metric is None:
            metric = Metric(self, dict(key), buckets)
            self._metrics[key] = metric
        return metric


class Metric:
    """One labelled counter, gauge or histogram."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: Sequence[float] | None) -> None:
        if family.kind == MetricFamily.HISTOGRAM:
            if buckets is None:
                raise ValueError(f"histogram metric '{family.name}' needs buckets")
            self.buckets: list[float] | None = sorted(float(b) for b in buckets)
            self.bucket_counts = [0] * (len(self.buckets) + 1)  # last is +Inf
        elif buckets is not None:
            raise ValueError(f"metric '{family.name}': buckets apply to histograms only")
        else:
            self.buckets = None
        self.family = family
        self.labels = labels
        self._value = 0.0
        self.count = 0
        self.sum = 0.0

    def increment(self, value: float) -> None:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise ValueError("increment() is not supported for histograms")
        if self.family.kind == MetricFamily.COUNTER and value < 0:
            raise ValueError("a counter cannot be incremented by a negative value")
        self._value += value

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise ValueError("set() is supported for gauges only")
        self._value = float(value)

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM or self.buckets is None:
            raise ValueError("observe() is supported for histograms only")
        self.count += 1
        self.sum += value
        index = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.bucket_counts[index] += 1

    def value(self) -> float:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise ValueError("value() is not supported for histograms")
        return self._value


_families: dict[str, MetricFamily] = {}
