"""The Backend seam: what a model instance is to the worker loop.

An instance executes a list of requests (the batch the policy formed) and returns exactly one result per
request, in order. Framework backends merge the list into batch tensors and split the outputs back;
the Python backend hands the list to `TritonPythonModel.execute` as Triton does.

Ragged batches (protocol.md §3.6): framework backends get each allow_ragged_batch input as one 1-D
tensor of every request's elements, plus the config's `batch_input` tensors computed over the batch
(`batch_tensors`); outputs named by a `batch_output` are scattered back by the source input's shape of
each request, the others are split by rows as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from batching.merge import batch_input_parts, merge, scatter, split
from fleet.config_checks import WILDCARD_DIM
from fleet.envelope import WireTensor
from fleet.errors import InferenceFailed, InvalidInput, ServingError
from fleet.model_spec import ModelSpec
from workers.custom_metrics import CustomMetricsBook


@dataclass(slots=True)
class InferenceItem:
    inputs: dict[str, np.ndarray]  # empty for backends that take wire tensors (takes_wire = True)
    requested_outputs: list[str] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    wire: list[WireTensor] = field(default_factory=list)  # the envelope's tensors, as received
    # The models waiting on this request ("model:version", workers/bls.py); empty for a caller's request.
    bls_chain: list[str] = field(default_factory=list)
    key: str = ""  # the worker's name for this request (a decoupled model's responses carry it back)
    reply_to: str = ""  # where its replies go (a decoupled model's are written as they come)
    version: int = 0
    lane: int = 0  # where it waited (0: the highest priority; the last: bulk); set for generation engines
    reads_out_of_band: bool = True  # its caller reads out-of-band replies (fleet/envelope.py)
    # A sequence model's request: its sequence's id and Triton's request flags (1 START, 2 END), what a
    # Python model reads as request.correlation_id() and request.flags(). 0 and 0 otherwise.
    correlation_id: int | str = 0
    flags: int = 0


@dataclass(slots=True)
class ItemResult:
    outputs: dict[str, np.ndarray] | None = None  # in the order the model produced them
    error: ServingError | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # Outputs already in wire form, passed through as bytes where they are their declared type: the Python
    # backend's stub encodes them, and framework backends cut them from one copy of the batch's (`_wire_outputs`).
    wire_outputs: dict[str, WireTensor] | None = None
    # A decoupled model's last word was the final flag alone: the request's final reply carries nothing.
    empty: bool = False


class BlsHandler(Protocol):
    """How a Python model's BLS call reaches other models (workers/bls.py). Thread-safe: `call` is made
    on the stub's reader thread; `reply` gets each reply frame (one, or one per response of a decoupled
    callee with "final" on the last), on any thread."""

    def call(self, frame: dict[str, Any], chain: list[str], reply: Callable[[dict[str, Any]], None]) -> None: ...


class ModelWrites(Protocol):
    """Writes a model makes from its own threads (workers/replies.py's ReplyWriter; blocking, thread-safe
    per call)."""

    def emit_many(self, frames: list[tuple[InferenceItem, dict[str, Any]]]) -> None:
        """Responses, not the last of their requests, to their callers in one round trip, in order."""

    def record_stats(self, model: str, increments: dict[str, int], gauges: dict[str, int]) -> None:
        """Adds `increments` to and sets `gauges` in the model's stats hash; raises on a Redis error."""

    @property
    def custom_metrics(self) -> CustomMetricsBook:
        """Python models' custom metrics, this worker's part (workers/custom_metrics.py)."""


@dataclass(frozen=True, slots=True)
class LoadContext:
    spec: ModelSpec
    model_dir: Path
    version: int
    instance_name: str
    device: str  # "cpu" or "cuda:N"
    # How often a request that crashes the instance when run alone is tried before it is poison.
    max_deliveries: int = 3
    bls: BlsHandler | None = None  # BLS calls of a Python model; None: they fail with UNSUPPORTED
    # Writes one of a decoupled model's responses, not the last, to its caller (workers/replies.py).
    emit: Callable[[InferenceItem, dict[str, Any]], None] | None = None
    writes: ModelWrites | None = None  # a generation engine's responses and metrics (workers/replies.py)
    worker_id: str = ""
    # Shared by the instances of one load of one version, and by nothing else (a generation engine: its
    # slots' one engine). A reload of the same version gets a fresh one.
    siblings: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """A loaded model instance. Its capabilities are members, read directly by the worker:

    * `takes_wire`: the backend reads `InferenceItem.wire` instead of decoded arrays, so a process hop
      forwards the envelope's bytes without decoding and re-encoding them.
    * `interruptible`: `kill()` can interrupt an `execute()` that hangs (the Python backend's stub is
      a process); in-process backends cannot be interrupted, so a hung one costs the worker.
    * `alive`: False after a restart failed; the worker stops advertising the model until `revive()`.
    * `revive()`: start the instance again if it is not running (on its own thread); whether it runs.
    * `kill()`: interrupt a hung `execute()` (thread-safe; a no-op where not `interruptible`).
    * `host_bound`: its compute runs on the host's CPU (False on a GPU, and for the sleep backend: the
      instance's thread only waits). The scheduler stages partial batches only where it is False.
    * `runs_inline`: `execute()` computes in this process, on the CPU, on the calling thread alone, so
      the event loop may call it itself where a batch holds the loop briefly (workers/inline.py).

    `InProcessBackend` holds the defaults of a backend that runs in the worker process.
    """

    takes_wire: ClassVar[bool]
    interruptible: ClassVar[bool]
    host_bound: bool
    runs_inline: bool

    @property
    def alive(self) -> bool: ...

    def revive(self) -> bool: ...

    def kill(self) -> None: ...

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]: ...

    def close(self) -> None: ...


@runtime_checkable
class LoopBackend(Backend, Protocol):
    """A backend whose calls the worker's event loop can make itself, without blocking (its compute runs
    in another process): `loop_ready()` says whether the next call may go that way, `start_on_loop` makes
    it (workers/execute.py's LoopRun; workers/backends/python_backend.py has the one implementation)."""

    def loop_ready(self, nbytes: int) -> bool: ...

    def start_on_loop(self, items: list[InferenceItem], loop: asyncio.AbstractEventLoop,
                      on_results: Callable[[list[ItemResult] | Callable[[], list[ItemResult]]], None]) -> bool: ...


class InProcessBackend:
    """Defaults for backends that run in the worker process (TorchScript, ONNX): they take decoded
    arrays, never die on their own (a crash takes the worker with it) and cannot be interrupted."""

    takes_wire: ClassVar[bool] = False
    interruptible: ClassVar[bool] = False
    host_bound: bool = True
    runs_inline: bool = False  # TorchScript and ONNX on the CPU say so

    @property
    def alive(self) -> bool:
        return True

    def revive(self) -> bool:
        return True

    def kill(self) -> None:
        pass


def failed(items: list[InferenceItem], exc: BaseException) -> list[ItemResult]:
    """One error result per item: a failed batch fails only its own requests."""
    err = exc if isinstance(exc, ServingError) else InferenceFailed(f"{type(exc).__name__}: {exc}")
    return [ItemResult(error=err) for _ in items]


def int_parameter(spec: ModelSpec, key: str, default: int) -> int:
    try:
        return int(spec.parameters.get(key, default))
    except ValueError:
        return default


def batch_tensors(spec: ModelSpec, shapes: Sequence[dict[str, Sequence[int]]]) -> list[dict[str, np.ndarray]]:
    """The config's `batch_input` tensors for a batch whose requests have input `shapes` (name -> shape,
    one dict per request): one dict per request, target name -> that request's part
    (batching.merge.batch_input_parts); concatenated along axis 0 they are the batch tensors. Raises
    InvalidInput if a request lacks a batch input's source input."""
    parts: list[dict[str, np.ndarray]] = [{} for _ in shapes]
    for bi in spec.batch_inputs:
        missing = [i for i, s in enumerate(shapes) if bi.source_input not in s]
        if missing:
            raise InvalidInput(f"batch input '{bi.target_name}' of model '{spec.name}' needs input "
                               f"'{bi.source_input}' in every request of the batch")
        sources = [s[bi.source_input] for s in shapes]
        for part, value in zip(parts, batch_input_parts(bi.kind, bi.datatype.numpy, sources), strict=True):
            part[bi.target_name] = value
    return parts


def _scatter_shapes(spec: ModelSpec, output: str, source: str, items: list[InferenceItem]) -> list[list[int]]:
    """Each request's shape of a BATCH_SCATTER_WITH_INPUT_SHAPE output: its config shape (with the batch
    dim), every variable dim taken from the same dim of the request's source input (Triton's naive
    mapping)."""
    ts = spec.output(output)
    assert ts is not None  # config validation: batch output targets are outputs
    dims = list(ts.reshape if ts.reshape is not None else ts.dims)
    pattern = ([WILDCARD_DIM] if spec.max_batch_size > 0 else []) + dims
    shapes = []
    for item in items:
        src = item.inputs[source].shape
        if any(d == WILDCARD_DIM and i >= len(src) for i, d in enumerate(pattern)):
            raise InvalidInput(f"output '{output}' cannot take its shape {pattern} from input '{source}' "
                               f"of shape {list(src)}")
        shapes.append([src[i] if d == WILDCARD_DIM else d for i, d in enumerate(pattern)])
    return shapes


def _rows(items: list[InferenceItem]) -> list[int]:
    """Each request's rows of a batch that is split by rows (its first input's first dim)."""
    return [next(iter(i.inputs.values())).shape[0] for i in items]


def _split_outputs(
    spec: ModelSpec, outputs: dict[str, np.ndarray], items: list[InferenceItem]
) -> list[dict[str, np.ndarray]]:
    scattered: dict[str, list[np.ndarray]] = {}
    for bo in spec.batch_outputs:
        for name in bo.target_names:
            if name in outputs:
                scattered[name] = scatter(outputs[name], _scatter_shapes(spec, name, bo.source_input, items))
    if spec.max_batch_size > 0:
        rows = _rows(items)
        plain = split({k: v for k, v in outputs.items() if k not in scattered}, rows)
    else:
        plain = [{k: v for k, v in outputs.items() if k not in scattered}]
    # Keep the model's output order (ItemResult.outputs).
    return [{k: scattered[k][i] if k in scattered else plain[i][k] for k in outputs} for i in range(len(items))]


# Output types whose wire bytes are not the array's own (BYTES is length-prefixed, BF16 converted).
_CONVERTED = frozenset({"BYTES", "BF16"})


def _wire_outputs(spec: ModelSpec, outputs: dict[str, np.ndarray],
                  items: list[InferenceItem]) -> list[dict[str, WireTensor]] | None:
    """Each request's outputs in wire form, cut as views from one copy of each batch output: one copy and a
    few calls a batch, where splitting into arrays and encoding each (workers/reply_encoding.py) takes a copy
    and ~1.3 µs a request (bench/RESULTS.md, stop 63). A copy, not a view of the array: the replies are
    written later, while the instance runs on, and a model may hand back memory it changes again. Only the
    outputs some request may want are copied: those it names (all, if one names none), and a sequence
    model's state outputs (workers/sequence_tensors.py takes the next request's state from them).

    None (split as arrays, then cast, refused or scattered per request as before) unless the model batches,
    the batch is split by rows alone (no `batch_output`), and every output is exactly its declared type
    (not BYTES or BF16, whose wire bytes are not the array's) with the batch's rows."""
    if spec.max_batch_size <= 0 or spec.batch_outputs:
        return None
    rows = _rows(items)
    total = sum(rows)
    if total <= 0:
        return None
    wanted: set[str] | None = None
    if all(item.requested_outputs is not None for item in items):
        wanted = {name for item in items for name in item.requested_outputs or ()}
        if spec.sequence is not None:
            wanted.update(st.output_name for st in spec.sequence.states)
    parts: list[dict[str, WireTensor]] = [{} for _ in items]
    for name, array in outputs.items():
        ts = spec.output(name)
        if (ts is None or type(array) is not np.ndarray or array.dtype != ts.datatype.numpy
                or ts.datatype.name in _CONVERTED or array.ndim == 0 or array.shape[0] != total):
            return None
        if wanted is not None and name not in wanted:
            continue
        data = memoryview(array.tobytes())
        row = data.nbytes // total
        rest = array.shape[1:]
        datatype = ts.datatype.name
        start = 0
        for part, count in zip(parts, rows, strict=True):
            part[name] = WireTensor(name, datatype, (count, *rest), data[start * row:(start + count) * row])
            start += count
    return parts


def _run_group(spec: ModelSpec, group: list[InferenceItem],
               run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> list[ItemResult]:
    batch = merge([i.inputs for i in group], spec.ragged_inputs)
    if spec.batch_inputs:
        parts = batch_tensors(spec, [{k: v.shape for k, v in i.inputs.items()} for i in group])
        batch.update(merge(parts))
    outputs = run(batch)
    wire = _wire_outputs(spec, outputs, group)
    if wire is not None:
        return [ItemResult(wire_outputs=w) for w in wire]
    return [ItemResult(outputs=o) for o in _split_outputs(spec, outputs, group)]


def run_merged(
    spec: ModelSpec, items: list[InferenceItem], run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
) -> list[ItemResult]:
    """Framework backends: one forward pass over the concatenated batch, outputs split per request.
    Ragged inputs go in as 1-D concatenations, with the config's batch inputs beside them.

    A failed pass over several requests is run again one request at a time: which request was at fault
    is unknown, and one client's bad data (a 400 from the backend) must not become its batch-mates'
    error. Each request ends with its own result or its own error."""
    groups = [items] if spec.max_batch_size > 0 else [[i] for i in items]  # no batching: one at a time
    results: list[ItemResult] = []
    for group in groups:
        try:
            results += _run_group(spec, group, run)
        except Exception as exc:  # a bad batch fails its own requests, never the worker
            if len(group) == 1:
                results += failed(group, exc)
                continue
            for item in group:
                try:
                    results += _run_group(spec, [item], run)
                except Exception as alone:
                    results += failed([item], alone)
    return results
