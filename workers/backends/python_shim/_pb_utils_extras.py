"""The less central parts of the `triton_python_backend_utils` shim: Logger, ModelConfig (for
`auto_complete_config`) and in-process custom metrics. Re-exported by triton_python_backend_utils;
models never import this module directly.

Behaviour follows Triton's python_backend (`ModelConfig` in `triton_python_backend_utils.py`,
`Logger` and `MetricFamily`/`Metric` in `pb_stub.cc`, `pb_metric_reporter`).
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

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


# --- ModelConfig (auto_complete_config) ---------------------------------------------------------


class ModelConfig:
    """The model configuration handed to `auto_complete_config`, in its JSON (dict) form.

    Only max_batch_size, the scheduler, inputs, outputs and the transaction policy may be changed.
    Conflicts with what config.pbtxt already says raise ValueError, as in Triton.
    """

    _TENSOR_PROPERTIES: ClassVar[dict[str, tuple[str, ...]]] = {
        "input": ("name", "data_type", "dims", "optional"),
        "output": ("name", "data_type", "dims"),
    }

    def __init__(self, model_config: str | Mapping[str, Any]) -> None:
        cfg = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        cfg.setdefault("max_batch_size", 0)
        cfg.setdefault("input", [])
        cfg.setdefault("output", [])
        self._model_config: dict[str, Any] = cfg

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config["max_batch_size"])
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add_tensor("input", input)

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add_tensor("output", output)

    def _add_tensor(self, kind: str, tensor: Mapping[str, Any]) -> None:
        allowed = self._TENSOR_PROPERTIES[kind]
        label = f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model '{self._name()}'"
        extra = [key for key in tensor if key not in allowed]
        if extra:
            raise ValueError(f"{label} contains property other than {', '.join(allowed)}.")
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{label} is missing '{key}' property.")
        for current in self._model_config[kind]:
            if current["name"] != tensor["name"]:
                continue
            dtype = current.get("data_type", "TYPE_INVALID")
            if dtype != "TYPE_INVALID" and dtype != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name()}', configuration expects datatype "
                    f"{dtype} for {kind} '{tensor['name']}', model provides {tensor['data_type']}"
                )
            dims = [int(d) for d in current.get("dims", [])]
            if dims and dims != [int(d) for d in tensor["dims"]]:
                raise ValueError(
                    f"model '{self._name()}', tensor '{tensor['name']}': the model expects dims "
                    f"{list(tensor['dims'])} but the model configuration specifies dims {dims}"
                )
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(
                    f"model '{self._name()}', tensor '{tensor['name']}': the model expects optional "
                    f"{tensor['optional']} but the model configuration specifies optional "
                    f"{current['optional']}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        if any(key != "decoupled" for key in transaction_policy_dict):
            raise ValueError(
                "model transaction property in auto-complete-config function for model "
                f"'{self._name()}' contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        decoupled = bool(transaction_policy_dict.get("decoupled", False))
        if "decoupled" in policy and bool(policy["decoupled"]) != decoupled:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model "
                f"'{self._name()}', which is already set to {policy['decoupled']}."
            )
        policy["decoupled"] = decoupled


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
