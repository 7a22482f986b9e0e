"""A request larger than max_batch_size run in parts (workers/request_parts.py): cut by rows, each part an
ordinary batch the model sees at most max_batch_size rows of, the replies joined into one."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from batching.holding import Holding
from batching.policy import Pending
from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, error_reply
from fleet.errors import InvalidInput, PoisonRequest
from fleet.jobs.packing import request_batches
from fleet.model_config import parse_config
from fleet.tensors import serialize_bytes
from workers.backends.base import InferenceItem, InProcessBackend, ItemResult, run_merged
from workers.execute import BatchOutcome
from workers.held import HeldRequest
from workers.request_parts import GaveWay, join, parts_of, run_in_parts

CONFIG = ('backend: "python"\nmax_batch_size: 4\n'
          'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] },\n'
          '        { name: "S" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
          'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] },\n'
          '         { name: "T" data_type: TYPE_STRING dims: [ 1 ] } ]')
SPEC = parse_config(CONFIG, source="m", model_name="m")


def request(rows: int, rid: str = "r1") -> RequestEnvelope:
    x = np.arange(rows * 2, dtype="<f4").reshape(rows, 2)
    words = np.array([[f"w{i}" * (i % 3 + 1)] for i in range(rows)], dtype=object)
    return RequestEnvelope(id=rid, model="m", version=1, reply_to="r", enqueued_at_us=0, inputs=[
        WireTensor("IN", "FP32", (rows, 2), x.tobytes()), WireTensor("S", "BYTES", (rows, 1), serialize_bytes(words))])


class Doubler(InProcessBackend):
    """Doubles IN and repeats S twice; remembers the rows of every batch it was given."""

    def __init__(self, fail_at_call: int = -1, error: Exception | None = None) -> None:
        self.batches: list[int] = []
        self.fail_at_call, self.error = fail_at_call, error

    def _run(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append(batch["IN"].shape[0])
        if len(self.batches) - 1 == self.fail_at_call:
            raise self.error or InvalidInput("this part fails")
        return {"OUT": batch["IN"] * 2, "T": np.array([[s[0] * 2] for s in batch["S"]], dtype=object)}

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return run_merged(SPEC, items, self._run)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("rows", [5, 8, 9, 16, 17])
def test_a_request_past_max_batch_size_is_cut_into_parts_of_its_rows(rows: int) -> None:
    env = request(rows)
    parts = parts_of(SPEC, env)
    assert parts is not None
    assert [p.batch_rows(True) for p in parts] == [min(4, rows - i) for i in range(0, rows, 4)]
    assert all(p.id == env.id and p.trace is None for p in parts)
    for name in ("IN", "S"):  # the parts' bytes are the request's, in order
        whole = next(t for t in env.inputs if t.name == name)
        assert b"".join(bytes(next(t for t in p.inputs if t.name == name).data) for p in parts) == whole.data
    assert struct.unpack("<2f", bytes(parts[1].inputs[0].data)[:8]) == (8.0, 9.0)  # row 4


def test_requests_that_fit_or_cannot_be_cut_are_left_whole() -> None:
    assert parts_of(SPEC, request(4)) is None and parts_of(SPEC, request(1)) is None
    env = request(6)
    odd = dataclasses.replace(env, inputs=[env.inputs[0], WireTensor("S", "BYTES", (3, 2), env.inputs[1].data)])
    assert parts_of(SPEC, odd) is None  # an input whose first dim is not the request's rows
    torn = dataclasses.replace(env, inputs=[env.inputs[0], WireTensor("S", "BYTES", (6, 1), env.inputs[1].data[:-1])])
    assert parts_of(SPEC, torn) is None  # BYTES that do not walk to their end
    uneven = dataclasses.replace(env, inputs=[WireTensor("IN", "FP32", (6, 2), b"\0" * 47), env.inputs[1]])
    assert parts_of(SPEC, uneven) is None
    for extra in ("model_transaction_policy { decoupled: true }", "sequence_batching { }"):
        spec = parse_config(CONFIG + "\n" + extra, source="m", model_name="m")
        assert not spec.runs_in_parts and parts_of(spec, env) is None
    variable = parse_config(CONFIG.replace('name: "OUT" data_type: TYPE_FP32 dims: [ 2 ]',
                                           'name: "OUT" data_type: TYPE_FP32 dims: [ -1 ]'), source="m", model_name="m")
    assert not variable.runs_in_parts  # parts' outputs might not join along the batch axis
    assert parts_of(parse_config(CONFIG.replace("max_batch_size: 4", "max_batch_size: 0")
                                 .replace("dims: [ 2 ]", "dims: [ -1, 2 ]").replace("dims: [ 1 ]", "dims: [ -1, 1 ]"),
                                 source="m", model_name="m"), env) is None


def test_the_model_sees_at_most_max_batch_size_rows_and_the_reply_is_one() -> None:
    env = request(10)
    backend = Doubler()
    started: list[int] = []
    outcome = run_in_parts(SPEC, backend, env, part_started=lambda: started.append(len(backend.batches)))
    assert backend.batches == [4, 4, 2]
    assert started == [1, 2]  # the watchdog's clock restarts as each part after the first starts
    (reply,) = outcome.replies
    assert reply.ok and reply.id == env.id and outcome.parts == [4, 4, 2] and not outcome.poisoned
    out = {t.name: t for t in reply.outputs or []}
    assert out["OUT"].shape == (10, 2)
    assert np.array_equal(np.frombuffer(bytes(out["OUT"].data), "<f4"), np.arange(20, dtype="<f4") * 2)
    assert out["T"].shape == (10, 1)
    whole = Doubler().execute([InferenceItem(inputs={
        "IN": np.frombuffer(env.inputs[0].data, "<f4").reshape(10, 2),
        "S": np.array([[f"w{i}" * (i % 3 + 1)] for i in range(10)], dtype=object)})])[0]
    assert bytes(out["T"].data) == serialize_bytes(whole.outputs["T"] if whole.outputs else np.array([]))


def test_the_first_part_that_fails_answers_and_no_part_runs_after_it() -> None:
    env = request(12)
    backend = Doubler(fail_at_call=1)
    outcome = run_in_parts(SPEC, backend, env)
    assert backend.batches == [4, 4]  # the third part never ran
    (reply,) = outcome.replies
    assert reply.error_code == "INVALID_ARG" and reply.id == env.id and reply.outputs is None
    assert outcome.parts == [4, 4] and not outcome.poisoned


def test_a_poisoned_part_poisons_the_request() -> None:
    env = request(8)

    def run(envs: list[RequestEnvelope]) -> BatchOutcome:
        return BatchOutcome([error_reply(envs[0], PoisonRequest(3))], 0, 0, 0, poisoned=[0])
    outcome = run_in_parts(SPEC, Doubler(), env, run=run)
    assert outcome.poisoned == [0] and outcome.replies[0].error_code == "INTERNAL"


def test_a_request_that_cannot_be_cut_is_answered_an_error_and_never_runs_whole() -> None:
    env = request(6)
    odd = dataclasses.replace(env, inputs=[env.inputs[0], WireTensor("S", "BYTES", (3, 2), env.inputs[1].data)])
    seen: list[list[RequestEnvelope]] = []

    def run(envs: list[RequestEnvelope]) -> BatchOutcome:
        seen.append(envs)
        return BatchOutcome([ReplyEnvelope(id=envs[0].id)], 0, 0, 0)
    outcome = run_in_parts(SPEC, Doubler(), odd, run=run)
    assert seen == [] and outcome.parts == []
    (reply,) = outcome.replies
    assert reply.id == env.id and reply.error_code == "INVALID_ARG"
    assert "more than max_batch_size 4" in reply.error_message
    small = request(3)
    assert run_in_parts(SPEC, Doubler(), small, run=run).replies[0].ok and seen == [[small]]  # fits: one batch


def test_replies_that_cannot_be_joined_answer_an_error_and_never_raise() -> None:
    env = request(8)
    shapes = iter([(4, 2), ()])  # a later part's output without a batch dim

    def run(envs: list[RequestEnvelope]) -> BatchOutcome:
        out = WireTensor("OUT", "FP32", next(shapes), b"\0" * 32)
        return BatchOutcome([ReplyEnvelope(id=envs[0].id, outputs=[out])], 0, 0, 0)
    outcome = run_in_parts(SPEC, Doubler(), env, run=run)
    assert outcome.replies[0].error_code == "INTERNAL" and outcome.parts == [4, 4]


def test_times_add_up_and_parts_that_disagree_are_an_error() -> None:
    env = request(8)

    def outcome(outputs: list[WireTensor], infer: int, cpu: int) -> BatchOutcome:
        return BatchOutcome([ReplyEnvelope(id=env.id, outputs=outputs)], 1, infer, 2, started_ns=infer, cpu_ns=cpu,
                            resource_wait_ns=-1 if cpu < 0 else 5)
    a = [WireTensor("OUT", "FP32", (4, 2), b"a" * 32)]
    joined = join(env, [outcome(a, 10, 7), outcome(a, 20, 8)], [4, 4])
    assert (joined.compute_input_ns, joined.compute_infer_ns, joined.started_ns, joined.cpu_ns) == (2, 30, 10, 15)
    assert joined.compute_output_ns >= 4 and joined.resource_wait_ns == 10
    assert joined.replies[0].outputs == [WireTensor("OUT", "FP32", (8, 2), b"a" * 64)]
    assert join(env, [outcome(a, 1, 1), outcome(a, 1, -1)], [4, 4]).cpu_ns == -1
    other = [WireTensor("OUT", "FP32", (4, 3), b"a" * 48)]
    bad = join(env, [outcome(a, 1, 1), outcome(other, 1, 1)], [4, 4]).replies[0]
    assert bad.error_code == "INTERNAL" and "differ between the parts" in bad.error_message


def test_jobs_pack_only_on_the_bulk_lane_for_models_that_run_in_parts_and_within_half_a_window() -> None:
    assert request_batches(SPEC, 0, 4, 4096) == 4
    assert request_batches(SPEC, 0, 16, 64) == 8  # two requests of 32 rows fit a window of 64
    assert request_batches(SPEC, 0, 16, 4) == 1
    assert request_batches(SPEC, 1, 4, 4096) == 1  # a level's lane keeps its bound in rows
    decoupled = parse_config(CONFIG + "\nmodel_transaction_policy { decoupled: true }", source="m", model_name="m")
    assert request_batches(decoupled, 0, 4, 4096) == 1


def test_orphans_are_claimed_one_batch_past_the_bound_packed_or_not() -> None:
    holding = Holding(lanes=2, per_batch=4, capacity=12)
    assert holding.claim_room() == 12 + 8
    for i in range(3):
        holding.hold((1, f"{i}-0".encode()), 16)  # three packed messages: the bulk lane's bound, 48 rows
    assert holding.claim_room() == 48 + 8 - 48
    holding.hold((1, b"9-0"), 16)  # a claimed orphan past it
    assert holding.claim_room() < 0


def test_a_request_gives_way_between_parts_and_keeps_the_rest_for_later() -> None:
    env = request(10)
    backend = Doubler()
    asked: list[int] = []

    def give_way() -> bool:
        asked.append(len(backend.batches))
        return len(backend.batches) >= 1  # online requests wait once the first part has run
    first = run_in_parts(SPEC, backend, env, give_way=give_way)
    assert asked == [1] and backend.batches == [4] and first.parts == [4]  # never asked before the first part
    assert first.replies[0].ok and first.replies[0].outputs is not None and first.replies[0].outputs[0].shape == (4, 2)
    rest = first.rest
    assert rest is not None and rest.id == env.id and rest.batch_rows(True) == 6 and rest.trace is None
    for name in ("IN", "S"):  # the rest is the request's bytes from row 4 on
        whole, part = (next(t for t in e.inputs if t.name == name) for e in (env, rest))
        cut = bytes(next(t for t in (parts_of(SPEC, env) or [])[0].inputs if t.name == name).data)
        assert bytes(whole.data) == cut + bytes(part.data)
    final = run_in_parts(SPEC, backend, rest, done_before=[first])  # nobody waits now: the rest runs to its end
    assert final.rest is None and backend.batches == [4, 4, 2]
    assert final.parts == [4, 4, 2] and final.replies[0].id == env.id  # one reply for all the parts
    out = (final.replies[0].outputs or [])[0]
    assert out.shape == (10, 2)
    assert np.array_equal(np.frombuffer(bytes(out.data), "<f4"), np.arange(20, dtype="<f4") * 2)
    small = run_in_parts(SPEC, backend, request(3), give_way=lambda: True)  # the rest of one that gave way may fit
    assert small.rest is None and small.parts == [3] and small.replies[0].ok


def test_a_failed_part_never_leaves_a_rest() -> None:
    env = request(12)
    outcome = run_in_parts(SPEC, Doubler(fail_at_call=0), env, give_way=lambda: True)
    assert outcome.rest is None and not outcome.replies[0].ok and outcome.parts == [4]


def test_a_rest_that_gives_way_again_returns_only_its_own_parts() -> None:
    env = request(16)
    backend = Doubler()
    first = run_in_parts(SPEC, backend, env, give_way=lambda: True)
    assert first.parts == [4] and first.rest is not None
    second = run_in_parts(SPEC, backend, first.rest, give_way=lambda: True, done_before=[first])
    assert second.parts == [4] and second.rest is not None and second.rest.batch_rows(True) == 8
    assert (second.replies[0].outputs or [])[0].shape == (4, 2)  # this time's part alone, not the first's again
    final = run_in_parts(SPEC, backend, second.rest, done_before=[first, second])
    assert final.parts == [4, 4, 4, 4] and backend.batches == [4, 4, 4, 4]
    out = (final.replies[0].outputs or [])[0]
    assert np.array_equal(np.frombuffer(bytes(out.data), "<f4"), np.arange(32, dtype="<f4") * 2)


def test_requests_that_gave_way_are_remembered_until_answered_or_dropped() -> None:
    env = request(12)
    held = HeldRequest((1, b"5-0"), env, 1, Pending(request_id="1/5-0", lane=1, enqueued_at_us=0, deadline_us=None,
                                                               rows=12))
    store = GaveWay()
    assert not store and store.done_before("1/5-0") == [] and store.finished(held, 7) == 7
    first = run_in_parts(SPEC, Doubler(), env, give_way=lambda: True)
    store.gave_way(held, first, 100)
    assert store and held.env is first.rest and store.done_before("1/5-0") == [first]
    second = run_in_parts(SPEC, Doubler(), held.env, give_way=lambda: True, done_before=[first])
    store.gave_way(held, second, 200)
    assert store.done_before("1/5-0") == [first, second]
    assert store.finished(held, 300) == 100  # the queue time ends as the first part started
    assert held.env is env and not store  # answered (or dropped) as it was read
