"""One batch on one instance, start to finish, off the event loop: decode the envelopes' tensors, run
the backend, encode one reply per request (workers/reply_encoding.py), and measure Triton's
compute_input/infer/output times. A batch on an instance's thread may leave the encoding to the loop
(`compute_batch`, `Computed`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from contextvars import Token
from dataclasses import dataclass, field

from fleet import log_context, tensors
from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, error_reply
from fleet.errors import InferenceFailed, PoisonRequest, ServingError
from fleet.model_spec import ModelSpec, TensorSpec
from fleet.reshape import model_shape
from workers.backends.base import Backend, InferenceItem, ItemResult, LoopBackend, failed
from workers.reply_encoding import encode_reply

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchOutcome:
    replies: list[ReplyEnvelope]
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    # Indices into the batch's envelopes whose result is PoisonRequest: the request crashed its model
    # instance every time it ran alone, so the loop dead-letters its message.
    poisoned: list[int] = field(default_factory=list)
    started_ns: int = 0  # time.perf_counter_ns() when the batch started (traced requests' COMPUTE_START)
    # Sequence models with implicit state: what each request leaves for the next of its sequence (None: none).
    states: list[object] | None = None
    # Under the rate limiter: how long the instance waited for its resources before this batch (-1: it
    # executes at will). The wait is queue time too (the batch starts once the resources are held).
    resource_wait_ns: int = -1
    # The CPU time of run_batch's own thread over the batch, and of the loop's encoding if the thread left it
    # to the loop (`Computed`) (-1: not run by run_batch, e.g. a stub's call made from the loop). The batch's
    # cost only where the backend computes on that thread (`runs_inline`): workers/inline.py's `batch_cost`.
    cpu_ns: int = -1
    # Between the backend's results and their encoding: the hand-over to the loop (`Computed`), in no compute
    # time (the traces' COMPUTE_OUTPUT_START comes after it).
    handed_over_ns: int = 0
    # A request larger than max_batch_size run as several batches (workers/request_parts.py): each one's rows,
    # each an execution in the statistics. Empty: the batch was one execution.
    parts: list[int] = field(default_factory=list)
    # Its rows not run yet: the request gave way to online requests between its parts; run later (workers/dispatch.py).
    rest: RequestEnvelope | None = None


def _decode(env: RequestEnvelope, to_arrays: bool, reshaped: dict[str, TensorSpec], batched: bool) -> InferenceItem:
    wire = env.inputs
    if reshaped:  # the model takes these inputs in its `reshape` shape (fleet/reshape.py): same bytes
        wire = [t if t.name not in reshaped else WireTensor(
            t.name, t.datatype, model_shape(reshaped[t.name].dims, reshaped[t.name].reshape or (), t.shape, batched),
            t.data) for t in wire]
    inputs = {t.name: tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape) for t in wire} \
        if to_arrays else {}
    item = InferenceItem(inputs=inputs, requested_outputs=env.outputs, parameters=env.parameters,
                         request_id=env.client_id, wire=wire, bls_chain=env.bls_chain, key=env.id,
                         reply_to=env.reply_to, version=env.version, reads_out_of_band=env.reads_out_of_band)
    if env.sequence is not None:
        item.correlation_id, item.flags = env.sequence.id, env.sequence.start | env.sequence.end << 1
    return item


def run_batch(spec: ModelSpec, backend: Backend, envs: list[RequestEnvelope],
              state_of: Callable[[ItemResult], object] | None = None, lanes: list[int] | None = None
              ) -> BatchOutcome:
    """Never raises: every failure becomes an error reply for the requests it touched. `state_of`: a
    sequence model's implicit state, taken from each request's result (workers/sequence_tensors.py).
    `lanes`: each request's lane, for backends that schedule within a batch (a generation engine).
    What is logged meanwhile (here, by the backend) names the model, version and the batch's requests."""
    return _compute(spec, backend, envs, state_of, lanes).complete()


# What the event loop takes on for a batch computed on an instance's thread (`compute_batch`): at most this many
# requests, and this many bytes of outputs to cast (wire-form outputs of another type than declared).
LOOP_ENCODE_MAX_REQUESTS = 256
LOOP_ENCODE_MAX_BYTES = 1 << 18


def compute_batch(spec: ModelSpec, backend: Backend, envs: list[RequestEnvelope],
                  state_of: Callable[[ItemResult], object] | None = None, lanes: list[int] | None = None
                  ) -> Computed | BatchOutcome:
    """run_batch up to the backend's results, whose replies `Computed.complete()` encodes: an instance's
    thread leaves that to the event loop (workers/instance.py) where `_loop_may_encode`, else encodes them
    itself (the outcome is returned). Never raises, as run_batch."""
    computed = _compute(spec, backend, envs, state_of, lanes)
    return computed if _loop_may_encode(spec, computed.results, state_of) else computed.complete()


def _compute(spec: ModelSpec, backend: Backend, envs: list[RequestEnvelope],
             state_of: Callable[[ItemResult], object] | None, lanes: list[int] | None) -> Computed:
    """The batch's inputs decoded and run through the backend, its replies still to encode."""
    token = _bind_log(spec, envs)
    cpu_started = time.thread_time_ns()
    try:
        prepared = _prepare(spec, backend, envs, lanes)
        results = _execute(spec, backend, prepared.items)
        return Computed(spec, prepared, results, state_of, time.perf_counter_ns(),
                        time.thread_time_ns() - cpu_started)
    finally:
        log_context.unbind(token)


def _loop_may_encode(spec: ModelSpec, results: list[ItemResult],
                     state_of: Callable[[ItemResult], object] | None) -> bool:
    """Whether the loop may encode these results while the thread runs on. Only outputs in wire form: those
    were copied out of the model's memory on the thread (framework backends' `_wire_outputs`, the Python
    backend's stub), where an array may be memory the model changes again in its next batch, which its
    encoding (a copy) must read first. No implicit state (copied from the outputs for the next request of a
    sequence), and few enough requests and cast bytes that the loop is held briefly."""
    if state_of is not None or len(results) > LOOP_ENCODE_MAX_REQUESTS:
        return False
    cast = 0
    for r in results:
        if r.outputs is not None:
            return False
        for name, t in (r.wire_outputs or {}).items():
            ts = spec.output(name)
            if ts is None or t.datatype != ts.datatype.name:
                cast += len(t.data)
    return cast <= LOOP_ENCODE_MAX_BYTES


@dataclass(slots=True)
class Computed:
    """A batch computed, its replies not yet encoded (compute_batch). An instance's thread hands this to the
    event loop and starts its next batch, while the loop encodes the replies (the forward lets go of the
    GIL). A bulk job's thread spent ~150 µs a batch of 64 `mlp` rows besides its forward, 62-75 of them after
    it (bench/RESULTS.md, stop 64); handed over, ~25 µs less on average, and a GPU-like model's jobs (the
    thread waits on the device) ran 1.02-1.06x as many rows a second (stop 65)."""

    spec: ModelSpec
    prepared: _Prepared
    results: list[ItemResult]
    state_of: Callable[[ItemResult], object] | None
    computed_ns: int  # time.perf_counter_ns() as the backend returned
    cpu_ns: int  # the computing thread's CPU time for the batch so far
    resource_wait_ns: int = -1  # BatchOutcome's

    def complete(self) -> BatchOutcome:
        """The batch's outcome, with its replies encoded (on whichever thread calls it): its output time is
        the encoding's own, not the wait between the thread and the loop."""
        token = _bind_log(self.spec, self.prepared.envs)
        cpu_started = time.thread_time_ns()
        try:
            outcome = _complete(self.spec, self.prepared, self.results, self.state_of, self.computed_ns)
            outcome.cpu_ns = self.cpu_ns + time.thread_time_ns() - cpu_started
            outcome.resource_wait_ns = self.resource_wait_ns
            return outcome
        finally:
            log_context.unbind(token)


# What a batch run from the loop comes back with (LoopRun.begin's `on_outcome`).
LoopOutcome = BatchOutcome | BaseException | Callable[[], BatchOutcome]


@dataclass(slots=True)
class LoopRun:
    """A batch that the event loop may run itself, for a backend that computes in another process (a
    Python-backend stub: workers/backends/python_backend.py's start_on_loop). The loop writes the call and
    is woken by the reply, with no instance thread between; what needs a thread (a BLS call on the way, a
    crashed stub) is handed to the instance's thread as a callable."""

    spec: ModelSpec
    backend: LoopBackend
    envs: list[RequestEnvelope]
    state_of: Callable[[ItemResult], object] | None
    lanes: list[int] | None

    def ready(self) -> bool:
        """Whether the backend would take this batch from the loop now (it may still decline a call that
        turns out larger than its pipe)."""
        return self.backend.loop_ready(sum(env.input_bytes for env in self.envs))

    def begin(self, loop: asyncio.AbstractEventLoop, on_outcome: Callable[[LoopOutcome], None]) -> bool:
        """Start the batch from the loop; `on_outcome` gets its outcome there (an exception: a bug outside
        the model, as `Instance` reports one from its thread), or a callable that returns it, to run on
        the instance's thread. False (nothing started): run it on the thread (`run_batch`)."""
        if not self.ready():
            return False
        token = _bind_log(self.spec, self.envs)
        try:
            try:
                prepared = _prepare(self.spec, self.backend, self.envs, self.lanes)
            except Exception as exc:  # a bug here: reported as a batch that failed outside the model
                loop.call_soon(on_outcome, exc)
                return True
            on_results = functools.partial(self._on_results, prepared, on_outcome)
            if not prepared.items:  # every request answered already (inputs that cannot be decoded)
                loop.call_soon(on_results, [])
                return True
            try:
                return self.backend.start_on_loop(prepared.items, loop, on_results)
            except Exception as exc:  # a backend bug (nothing written yet) fails this batch, never the loop
                log.exception("%s: the backend raised while starting a batch of %d", self.spec.name,
                              len(prepared.items))
                loop.call_soon(on_results, failed(prepared.items, exc))
                return True
        finally:
            log_context.unbind(token)

    def _on_results(self, prepared: _Prepared, on_outcome: Callable[[LoopOutcome], None],
                    results: list[ItemResult] | Callable[[], list[ItemResult]]) -> None:
        """On the loop: the call's results, or the rest of the call for the instance's thread."""
        if callable(results):
            on_outcome(functools.partial(self._finish, prepared, results))
            return
        token = _bind_log(self.spec, self.envs)
        outcome: BatchOutcome | BaseException
        try:
            outcome = _complete(self.spec, prepared, _checked(prepared.items, results), self.state_of)
        except Exception as exc:
            outcome = exc
        finally:
            log_context.unbind(token)
        on_outcome(outcome)

    def _finish(self, prepared: _Prepared, rest: Callable[[], list[ItemResult]]) -> BatchOutcome:
        """On the instance's thread: the call's rest (run_batch's, from where the loop left it)."""
        token = _bind_log(self.spec, self.envs)
        try:
            return _complete(self.spec, prepared, _guarded(self.spec, prepared.items, rest), self.state_of)
        finally:
            log_context.unbind(token)


def _bind_log(spec: ModelSpec,
              envs: list[RequestEnvelope]) -> Token[log_context.RequestLog | log_context.BatchLog | None]:
    """What is logged from here on is about this batch (its model, version and requests)."""
    return log_context.bind(log_context.BatchLog(spec.name, envs[0].version if envs else 0, envs))


@dataclass(slots=True)
class _Prepared:
    envs: list[RequestEnvelope]
    items: list[InferenceItem]
    early: dict[int, ReplyEnvelope]  # requests answered before the backend (inputs that cannot be decoded)
    t0: int
    t1: int


def _prepare(spec: ModelSpec, backend: Backend | LoopBackend, envs: list[RequestEnvelope],
             lanes: list[int] | None) -> _Prepared:
    t0 = time.perf_counter_ns()
    to_arrays = not backend.takes_wire
    reshaped = {t.name: t for t in spec.inputs if t.reshape is not None and not t.is_shape_tensor}
    batched = spec.max_batch_size > 0
    items: list[InferenceItem] = []
    early: dict[int, ReplyEnvelope] = {}
    for i, env in enumerate(envs):
        try:
            items.append(_decode(env, to_arrays, reshaped, batched))
            if lanes is not None:
                items[-1].lane = lanes[i]
        except ServingError as exc:
            early[i] = error_reply(env, exc)
    return _Prepared(envs, items, early, t0, time.perf_counter_ns())


def _execute(spec: ModelSpec, backend: Backend, items: list[InferenceItem]) -> list[ItemResult]:
    return _guarded(spec, items, lambda: backend.execute(items) if items else [])


def _guarded(spec: ModelSpec, items: list[InferenceItem], run: Callable[[], list[ItemResult]]) -> list[ItemResult]:
    try:
        results = run()
    except Exception as exc:  # a backend bug fails this batch's requests, never the worker loop
        log.exception("%s: the backend raised while executing a batch of %d", spec.name, len(items))
        results = failed(items, exc)
    return _checked(items, results)


def _checked(items: list[InferenceItem], results: list[ItemResult]) -> list[ItemResult]:
    if len(results) != len(items):
        err = InferenceFailed(f"backend returned {len(results)} results for {len(items)} requests")
        return [ItemResult(error=err) for _ in items]
    return results


def _complete(spec: ModelSpec, prepared: _Prepared, results: list[ItemResult],
              state_of: Callable[[ItemResult], object] | None, computed_ns: int | None = None) -> BatchOutcome:
    """The batch's outcome. `computed_ns`: when the backend returned, if that was not just now. The time
    between then and the encoding (a hand-over to the loop) is neither compute nor output: the output time
    is the encoding's own."""
    encoding_ns = time.perf_counter_ns()
    t2 = encoding_ns if computed_ns is None else computed_ns
    envs, early = prepared.envs, prepared.early
    runnable = [env for i, env in enumerate(envs) if i not in early]
    encoded = [encode_reply(spec, env, res) for env, res in zip(runnable, results, strict=True)]
    encoded.reverse()
    replies = [early[i] if i in early else encoded.pop() for i in range(len(envs))]
    t3 = time.perf_counter_ns()
    runnable_at = [i for i in range(len(envs)) if i not in early]
    poisoned = [runnable_at[k] for k, res in enumerate(results) if isinstance(res.error, PoisonRequest)]
    states: list[object] | None = None
    if state_of is not None:
        states = [None] * len(envs)
        for k, res in enumerate(results):
            states[runnable_at[k]] = state_of(res)
    t0, t1 = prepared.t0, prepared.t1
    outcome = BatchOutcome(replies, t1 - t0, t2 - t1, t3 - encoding_ns, poisoned, t0, states)
    outcome.handed_over_ns = encoding_ns - t2
    return outcome
