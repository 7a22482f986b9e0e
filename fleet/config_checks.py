"""Semantic checks and Triton's normalisation of a parsed ModelConfig (what protobuf does not do).

Follows Triton core (`ValidateModelConfig`, `ValidateIOShape`, `AutoCompleteBackendFields`,
`NormalizeModelConfig`, `NormalizeInstanceGroup` on a host without GPUs). Each check calls `fail`,
which raises ConfigError with the config's source in front.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NoReturn

from fleet.config_proto import model_config_pb2 as pb

ENSEMBLE_PLATFORM = "ensemble"
SEQUENCE_IDLE_DEFAULT_US = 1_000_000
WILDCARD_DIM = -1
# backend -> (platform Triton fills in, default model filename); python models have no platform.
BACKENDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "onnxruntime": ("onnxruntime_onnx", "model.onnx"),
    "pytorch": ("pytorch_libtorch", "model.pt"),
    "tensorrt": ("tensorrt_plan", "model.plan"),
    "python": ("", "model.py"),
    # fleet's generative backend (workers/backends/llm.py): a Hugging Face checkpoint, or a GGUF file.
    "llm": ("", "model.safetensors"),
    # fleet's timing model (workers/backends/sleep_backend.py): no file, execution is a configured delay.
    "sleep": ("", ""),
})
PLATFORMS: Mapping[str, str] = MappingProxyType({p: b for b, (p, _) in BACKENDS.items() if p})
# Triton's SetDefaultInstanceCount: a CPU group without a count gets 2 instances for these backends.
_TWO_CPU_INSTANCES = frozenset({"onnxruntime"})
_KIND = pb.ModelInstanceGroup.Kind
_Fail = Callable[[str], NoReturn]


def complete_backend(cfg: Any, model_name: str, fail: _Fail) -> None:
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


def validate(cfg: Any, fail: _Fail) -> None:
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
        names: set[str] = set()
        for resource in group.rate_limiter.resources:
            if not resource.name:
                fail("rate limiter resource name cannot be empty")
            if resource.name in names:
                fail(f"resource '{resource.name}' is specified more than once in instance group "
                     f"'{group.name or cfg.name}'")
            names.add(resource.name)


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


def normalise(cfg: Any) -> None:
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
