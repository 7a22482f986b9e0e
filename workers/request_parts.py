"""A request of more rows than the model's max_batch_size, run as consecutive batches of at most that many
(`run_in_parts`), its parts' replies joined into one.

Such a request reaches a worker as a bulk job's packed request: a job may put several batches' rows in one
message (fleet/jobs/feed.py, `pack_batches`), so that what a message costs (the job worker's send and read,
Valkey's commands, the worker's read, admission, reply and acknowledgement: ~1.1 ms of CPU a 64-row message on
the test host) is paid once for several batches (bench/RESULTS.md, stop 66). The gateway refuses such a
request from a caller, as Triton does.

The model never sees more than max_batch_size rows: each part is an ordinary batch of one request (its
tensors' rows, views of the message's bytes), run on the instance's thread right after the one before; the
message gets one reply (the parts' outputs joined along the batch axis, or the error of the first part that
failed, after which no part runs) and one acknowledgement, and the statistics count one execution a part.
Between two parts a request gives way to online requests (`give_way`): the parts run so far are kept, and the rest
of its rows is queued again (workers/dispatch.py, `GaveWay`), so online requests wait for one batch, not all.
Jobs pack only for models that allow it (`ModelSpec.runs_in_parts`); a request that cannot be cut (an input
whose first dim is not its rows) is answered with an error, never run whole (the job worker then sends its
items unpacked).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
from collections.abc import Callable, Sequence

from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, error_reply
from fleet.errors import InferenceFailed, InvalidInput
from fleet.model_spec import ModelSpec
from fleet.tensors import element_count
from workers.backends.base import Backend
from workers.execute import BatchOutcome, run_batch
from workers.held import HeldRequest

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")  # a BYTES element's length prefix


def parts_of(spec: ModelSpec, env: RequestEnvelope) -> list[RequestEnvelope] | None:
    """`env` cut along the batch axis into requests of at most max_batch_size rows (the last may have fewer),
    or None where it is not cut: it fits, or the model or the request cannot be cut (see above)."""
    most = spec.max_batch_size
    if most <= 0 or (rows := env.batch_rows(True)) <= most:
        return None
    if not spec.runs_in_parts or env.sequence is not None or any(not t.shape or t.shape[0] != rows
                                                                  for t in env.inputs):
        return None
    bounds = list(range(0, rows, most)) + [rows]
    cuts: list[list[int]] = []
    for t in env.inputs:
        at = _row_offsets(t, rows, bounds)
        if at is None:
            return None
        cuts.append(at)
    views = [_bytes_view(t.data) for t in env.inputs]
    parts = []
    for i in range(len(bounds) - 1):
        n = bounds[i + 1] - bounds[i]
        inputs = [WireTensor(t.name, t.datatype, (n, *t.shape[1:]), view[at[i]:at[i + 1]])
                  for t, view, at in zip(env.inputs, views, cuts, strict=True)]
        parts.append(dataclasses.replace(env, inputs=inputs, trace=None))
    return parts


def run_in_parts(spec: ModelSpec, backend: Backend, env: RequestEnvelope, lanes: list[int] | None = None,
                 part_started: Callable[[], None] | None = None, give_way: Callable[[], bool] | None = None,
                 done_before: Sequence[BatchOutcome] = (),
                 run: Callable[[list[RequestEnvelope]], BatchOutcome] | None = None) -> BatchOutcome:
    """On the instance's thread: `env` cut (`parts_of`; an error reply if it cannot be) and each part run as a
    batch of its own (run_batch; `run` in tests), in order, until one fails; the outcome of `env` with its one
    reply, joined with the outcomes of the parts it ran before it last gave way (`done_before`). Before each part
    after the first, `part_started` is called (the watchdog times a part, not the request), and if `give_way()`
    (online requests wait), the parts run since it started are the outcome, with the rest of `env` to run later
    (`BatchOutcome.rest`). Never raises, as run_batch."""
    if run is None:
        def run(envs: list[RequestEnvelope]) -> BatchOutcome:
            return run_batch(spec, backend, envs, None, lanes)
    parts = parts_of(spec, env)
    if parts is None:
        n = env.batch_rows(spec.max_batch_size > 0)
        if n > spec.max_batch_size:  # never run whole: the model is not to see more than its max_batch_size rows
            return _joined_or_error(env, [*done_before, BatchOutcome([error_reply(env, InvalidInput(
                f"the request has {n} rows, more than max_batch_size {spec.max_batch_size}, and cannot be run as "
                "batches of at most that many (an input's first dim is not its rows, or its bytes do not divide "
                "into them)"))], 0, 0, 0)], [])
        parts = [env]  # it fits, as the rest of one that gave way may: one execution
    outcomes: list[BatchOutcome] = []
    for part in parts:
        if outcomes:
            if give_way is not None and give_way():
                break
            if part_started is not None:
                part_started()
        outcome = run([part])
        outcomes.append(outcome)
        if not outcome.replies[0].ok:
            break
    rows = [p.batch_rows(True) for p in parts[:len(outcomes)]]
    if len(outcomes) < len(parts) and outcomes[-1].replies[0].ok:  # it gave way: this time's parts, and the rest
        joined = _joined_or_error(env, outcomes, rows)
        if joined.replies[0].ok:
            joined.rest = _rows_from(env, sum(rows))
        return joined
    return _joined_or_error(env, [*done_before, *outcomes], [n for o in done_before for n in o.parts] + rows)


def _joined_or_error(env: RequestEnvelope, outcomes: list[BatchOutcome], rows: list[int]) -> BatchOutcome:
    try:
        return join(env, outcomes, rows)
    except Exception as exc:  # a bug in the joining: this request's error, never a batch failed outside the model
        log.exception("%s: joining the replies of a request's %d parts failed", env.model, len(rows))
        return BatchOutcome([error_reply(env, InferenceFailed(f"joining the request's parts failed: {exc!r}"))],
                            0, sum(o.compute_infer_ns for o in outcomes), 0, parts=rows)


class GaveWay:
    """On the event loop (workers/dispatch.py): the packed requests that gave way to online requests between
    their parts, by scheduler id: the envelope as read, the outcomes of the parts run so far, and when the first
    part started (the request's queue time ends there)."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[RequestEnvelope, list[BatchOutcome], int]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def gave_way(self, held: HeldRequest, outcome: BatchOutcome, started_us: int) -> None:
        """`held` ran some of its parts (`outcome`, with its `rest`): its envelope is the rest of its rows now."""
        assert outcome.rest is not None
        env, done, first = self._by_id.get(held.pending.request_id, (held.env, [], started_us))
        self._by_id[held.pending.request_id] = (env, [*done, outcome], first)
        held.env = outcome.rest

    def done_before(self, request_id: str) -> list[BatchOutcome]:
        """What the request ran before it gave way (none: it never did), for the job that runs its rest."""
        entry = self._by_id.get(request_id)
        return [] if entry is None else entry[1]

    def finished(self, held: HeldRequest, started_us: int) -> int:
        """`held` is answered or dropped: its envelope is the one read again. When its first part started
        (`started_us` if it never gave way)."""
        entry = self._by_id.pop(held.pending.request_id, None)
        if entry is None:
            return started_us
        held.env = entry[0]
        return entry[2]


def join(env: RequestEnvelope, outcomes: list[BatchOutcome], rows: list[int]) -> BatchOutcome:
    """The outcome of `env` from its parts' (in order; `rows`: each part's): their times summed, one reply."""
    started = time.perf_counter_ns()
    last = outcomes[-1]
    failed = not last.replies[0].ok
    reply = _error_of(env, last.replies[0]) if failed else _joined(env, [o.replies[0] for o in outcomes])
    cpu = [o.cpu_ns for o in outcomes]
    waits = [o.resource_wait_ns for o in outcomes if o.resource_wait_ns >= 0]
    return BatchOutcome(
        replies=[reply],
        compute_input_ns=sum(o.compute_input_ns for o in outcomes),
        compute_infer_ns=sum(o.compute_infer_ns for o in outcomes),
        compute_output_ns=sum(o.compute_output_ns for o in outcomes) + time.perf_counter_ns() - started,
        poisoned=[0] if failed and last.poisoned else [],
        started_ns=outcomes[0].started_ns,
        resource_wait_ns=sum(waits) if waits else -1,
        cpu_ns=sum(cpu) if all(c >= 0 for c in cpu) else -1,
        parts=rows)


def _error_of(env: RequestEnvelope, reply: ReplyEnvelope) -> ReplyEnvelope:
    return dataclasses.replace(reply, id=env.id, outputs=None)


def _joined(env: RequestEnvelope, replies: list[ReplyEnvelope]) -> ReplyEnvelope:
    """One reply whose outputs are the parts' joined along the batch axis; an error if the parts' outputs
    differ in anything but their rows (names, types, the other dims)."""
    first = replies[0]
    heads = [[(t.name, t.datatype, t.shape[1:]) for t in r.outputs or ()] for r in replies]
    if any(h != heads[0] for h in heads) or any(not t.shape for r in replies for t in r.outputs or ()):
        return error_reply(env, InferenceFailed(
            "the model's outputs differ between the parts of a request larger than its max_batch_size"))
    outputs = [WireTensor(t.name, t.datatype, (sum((r.outputs or [])[i].shape[0] for r in replies), *t.shape[1:]),
                          b"".join((r.outputs or [])[i].data for r in replies))
               for i, t in enumerate(first.outputs or ())]
    return dataclasses.replace(first, id=env.id, outputs=outputs)


def _rows_from(env: RequestEnvelope, start: int) -> RequestEnvelope:
    """`env` from row `start` on (views of its bytes; it was cut at that row, so every input divides there)."""
    rows = env.batch_rows(True)
    inputs = []
    for t in env.inputs:
        at = _row_offsets(t, rows, [start, rows])
        assert at is not None, "cut there already"
        inputs.append(WireTensor(t.name, t.datatype, (rows - start, *t.shape[1:]), _bytes_view(t.data)[at[0]:at[1]]))
    return dataclasses.replace(env, inputs=inputs, trace=None)


def _bytes_view(data: bytes | memoryview) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _row_offsets(t: WireTensor, rows: int, bounds: list[int]) -> list[int] | None:
    """The byte offsets in `t.data` where the rows at `bounds` start (the last: its end), or None where its
    bytes do not divide into `rows` rows."""
    view = _bytes_view(t.data)
    size = view.nbytes
    if t.datatype != "BYTES":
        if size % rows:
            return None
        per_row = size // rows
        return [b * per_row for b in bounds]
    per_row = element_count(t.shape[1:])  # BYTES: length-prefixed elements, walked to each row's start
    offsets, at, element = [], 0, 0
    for b in bounds:
        while element < b * per_row:
            if at + 4 > size:
                return None
            at += 4 + _LENGTH.unpack_from(view, at)[0]
            element += 1
        if at > size:
            return None
        offsets.append(at)
    return offsets if at == size else None
