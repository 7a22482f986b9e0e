"""What a model's config says, validated and normalised: `ModelSpec` and the specs it is made of (its
tensors, batching, queue policy, version policy, rate-limiter needs). Read-only values: fleet/model_config.py
builds them from config.pbtxt (parsing, Triton's checks and normalisation), and everything that serves a
model reads them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from fleet.config_json import config_to_json
from fleet.datatypes import Datatype
from fleet.envelope import WireTensor
from fleet.sequence_spec import SequenceSpec


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
    label_filename: str = ""  # an output's class labels, one per line, in the model's directory


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
    # Derived, looked up per request (workers/reply_encoding.py): built once here instead of by a scan each time.
    _outputs_by_name: Mapping[str, TensorSpec] = field(init=False, repr=False, compare=False)
    has_ragged_inputs: bool = field(init=False, repr=False, compare=False)  # an input allows ragged batches

    def __post_init__(self) -> None:
        by_name: dict[str, TensorSpec] = {}
        for t in self.outputs:
            by_name.setdefault(t.name, t)  # the first of a name, as a scan finds it
        object.__setattr__(self, "_outputs_by_name", by_name)
        object.__setattr__(self, "has_ragged_inputs", any(t.allow_ragged_batch for t in self.inputs))

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
        return self._outputs_by_name.get(name)

    @property
    def metadata_platform(self) -> str:
        """What model metadata reports as `platform`: platform if set, else backend (§1.5)."""
        return self.platform or self.backend

    @property
    def runs_in_parts(self) -> bool:
        """Whether a request of more rows than max_batch_size may run as several batches of at most that many
        (workers/request_parts.py; a bulk job's packed requests, fleet/jobs/feed.py): a model that batches, on
        instances of its own (not an ensemble), keeps no state across requests (not a sequence model), answers
        each request once (not decoupled), takes no shape tensors, and whose outputs have fixed dims past the
        batch's (so its parts' outputs join along the batch axis)."""
        return self.max_batch_size > 0 and not (self.decoupled or self.sequence_batching or self.ensemble) \
            and not any(t.is_shape_tensor for t in self.inputs) and all(-1 not in t.dims for t in self.outputs)

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
        names = (inputs[0].name,) if len(inputs) == 1 else tuple(sorted(t.name for t in inputs))
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
