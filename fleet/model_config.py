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

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as pb

from fleet.datatypes import Datatype, from_config
from fleet.errors import ConfigError

CONFIG_FILENAME = "config.pbtxt"
ENSEMBLE_PLATFORM = "ensemble"
SEQUENCE_IDLE_DEFAULT_US = 1_000_000
WILDCARD_DIM = -1
# backend -> (platform Triton fills in, default model filename); python models have no platform.
BACKENDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "onnxruntime": ("onnxruntime_onnx", "model.onnx"),
    "pytorch": ("pytorch_libtorch", "model.pt"),
    "tensorrt": ("tensorrt_plan", "model.plan"),
    "python": ("", "model.py"),
})
PLATFORMS: Mapping[str, str] = MappingProxyType({p: b for b, (p, _) in BACKENDS.items() if p})
# Triton's SetDefaultInstanceCount: a CPU group without a count gets 2 instances for these backends.
_TWO_CPU_INSTANCES = frozenset({"onnxruntime"})
_KIND = pb.ModelInstanceGroup.Kind
_POSITION = re.compile(r"^\d+:\d+ : ")
_Fail = Callable[[str], NoReturn]


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
class DynamicBatching:
    """The scheduling fields of `dynamic_batching`; queue policies are in `ModelSpec.proto`."""

    preferred_batch_sizes: tuple[int, ...]  # normalised: (max_batch_size,) when none given
    max_queue_delay_us: int
    preserve_ordering: bool
    priority_levels: int
    default_priority_level: int


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
        """Triton's /config rendering: snake_case field names, defaults included, fields in .proto
        order, enums by name, and the 64-bit ints Triton's ModelConfigToJson fixes as numbers."""
        raw = json_format.MessageToDict(
            self.proto, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        doc = _ordered(raw, self.proto.DESCRIPTOR)
        _fix_int64(doc)
        return doc


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

    _complete_backend(cfg, model_name, fail)
    _validate(cfg, fail)
    _normalise(cfg)
    return _to_spec(cfg)


# ---------------------------------------------------------------- validation and normalisation

def _complete_backend(cfg: Any, model_name: str, fail: _Fail) -> None:
    """Name from the directory; platform <-> backend and default_model_filename like Triton."""
    if cfg.name and cfg.name != model_name:
        fail(f"model name '{cfg.name}' in the configuration does not match its directory "
             f"'{model_name}'")
    cfg.name = model_name
    platform, backend = cfg.platform, cfg.backend
    if not platform and not backend:
        fail(f"must specify 'platform' or 'backend' for '{model_name}'")
    if platform == ENSEMBLE_PLATFORM:
        if backend:
            fail(f"ensemble model '{model_name}' must have platform 'ensemble' and empty backend")
        return
    if platform and platform not in PLATFORMS:
        fail(f"unknown platform '{platform}' (known: {', '.join([*PLATFORMS, ENSEMBLE_PLATFORM])})")
    if backend and backend not in BACKENDS:
        fail(f"unknown backend '{backend}' (known: {', '.join(BACKENDS)})")
    backend = backend or PLATFORMS[platform]
    if platform and platform != BACKENDS[backend][0]:
        fail(f"unexpected 'platform' and 'backend' pair, got: {platform}, {backend}")
    cfg.backend = backend
    cfg.platform = BACKENDS[backend][0]
    if not cfg.default_model_filename:
        cfg.default_model_filename = BACKENDS[backend][1]


def _validate(cfg: Any, fail: _Fail) -> None:
    mbs = cfg.max_batch_size
    if mbs < 0:
        fail("'max_batch_size' must be non-negative")
    for kind, ios in (("input", cfg.input), ("output", cfg.output)):
        _validate_ios(kind, ios, mbs, cfg.platform, fail)
    if cfg.HasField("version_policy"):
        policy = cfg.version_policy
        choice = policy.WhichOneof("policy_choice")
        if choice == "latest" and policy.latest.num_versions < 1:
            fail("version_policy latest num_versions must be >= 1")
        if choice == "specific":
            if not policy.specific.versions:
                fail("version_policy specific must list at least one version")
            if any(v < 1 for v in policy.specific.versions):
                fail("version_policy specific versions must be positive")
    if cfg.HasField("dynamic_batching"):
        _validate_dynamic(cfg.dynamic_batching, mbs, fail)
    if cfg.HasField("sequence_batching"):
        seq = cfg.sequence_batching
        if seq.HasField("oldest"):
            _check_preferred("sequence batching", seq.oldest.preferred_batch_size, mbs, fail)
        if seq.HasField("direct") and not 0.0 <= seq.direct.minimum_slot_utilization <= 1.0:
            fail("sequence batching minimum slot utilization must be in range (0.0, 1.0]")
    is_ensemble = cfg.platform == ENSEMBLE_PLATFORM
    if cfg.HasField("ensemble_scheduling") != is_ensemble:
        fail("ensemble_scheduling must be set exactly when platform is 'ensemble'")
    if is_ensemble:
        _validate_ensemble(cfg, fail)
    for group in cfg.instance_group:
        if group.kind in (_KIND.KIND_CPU, _KIND.KIND_MODEL) and group.gpus:
            fail(f"instance group has kind {_KIND.Name(group.kind)} but specifies one or more GPUs")


def _validate_ios(kind: str, ios: Sequence[Any], mbs: int, platform: str, fail: _Fail) -> None:
    seen: set[str] = set()
    for index, io in enumerate(ios):
        if not io.name:
            fail(f"model {kind} {index} must specify 'name'")
        if io.name in seen:
            fail(f"duplicate model {kind} name '{io.name}'")
        seen.add(io.name)
        where = f"model {kind} '{io.name}'"
        if io.data_type == pb.TYPE_INVALID:
            fail(f"{where} must specify 'data_type'")
        if not io.dims:
            fail(f"{where} must specify 'dims'")
        if any(d < 1 and d != WILDCARD_DIM for d in io.dims):
            fail(f"{where} dimension must be integer >= 1, or -1 to indicate a variable-size "
                 "dimension")
        if io.HasField("reshape"):
            _validate_reshape(where, list(io.dims), list(io.reshape.shape), mbs, fail)
        if io.is_shape_tensor and platform != "tensorrt_plan":
            fail(f"{where}: shape tensors are only supported for TensorRT platform")


def _validate_reshape(
    where: str, dims: list[int], shape: list[int], mbs: int, fail: _Fail
) -> None:
    """Triton ValidateIOShape: same element count, or matching chunks between -1 dims."""
    if not shape and mbs == 0:
        fail(f"{where} cannot have empty reshape for non-batching model as scalar tensors are "
             "not supported")
    if any(d < 1 and d != WILDCARD_DIM for d in shape):
        fail(f"{where} reshape dimensions must be integer >= 1, or -1 to indicate a variable-size "
             "dimension")

    def count(ds: list[int]) -> int:  # Triton GetElementCount: -1 if variable, 0 if empty
        return -1 if WILDCARD_DIM in ds else (math.prod(ds) if ds else 0)

    def chunks(ds: list[int]) -> list[int]:
        out, current = [], 1
        for d in ds:
            if d == WILDCARD_DIM:
                out.append(current)
                current = 1
            else:
                current *= d
        return [*out, current]

    dims_size, reshape_size = count(dims), count(shape)
    if dims_size != reshape_size and (reshape_size != 0 or dims_size != 1):
        fail(f"{where} has different size for dims and reshape")
    if dims_size == -1 and chunks(dims) != chunks(shape):
        fail(f"{where} has different size for dims and reshape (between variable-size dimensions)")


def _check_preferred(what: str, sizes: Sequence[int], mbs: int, fail: _Fail) -> None:
    for size in sizes:
        if size <= 0:
            fail(f"{what} preferred batch size must be positive")
        if size > mbs:
            fail(f"{what} preferred batch size {size} must be <= max batch size {mbs}")


def _validate_dynamic(db: Any, mbs: int, fail: _Fail) -> None:
    if mbs == 0:
        fail("dynamic batching requires max_batch_size > 0")
    _check_preferred("dynamic batching", db.preferred_batch_size, mbs, fail)
    levels = db.priority_levels
    if levels:
        if not 1 <= db.default_priority_level <= levels:
            fail(f"default priority level must be in range [1, {levels}]")
        if any(not 1 <= level <= levels for level in db.priority_queue_policy):
            fail(f"priority queue policy must have priority level in range [1, {levels}]")
    if db.preserve_ordering:
        if levels > 1:
            fail("Only one priority level is allowed when 'preserve_ordering' is true")
        policies = [db.default_queue_policy, *db.priority_queue_policy.values()]
        if any(p.default_timeout_microseconds and p.timeout_action == pb.ModelQueuePolicy.DELAY
               for p in policies):
            fail("Queue policy can not have DELAY as timeout action when 'preserve_ordering' "
                 "is true")


def _validate_ensemble(cfg: Any, fail: _Fail) -> None:
    if cfg.instance_group:
        fail("instance group should not be specified for an ensemble")
    if cfg.HasField("optimization"):
        fail("optimization should not be specified for an ensemble")
    if cfg.model_warmup:
        fail("model_warmup can not be specified for an ensemble")
    steps = cfg.ensemble_scheduling.step
    if not steps:
        fail("must specify 'step' for an ensemble")
    for index, step in enumerate(steps):
        for field in ("model_name", "input_map", "output_map"):
            if not getattr(step, field):
                fail(f"must specify '{field}' in step {index} of the ensemble")


def _normalise(cfg: Any) -> None:
    """Triton NormalizeModelConfig + NormalizeInstanceGroup (no GPUs: KIND_AUTO -> KIND_CPU)."""
    mbs = cfg.max_batch_size
    if not cfg.HasField("version_policy"):
        cfg.version_policy.latest.num_versions = 1
    db = cfg.dynamic_batching if cfg.HasField("dynamic_batching") else None
    if db is not None and not db.preferred_batch_size and mbs > 0:
        db.preferred_batch_size.append(mbs)
    if cfg.HasField("sequence_batching"):
        seq = cfg.sequence_batching
        if seq.max_sequence_idle_microseconds == 0:
            seq.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_US
        if seq.HasField("oldest") and not seq.oldest.preferred_batch_size and mbs > 0:
            seq.oldest.preferred_batch_size.append(mbs)
    if cfg.HasField("ensemble_scheduling"):
        return
    optimization = cfg.optimization
    for pinned in ("input_pinned_memory", "output_pinned_memory"):
        if not optimization.HasField(pinned):
            getattr(optimization, pinned).enable = True
    if not cfg.instance_group:
        cfg.instance_group.add().name = cfg.name  # Triton names the added group after the model
    for index, group in enumerate(cfg.instance_group):
        if not group.name:
            group.name = f"{cfg.name}_{index}"
        if group.kind == _KIND.KIND_AUTO:
            group.kind = _KIND.KIND_CPU
        if group.count < 1:
            two = group.kind == _KIND.KIND_CPU and cfg.backend in _TWO_CPU_INSTANCES
            group.count = 2 if two else 1


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


# ---------------------------------------------------------------- JSON rendering

def _ordered(value: dict[str, Any], descriptor: Any) -> dict[str, Any]:
    """`value` (a MessageToDict object) with keys in .proto declaration order, recursively."""
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        if field.name not in value:
            continue
        item, sub = value[field.name], field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            value_desc = sub.fields_by_name["value"].message_type
            if value_desc is not None:
                item = {k: _ordered(v, value_desc) for k, v in item.items()}
        elif sub is not None:
            item = [_ordered(v, sub) for v in item] if field.is_repeated else _ordered(item, sub)
        out[field.name] = item
    return out


def _fix(obj: Any, key: str) -> None:
    """obj[key] (a 64-bit int or list of them, printed as strings by protobuf) as numbers."""
    if isinstance(obj, dict) and key in obj:
        value = obj[key]
        obj[key] = [int(x) for x in value] if isinstance(value, list) else int(value)


def _fix_int64(doc: dict[str, Any]) -> None:
    """Exactly the fields Triton core's ModelConfigToJson turns from strings into numbers. Like
    Triton, sequence_batching.state[].initial_state[].dims stay strings (Triton looks for
    `initial_state` on sequence_batching, where it never is) and map keys stay strings."""
    for io in [*doc.get("input", []), *doc.get("output", [])]:
        _fix(io, "dims")
        _fix(io.get("reshape"), "shape")
    _fix(doc.get("version_policy", {}).get("specific"), "versions")
    db = doc.get("dynamic_batching")
    if db is not None:
        for key in ("max_queue_delay_microseconds", "priority_levels", "default_priority_level"):
            _fix(db, key)
        _fix(db.get("default_queue_policy"), "default_timeout_microseconds")
        for policy in db.get("priority_queue_policy", {}).values():
            _fix(policy, "default_timeout_microseconds")
    seq = doc.get("sequence_batching")
    if seq is not None:
        _fix(seq, "max_sequence_idle_microseconds")
        _fix(seq.get("oldest"), "max_queue_delay_microseconds")
        _fix(seq.get("direct"), "max_queue_delay_microseconds")
        for state in seq.get("state", []):
            _fix(state, "dims")
    for step in doc.get("ensemble_scheduling", {}).get("step", []):
        _fix(step, "model_version")
    for warmup in doc.get("model_warmup", []):
        for tensor in warmup.get("inputs", {}).values():
            _fix(tensor, "dims")
