"""A model's config.pbtxt: parsed with Triton's protobuf schema, validated, normalised, rendered.

Contract:
* `parse_config(text, source=, model_name=)` returns a `ModelSpec` (fleet/model_spec.py, with the specs
  it is made of) or raises `ConfigError`.
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
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

from google.protobuf import json_format, text_format

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
from fleet.config_proto import model_config_pb2 as pb
from fleet.datatypes import from_config
from fleet.errors import ConfigError
from fleet.model_spec import (
    BatchInputKind,
    BatchInputSpec,
    BatchOutputSpec,
    DynamicBatching,
    InstanceLimit,
    ModelSpec,
    QueuePolicy,
    ResourceNeed,
    TensorSpec,
    VersionPolicy,
)
from fleet.sequence_spec import parse_sequence

CONFIG_FILENAME = "config.pbtxt"
_POSITION = re.compile(r"^\d+:\d+ : ")



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
        label_filename="" if is_input else io.label_filename,
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


