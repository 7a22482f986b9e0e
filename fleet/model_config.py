"""A model's config.pbtxt: parsed with Triton's protobuf schema, validated, normalised, rendered.

Contract:
* `parse_config(text, source=, model_name=)` returns a `ModelSpec` or raises `ConfigError`.
  Syntax errors (protobuf's text parser) read "<source>:<line>:<col>: <why>", semantic errors
  "<source>: <why>". `load_config(model_dir)` does the same for `model_dir/config.pbtxt`.
* `parse_config` is two steps, also usable apart so that a worker can auto-complete the raw config in
  between (workers/auto_complete.py): `parse_config_proto` (config.pbtxt text, a JSON override, or
  nothing) and `spec_from_proto` (complete the backend fields, validate, normalise).
* The checks protobuf does not do follow Triton core (`ValidateModelConfig`, `ValidateIOShape`),
  restricted to what fleet serves: backends python/pytorch/onnxruntime/tensorrt, platforms
  pytorch_libtorch/onnxruntime_onnx/tensorrt_plan/ensemble. One deliberate difference: dynamic
  batching requires max_batch_size > 0 (Triton accepts it and never batches).
* `batch_input` / `batch_output` (ragged batching, protocol.md §3.6) are checked like Triton core's
  `ValidateBatchIO` (one source input that exists, data type INT32 or FP32, batch output targets are
  outputs named once), plus what fleet needs to build them: each batch input has a target name, and no
  target name is also a model input or another batch input's target. Triton does not require the
  source input to be `allow_ragged_batch`, and neither does fleet (element counts and item shapes are
  well defined for any input).
* `ModelSpec.proto` is normalised like Triton core (`AutoCompleteBackendFields`,
  `NormalizeModelConfig`, `NormalizeInstanceGroup` on a host without GPUs) so that
  `ModelSpec.to_json()` is what Triton answers on GET /v2/models/NAME/config (protocol.md §1.7,
  §3.3).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

from google.protobuf import json_format, text_format
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
from fleet.envelope import WireTensor
from fleet.errors import ConfigError
from fleet.sequence_spec import SequenceSpec, parse_sequence

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


class BatchInputKind(StrEnum):
    """`BatchInput.Kind` of model_config.proto: what a batch input tensor describes."""

    ELEMENT_COUNT = "BATCH_ELEMENT_COUNT"
    ACCUMULATED_ELEMENT_COUNT = "BATCH_ACCUMULATED_ELEMENT_COUNT"
    ACCUMULATED_ELEMENT_COUNT_WITH_ZERO = "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO"
    MAX_ELEMENT_COUNT_AS_SHAPE = "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE"
    ITEM_SHAPE = "BATCH_ITEM_SHAPE"
    ITEM_SHAPE_FLATTEN = "BATCH_ITEM_SHAPE_FLATTEN"


@dataclass(frozen=True, slots=True)
class BatchInputSpec:
    """One `batch_input`: a tensor the backend builds from the whole batch, named `target_name` (Triton's
    backends create only the first of the config's target names), derived from the shapes of
    `source_input` in every request of the batch (batching.merge.batch_input_parts)."""

    kind: BatchInputKind
    target_name: str
    datatype: Datatype  # INT32 or FP32
    source_input: str


@dataclass(frozen=True, slots=True)
class BatchOutputSpec:
    """One `batch_output` (kind BATCH_SCATTER_WITH_INPUT_SHAPE, the only kind): each output in
    `target_names` is cut per request into the shape of its config dims, where every variable dim takes
    the size of the same dim of that request's `source_input`."""

    target_names: tuple[str, ...]
    source_input: str


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
class ResourceNeed:
    """One resource an instance holds while it executes (instance_group rate_limiter)."""

    name: str
    count: int
    is_global: bool  # fleet-wide (a Redis semaphore) rather than per worker device


@dataclass(frozen=True, slots=True)
class InstanceLimit:
    """An instance's rate_limiter: the resources it needs to execute, and its priority (a lower value
    goes first among instances waiting for the same resources)."""

    resources: tuple[ResourceNeed, ...]
    priority: int


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
    batch_inputs: tuple[BatchInputSpec, ...] = ()
    batch_outputs: tuple[BatchOutputSpec, ...] = ()
    # Inputs whose shapes must agree for requests to share a batch (§3.6): shape tensors, and inputs
    # with a variable dim that are not allow_ragged_batch.
    equal_shape_inputs: frozenset[str] = frozenset()
    response_cache: bool = False  # `response_cache { enable: true }` (gateway/response_cache.py)
    # Per instance (groups expanded in order): its rate_limiter (workers/rate_limiter.py).
    instance_limits: tuple[InstanceLimit, ...] = ()
    sequence: SequenceSpec | None = None  # sequence_batching's strategy, controls and state (fleet/sequence_spec.py)

    def model_facing(self) -> ModelSpec:
        """The spec a backend runs: a sequence model also takes its control tensors (one element per row)
        and state inputs, and produces its state outputs, none of which a client sends or receives."""
        seq = self.sequence
        if seq is None:
            return self
        controls = tuple(TensorSpec(c.name, c.datatype, (1,)) for c in seq.controls)
        state_in = tuple(TensorSpec(st.input_name, st.datatype, st.dims) for st in seq.states)
        state_out = tuple(TensorSpec(st.output_name, st.datatype, st.dims) for st in seq.states)
        return replace(self, inputs=self.inputs + controls + state_in, outputs=self.outputs + state_out)

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
        return bool(self.equal_shape_inputs)

    @property
    def ragged_inputs(self) -> frozenset[str]:
        """Inputs with allow_ragged_batch: framework backends get them concatenated as 1-D tensors."""
        return frozenset(t.name for t in self.inputs if t.allow_ragged_batch)

    def batch_key(self, inputs: Sequence[WireTensor]) -> Hashable:
        """The scheduler's batch key of a request with these `inputs` (protocol.md §3.6): requests share
        a batch only if their keys are equal. The key holds the names of the supplied inputs (optional
        inputs: only requests supplying the same set batch together) and, for each input in
        `equal_shape_inputs`, its shape without the batch dim. Ragged inputs and fixed-shape inputs
        never split batches by shape."""
        names = tuple(sorted(t.name for t in inputs))
        if not self.equal_shape_inputs:
            return names, ()
        skip = 1 if self.max_batch_size > 0 else 0
        shapes = tuple(sorted((t.name, tuple(t.shape[skip:])) for t in inputs if t.name in self.equal_shape_inputs))
        return names, shapes

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
    return spec_from_proto(parse_config_proto(text, source=source, model_name=model_name),
                           source=source, model_name=model_name)


def parse_config_proto(
    text: str | None, *, source: str, model_name: str, override_json: str | None = None
) -> Any:
    """The raw (not validated) `ModelConfig`: from `override_json` if given (Triton's load-time config
    override, a JSON ModelConfig that replaces config.pbtxt entirely), else from the config.pbtxt
    `text`, else (None: no config.pbtxt) an empty one for auto-completion to fill."""
    cfg = pb.ModelConfig()
    if override_json is not None:
        _parse_override(override_json, cfg, model_name)
        return cfg
    if text is None:
        return cfg
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as exc:
        line, col = exc.GetLine(), exc.GetColumn()
        where = f"{source}:{line}:{col}" if line is not None else source
        raise ConfigError(f"{where}: {_POSITION.sub('', str(exc))}") from None
    return cfg


def _parse_override(override_json: str, cfg: Any, model_name: str) -> None:
    def invalid(why: str) -> NoReturn:
        raise ConfigError(f"failed to load '{model_name}': invalid config override: {why}")

    try:
        doc = json.loads(override_json)
    except ValueError as exc:
        invalid(str(exc))
    # json_format.Parse takes `[]` for an empty config; an override that is not an object is a mistake.
    if not isinstance(doc, dict):
        invalid(f"expected a JSON object, got {type(doc).__name__}")
    try:
        json_format.ParseDict(doc, cfg)  # unknown fields are errors, as in Triton
    except json_format.ParseError as exc:
        invalid(str(exc))


def spec_from_proto(cfg: Any, *, source: str, model_name: str) -> ModelSpec:
    """Validate and normalise a raw `ModelConfig` (parsed, and possibly auto-completed) into a
    `ModelSpec`; semantic errors read "<source>: <why>". `cfg` is completed in place."""

    def fail(message: str) -> NoReturn:
        raise ConfigError(f"{source}: {message}")

    complete_backend(cfg, model_name, fail)
    validate(cfg, fail)
    _validate_batch_io(cfg, fail)
    normalise(cfg)
    return replace(_to_spec(cfg), sequence=parse_sequence(cfg, fail))


def _validate_batch_io(cfg: Any, fail: Callable[[str], NoReturn]) -> None:
    """Triton core ValidateBatchIO, plus the target-name checks fleet needs (see the module contract)."""
    inputs = {io.name for io in cfg.input}
    outputs = {io.name for io in cfg.output}
    targets: set[str] = set()
    for bi in cfg.batch_input:
        if bi.kind not in pb.BatchInput.Kind.values():
            fail(f"unknown batch input kind '{bi.kind}'")
        kind = pb.BatchInput.Kind.Name(bi.kind)
        if len(bi.source_input) != 1:
            fail(f"batch input kind '{kind}' expects 1 source input, got {len(bi.source_input)}")
        if bi.data_type not in (pb.TYPE_INT32, pb.TYPE_FP32):
            fail("batch input data type must be TYPE_INT32 or TYPE_FP32")
        if bi.source_input[0] not in inputs:
            fail(f"unknown source input name '{bi.source_input[0]}'")
        if not bi.target_name:
            fail(f"batch input kind '{kind}' must specify 'target_name'")
        for name in bi.target_name:
            if name in inputs:
                fail(f"batch input target name '{name}' is also the name of a model input")
            if name in targets:
                fail(f"batch input target name '{name}' can only be specified once")
            targets.add(name)
    for bo in cfg.batch_output:
        if bo.kind not in pb.BatchOutput.Kind.values():
            fail(f"unknown batch output kind '{bo.kind}'")
        if len(bo.source_input) != 1:
            fail(f"batch output kind '{pb.BatchOutput.Kind.Name(bo.kind)}' expects 1 source input, got "
                 f"{len(bo.source_input)}")
        if bo.source_input[0] not in inputs:
            fail(f"unknown source input name '{bo.source_input[0]}'")
        seen: set[str] = set()
        for name in bo.target_name:
            if name not in outputs:
                fail(f"unknown target output name '{name}'")
            if name in seen:
                fail(f"target output name '{name}' can only be specified once")
            seen.add(name)


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
        batch_inputs=tuple(
            BatchInputSpec(BatchInputKind(pb.BatchInput.Kind.Name(bi.kind)), bi.target_name[0],
                           from_config(pb.DataType.Name(bi.data_type)), bi.source_input[0])
            for bi in cfg.batch_input),
        batch_outputs=tuple(BatchOutputSpec(tuple(bo.target_name), bo.source_input[0]) for bo in cfg.batch_output),
        response_cache=cfg.response_cache.enable,
        instance_limits=tuple(
            InstanceLimit(tuple(ResourceNeed(r.name, r.count, getattr(r, "global")) for r in g.rate_limiter.resources),
                          g.rate_limiter.priority)
            for g in groups for _ in range(g.count)),
        equal_shape_inputs=frozenset(
            io.name for io in cfg.input
            if io.is_shape_tensor or (WILDCARD_DIM in io.dims and not io.allow_ragged_batch)),
    )


