"""run_batch with a fake Backend (our own seam): one reply per request, in order, declared types kept."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest

from fleet.envelope import RequestEnvelope, WireTensor
from fleet.errors import InvalidInput
from fleet.model_config import parse_config
from workers import execute
from workers.backends.base import Backend, InferenceItem, InProcessBackend, ItemResult, run_merged
from workers.execute import BatchOutcome, Computed, compute_batch, run_batch

SPEC = parse_config('backend: "python"\nmax_batch_size: 4\n'
                    'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
                    'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]', source="m", model_name="m")


def env(rid: str, values: tuple[float, float], datatype: str = "FP32") -> RequestEnvelope:
    return RequestEnvelope(id=rid, model="m", version=1, reply_to="r", enqueued_at_us=0,
                           inputs=[WireTensor("IN", datatype, (1, 2), struct.pack("<2f", *values))])


class WireEcho(InProcessBackend):
    """Answers with float64 wire outputs (not the declared FP32), or an error for negative input."""

    takes_wire = True

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        out = []
        for item in items:
            assert item.inputs == {} and item.wire  # nothing was decoded for a wire backend
            x = np.frombuffer(item.wire[0].data, "<f4").astype("<f8") * 2
            if x[0] < 0:
                out.append(ItemResult(error=InvalidInput("negative")))
            else:
                out.append(ItemResult(wire_outputs={"OUT": WireTensor("OUT", "FP64", (1, 2), x.tobytes())}))
        return out

    def close(self) -> None:
        pass


def test_wire_backend_outputs_are_cast_to_the_declared_type_and_kept_in_order() -> None:
    outcome = run_batch(SPEC, WireEcho(), [env("a", (1, 2)), env("n", (-1, 0)), env("c", (3, 4))])
    assert [r.id for r in outcome.replies] == ["a", "n", "c"]
    a, n, c = outcome.replies
    assert a.outputs is not None and a.outputs[0].datatype == "FP32"
    assert struct.unpack("<2f", a.outputs[0].data) == (2.0, 4.0)
    assert n.error_code == "INVALID_ARG" and c.ok


class ArrayDoubler(InProcessBackend):
    """A backend that takes decoded arrays (the InProcessBackend default)."""

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        assert all(item.inputs for item in items)  # decoded for it
        return [ItemResult(outputs={"OUT": item.inputs["IN"] * 2}) for item in items]

    def close(self) -> None:
        pass


def test_run_batch_decodes_inputs_for_a_backend_that_does_not_take_wire() -> None:
    backend: Backend = ArrayDoubler()
    assert not backend.takes_wire
    (reply,) = run_batch(SPEC, backend, [env("a", (1.5, 2))]).replies
    assert reply.outputs is not None and struct.unpack("<2f", reply.outputs[0].data) == (3.0, 4.0)


def test_a_request_from_a_sender_that_reads_only_in_band_is_answered_in_band() -> None:
    """Across a rolling upgrade (fleet/envelope.py): a request without "ob" came from a gateway or job that
    cannot read out-of-band replies, so its reply (and the item a decoupled model answers through) say so."""
    from fleet.envelope import OUT_OF_BAND_BYTES, decode_request, encode_request, reply_payload

    old, new = env("old", (1, 2)), env("new", (3, 4))
    old.reads_out_of_band = False
    items: list[InferenceItem] = []

    class Big(InProcessBackend):
        def execute(self, batch: list[InferenceItem]) -> list[ItemResult]:
            items.extend(batch)
            return [ItemResult(outputs={"OUT": np.zeros((1, OUT_OF_BAND_BYTES // 4), np.float32)}) for _ in batch]

        def close(self) -> None:
            pass

    wired = [decode_request(encode_request(e)) for e in (old, new)]  # as the worker reads them
    assert [e.reads_out_of_band for e in wired] == [False, True]
    spec = parse_config('backend: "python"\nmax_batch_size: 4\n'
                        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
                        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]', source="m", model_name="m")
    replies = run_batch(spec, Big(), wired).replies
    assert all(r.ok for r in replies)
    assert [r.out_of_band for r in replies] == [False, True]
    assert [i.reads_out_of_band for i in items] == [False, True]
    old_reply, new_reply = (reply_payload(r) for r in replies)
    assert isinstance(old_reply, bytes) and old_reply[0] != 0xC1  # one msgpack map, as an old gateway reads
    assert not isinstance(new_reply, bytes)


class Waiter(ArrayDoubler):
    """Waits 50 ms without computing, while another thread of the process computes (as a batch on an
    instance's thread waits for the GIL or a core, and the loop's thread works meanwhile). The sleep is
    the thing measured here, not a way to wait for something."""

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        other = threading.Thread(target=_spin, args=(30_000_000,))  # 30 ms of its own CPU, however long
        other.start()
        time.sleep(0.05)
        other.join()
        return super().execute(items)


class Spinner(ArrayDoubler):
    """Computes for 30 ms of its thread's CPU."""

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        _spin(30_000_000)
        return super().execute(items)


def _spin(cpu_ns: int) -> None:
    started = time.thread_time_ns()
    while time.thread_time_ns() - started < cpu_ns:
        sum(range(100))


def test_a_batch_counts_its_own_thread_s_cpu_not_its_waits_nor_other_threads() -> None:
    """workers/inline.py's `batch_cost` for a batch on an instance's thread."""
    waited = run_batch(SPEC, Waiter(), [env("a", (1, 2))])
    assert waited.replies[0].ok
    assert waited.compute_infer_ns >= 50_000_000  # the statistics keep the wall time
    assert 0 <= waited.cpu_ns < 25_000_000  # not the wall time, nor the other thread's 30 ms of CPU
    spun = run_batch(SPEC, Spinner(), [env("a", (1, 2))])
    assert spun.replies[0].ok and spun.cpu_ns >= 30_000_000  # what it computed is counted


class MergedDoubler(InProcessBackend):
    """A framework backend's way (workers/backends/base.py's run_merged): one pass over the batch, its outputs
    cut per request in wire form from one copy."""

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return run_merged(SPEC, items, lambda batch: {"OUT": batch["IN"] * 2})

    def close(self) -> None:
        pass


def test_a_computed_batch_is_encoded_by_whoever_completes_it_and_times_only_that(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An instance's thread computes up to the results and leaves the replies to the loop (workers/instance.py):
    the replies are run_batch's, encoded on the thread that calls complete(); the wait between the two counts
    as neither compute nor output time."""
    encoded_on: list[int] = []
    encode = execute.encode_reply

    def recording_encode(*args: object) -> object:
        encoded_on.append(threading.get_ident())
        return encode(*args)  # type: ignore[arg-type]

    envs = [env("a", (1, 2)), env("b", (-1, 0.5))]
    whole = run_batch(SPEC, MergedDoubler(), envs)
    monkeypatch.setattr(execute, "encode_reply", recording_encode)
    computed: list[Computed | BatchOutcome] = []
    worker = threading.Thread(target=lambda: computed.append(compute_batch(SPEC, MergedDoubler(), envs)))
    worker.start()
    worker.join()
    assert encoded_on == []  # nothing encoded by the computing thread
    (result,) = computed
    assert isinstance(result, Computed)
    result.resource_wait_ns = 1234  # as a rate-limited instance's thread sets it
    before = time.perf_counter_ns()
    outcome = result.complete()
    after = time.perf_counter_ns()
    assert encoded_on == [threading.get_ident()] * 2
    assert [(r.id, r.outputs) for r in outcome.replies] == [(r.id, r.outputs) for r in whole.replies]
    assert struct.unpack("<2f", outcome.replies[1].outputs[0].data) == (-2.0, 1.0)  # type: ignore[index]
    assert outcome.compute_infer_ns == result.computed_ns - result.prepared.t1  # up to the backend's return
    assert outcome.handed_over_ns >= before - result.computed_ns  # the hand-over, in no compute time
    assert 0 <= outcome.compute_output_ns <= after - before  # the encoding's own
    assert outcome.resource_wait_ns == 1234


def test_only_outputs_copied_out_of_the_model_go_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop encodes a batch only if every output is in wire form (copied out of the model's memory on the
    thread), the model keeps no implicit state, and the batch's requests and cast bytes (outputs of another
    type than declared) are within LOOP_ENCODE_MAX_REQUESTS and LOOP_ENCODE_MAX_BYTES."""
    monkeypatch.setattr(execute, "LOOP_ENCODE_MAX_BYTES", 16)  # one request's 2 floats as FP64: 16 bytes
    monkeypatch.setattr(execute, "LOOP_ENCODE_MAX_REQUESTS", 3)
    three = [env("a", (1, 2)), env("b", (3, 4)), env("c", (5, 6))]
    assert isinstance(compute_batch(SPEC, MergedDoubler(), three), Computed)
    assert isinstance(compute_batch(SPEC, WireEcho(), three[:1]), Computed)  # 16 bytes cast
    cast = compute_batch(SPEC, WireEcho(), three[:2])  # 32
    assert isinstance(cast, BatchOutcome) and [r.ok for r in cast.replies] == [True, True]
    for outcome in (compute_batch(SPEC, ArrayDoubler(), three[:1]),  # arrays
                    compute_batch(SPEC, MergedDoubler(), [*three, env("d", (7, 8))]),  # four requests
                    compute_batch(SPEC, MergedDoubler(), three, state_of=lambda result: None)):  # implicit state
        assert isinstance(outcome, BatchOutcome) and all(r.ok for r in outcome.replies)


def test_a_model_that_reuses_its_output_buffer_answers_each_batch_with_its_own_values() -> None:
    """An output array may be memory the model changes again in its next batch: it is read (copied) before the
    thread starts that batch, never left to the loop."""

    class Reusing(InProcessBackend):
        def __init__(self) -> None:
            self.buffer = np.zeros((1, 2), np.float32)

        def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
            self.buffer[:] = items[0].inputs["IN"] * 2
            return [ItemResult(outputs={"OUT": self.buffer})]

        def close(self) -> None:
            pass

    backend = Reusing()
    first = compute_batch(SPEC, backend, [env("a", (1, 2))])
    compute_batch(SPEC, backend, [env("b", (5, 6))])  # the thread's next batch, before the loop encodes
    outcome = first.complete() if isinstance(first, Computed) else first
    assert struct.unpack("<2f", outcome.replies[0].outputs[0].data) == (2.0, 4.0)  # type: ignore[index]
