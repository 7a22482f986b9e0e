"""A model's config.pbtxt: parsed with Triton's protobuf schema, validated, normalised, rendered.

Contract:
* `parse_config(text, source=, model_name=)` returns a `ModelSpec` or raises `ConfigError`.
  Syntax errors (protobuf's text parser) read "<source>:<line>:<col>: <why>", semantic errors
  "<source>: <why>". `load_config(model_dir)` does the same for `model_dir/config.pbtxt`.
* The checks protobuf does not do follow Triton core (`ValidateModelConfig`, `ValidateIOShape`),
  restricted to what fleet serves: backends python/pytorch/onnxruntime/tensorrt, platforms
  pytorch_libtorch/onnxruntime_onnx/tensorrt_plan/ensemble. One deliberate difference: dynamic
  batching requires max_batch_size > 0 (Triton accepts it and never batches).
* `ModelSpec.proto` is normalised like Triton core (`AutoCompleteBackendFields`,
  `NormalizeModelConfig`, `NormalizeInstanceGroup` on a host without GPUs) so that
  `ModelSpec.to_json()` is what Triton answers on GET /v2/models/NAME/config (protocol.md §1.7,
  §3.3).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from fleet.config_checks import (  # noqa: F401  (BACKENDS, PLATFORMS re-exported)
    _KIND,
    BACKENDS,
    ENSEMBLE_PLATFORM,
    PLATFORMS,
    WILDCARD_DIM,
    complete_backend,
    normalise,
    validate,
)
from fleet.config_json import config_to_json
from fleet.datatypes import Datatype, from_config
from fleet.errors import ConfigError

CONFIG_FILENAME = "config.pbtxt"
_POSITION = re.compile(r"^\d+:\d+ : ")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One config input or output. `dims` exclude the batch dim; -1 = variable size."""

    name: str
    datatype: Datatype  # BYTES for TYPE_STRING
    dims: tuple[int, ...]
    optional: bool = False
    allow_ragged_batch: bool = False
    is_shape_tensor: bool = False
    reshape: tuple[int, ...] | None = None  # None: no reshape; () is a valid (scalar) reshape


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """`ModelQueuePolicy` (protocol.md §3.7): one priority level's timeout and size limits."""

    delay_on_timeout: bool = False  # timeout_action DELAY (True) or REJECT (False, the default)
    default_timeout_us: int = 0  # 0 = requests of this level never time out while queued
    allow_timeout_override: bool = False  # a request's `timeout` may shorten the default
    max_queue_size: int = 0  # 0 = unbounded

    @classmethod
    def from_proto(cls, qp: Any) -> QueuePolicy:
        return cls(delay_on_timeout=qp.timeout_action == 1, default_timeout_us=qp.default_timeout_microseconds,
                   allow_timeout_override=qp.allow_timeout_override, max_queue_size=qp.max_queue_size)


@dataclass(frozen=True, slots=True)
class DynamicBatching:
    """The scheduling fields of `dynamic_batching`."""

    preferred_batch_sizes: tuple[int, ...]  # normalised: (max_batch_size,) when none given
    max_queue_delay_us: int
    preserve_ordering: bool
    priority_levels: int
    default_priority_level: int
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: Mapping[int, QueuePolicy] = field(default_factory=lambda: MappingProxyType({}))

    def queue_policy(self, level: int) -> QueuePolicy:
        """The policy of priority `level` (1-based; any level when priorities are off)."""
        return self.priority_queue_policy.get(level, self.default_queue_policy)


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """`version_policy`: "latest" (the highest `num_versions`), "all" or "specific" (`versions`)."""

    kind: str
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: Iterable[int]) -> tuple[int, ...]:
        """The available versions this policy serves, ascending. Specific versions that are not
        available are left out (Triton logs and skips them)."""
        present = sorted(set(available))
        if self.kind == "all":
            return tuple(present)
        if self.kind == "specific":
            wanted = set(self.versions)
            return tuple(v for v in present if v in wanted)
        return tuple(present[-self.num_versions:]) if self.num_versions > 0 else ()

    @staticmethod
    def from_proto(policy: Any) -> VersionPolicy:
        choice = policy.WhichOneof("policy_choice")
        if choice == "all":
            return VersionPolicy("all")
        if choice == "specific":
            return VersionPolicy("specific", versions=tuple(policy.specific.versions))
        return VersionPolicy("latest", num_versions=policy.latest.num_versions or 1)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A validated, normalised model config. `proto` is the normalised `ModelConfig`; read only."""

    name: str
    platform: str  # onnxruntime_onnx, pytorch_libtorch, tensorrt_plan, ensemble, or "" for python
    backend: str  # onnxruntime, pytorch, tensorrt, python; "" for ensembles
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dynamic_batching: DynamicBatching | None
    sequence_batching: bool
    ensemble: bool
    decoupled: bool
    instance_count: int  # sum of instance_group counts; 0 for ensembles (they have no instances)
    instance_kind: str  # kind of the first group (KIND_AUTO resolved to KIND_CPU); "" for ensembles
    parameters: Mapping[str, str]  # config `parameters` -> string_value
    version_policy: VersionPolicy
    default_model_filename: str  # config value or the backend default; "" for ensembles
    proto: Any

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def metadata_platform(self) -> str:
        """What model metadata reports as `platform`: platform if set, else backend (§1.5)."""
        return self.platform or self.backend

    @property
    def needs_equal_shapes(self) -> bool:
        """Whether batched requests must agree on input shapes (§3.6, Triton core
        SetConfiguredScheduler): a shape tensor input, or a variable-dim input without
        allow_ragged_batch."""
        return any(
            t.is_shape_tensor or (WILDCARD_DIM in t.dims and not t.allow_ragged_batch)
            for t in self.inputs
        )

    def metadata_shape(self, t: TensorSpec) -> list[int]:
        """Metadata `shape` of a tensor: `dims`, prefixed by -1 when the model batches (§1.5)."""
        return ([-1] if self.max_batch_size > 0 else []) + list(t.dims)

    def to_json(self) -> dict[str, Any]:
        """Triton's GET /v2/models/NAME/config body for this model (protocol.md §1.7)."""
        return config_to_json(self.proto)


def load_config(model_dir: Path) -> ModelSpec:
    """Parse `model_dir/config.pbtxt`; the model name is the directory name."""
    path = model_dir / CONFIG_FILENAME
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read model configuration: {exc}") from None
    return parse_config(text, source=str(path), model_name=model_dir.name)


def parse_config(text: str, *, source: str, model_name: str) -> ModelSpec:
    """Parse, validate and normalise one config.pbtxt text (see the module contract)."""
    cfg = pb.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as exc:
        line, col = exc.GetLine(), exc.GetColumn()
        where = f"{source}:{line}:{col}" if line is not None else source
        raise ConfigError(f"{where}: {_POSITION.sub('', str(exc))}") from None

    def fail(message: str) -> NoReturn:
        raise ConfigError(f"{source}: {message}")

    complete_backend(cfg, model_name, fail)
    validate(cfg, fail)
    normalise(cfg)
    return _to_spec(cfg)


def _tensor(io: Any, is_input: bool) -> TensorSpec:
    return TensorSpec(
        name=io.name,
        datatype=from_config(pb.DataType.Name(io.data_type)),
        dims=tuple(io.dims),
        optional=is_input and io.optional,
        allow_ragged_batch=is_input and io.allow_ragged_batch,
        is_shape_tensor=io.is_shape_tensor,
        reshape=tuple(io.reshape.shape) if io.HasField("reshape") else None,
    )


def _to_spec(cfg: Any) -> ModelSpec:
    dynamic = None
    if cfg.HasField("dynamic_batching"):
        db = cfg.dynamic_batching
        dynamic = DynamicBatching(
            preferred_batch_sizes=tuple(db.preferred_batch_size),
            max_queue_delay_us=db.max_queue_delay_microseconds,
            preserve_ordering=db.preserve_ordering,
            priority_levels=db.priority_levels,
            default_priority_level=db.default_priority_level,
            default_queue_policy=QueuePolicy.from_proto(db.default_queue_policy),
            priority_queue_policy=MappingProxyType(
                {int(level): QueuePolicy.from_proto(qp) for level, qp in db.priority_queue_policy.items()}),
        )
    groups = cfg.instance_group
    return ModelSpec(
        name=cfg.name,
        platform=cfg.platform,
        backend=cfg.backend,
        max_batch_size=cfg.max_batch_size,
        inputs=tuple(_tensor(io, True) for io in cfg.input),
        outputs=tuple(_tensor(io, False) for io in cfg.output),
        dynamic_batching=dynamic,
        sequence_batching=cfg.HasField("sequence_batching"),
        ensemble=cfg.platform == ENSEMBLE_PLATFORM,
        decoupled=cfg.model_transaction_policy.decoupled,
        instance_count=sum(g.count for g in groups),
        instance_kind=_KIND.Name(groups[0].kind) if groups else "",
        parameters=MappingProxyType({k: v.string_value for k, v in cfg.parameters.items()}),
        version_policy=VersionPolicy.from_proto(cfg.version_policy),
        default_model_filename=cfg.default_model_filename,
        proto=cfg,
    )


