"""What a Python model's execute() sees of its requests, as in Triton's Python backend, through a real stub
(workers/backends/python_backend.py and python_stub.py, no Redis): requested_output_names() lists every
output of the config where the client named none; correlation_id() and flags() carry a sequence's id and
START/END; a BF16 input stays BF16; a decoupled model whose execute() returns something other than None
fails each request it left open, instead of leaving the instance waiting for final flags."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet import tensors
from fleet.envelope import RequestEnvelope, SequenceFlags, WireTensor
from fleet.errors import InferenceFailed
from fleet.model_config import parse_config
from workers.backends.base import InferenceItem, LoadContext
from workers.backends.decoupled import DecoupledCall
from workers.backends.python_backend import PythonBackend
from workers.execute import run_batch

META_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] }, { name: "H", data_type: TYPE_BF16, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] }, { name: "META", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""
# Writes down what each request told it.
META_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            h = pb_utils.get_input_tensor_by_name(r, "H")
            meta = {"names": r.requested_output_names(), "corr": r.correlation_id(), "flags": r.flags(),
                    "h_type": h.triton_dtype(), "h": float(h.as_numpy().reshape(-1)[0])}
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2),
                pb_utils.Tensor("META", np.array([[json.dumps(meta).encode()]], dtype=np.object_))]))
        return responses
"""
DECOUPLED_CONFIG = """
backend: "python"
max_batch_size: 4
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""
# The first request is answered and closed through its sender; then execute() returns a list, as a
# model written for the non-decoupled mode would.
RETURNS_A_LIST = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        first = requests[0].get_response_sender()
        first.send(pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(requests[0], "IN")]),
                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
"""


def _backend(tmp_path: Path, name: str, config: str, source: str, **ctx: Any) -> PythonBackend:
    model_dir = tmp_path / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(source)
    (model_dir / "config.pbtxt").write_text(config)
    spec = parse_config(config, source="test", model_name=name)
    return PythonBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name=f"{name}_0",
                                     device="cpu", **ctx))


@pytest.fixture
def meta(tmp_path: Path) -> Iterator[PythonBackend]:
    backend = _backend(tmp_path, "meta", META_CONFIG, META_MODEL)
    try:
        yield backend
    finally:
        backend.close()


def _inputs(value: float) -> list[WireTensor]:
    bf16 = struct.pack("<f", 1.5)[2:]  # 1.5 is exact in BF16: the upper half of its FP32 bits
    return [WireTensor("IN", "FP32", (1, 1), struct.pack("<f", value)), WireTensor("H", "BF16", (1, 1), bf16)]


def _meta(result: Any) -> dict[str, Any]:
    assert result.error is None and result.wire_outputs is not None, result.error
    t = result.wire_outputs["META"]
    (raw,) = tensors.from_bytes(t.data, tensors.lookup("BYTES"), t.shape).reshape(-1)
    return dict(json.loads(raw))


def test_a_model_sees_what_triton_gives_it_of_each_request(meta: PythonBackend) -> None:
    items = [
        InferenceItem(inputs={}, wire=_inputs(1.0)),  # no outputs named: all of them, in name order
        InferenceItem(inputs={}, wire=_inputs(2.0), requested_outputs=["OUT"], correlation_id=7, flags=1),
        InferenceItem(inputs={}, wire=_inputs(3.0), correlation_id="abc", flags=3),
    ]
    plain, started, whole = (_meta(r) for r in meta.execute(items))
    assert plain == {"names": ["META", "OUT"], "corr": 0, "flags": 0, "h_type": 14, "h": 1.5}
    assert started == {"names": ["OUT"], "corr": 7, "flags": 1, "h_type": 14, "h": 1.5}
    assert whole["names"] == ["META", "OUT"] and (whole["corr"], whole["flags"]) == ("abc", 3)


def test_a_sequences_envelope_reaches_the_model_as_its_correlation_id_and_flags(meta: PythonBackend) -> None:
    spec = parse_config(META_CONFIG, source="test", model_name="meta")

    def envelope(rid: str, sequence: SequenceFlags | None) -> RequestEnvelope:
        return RequestEnvelope(id=rid, model="meta", version=1, reply_to="r", enqueued_at_us=0,
                               inputs=_inputs(1.0), sequence=sequence)

    envs = [envelope("a", SequenceFlags(12, start=True)), envelope("b", SequenceFlags("s-1", end=True)),
            envelope("c", SequenceFlags(5, start=True, end=True)), envelope("d", None)]
    outcome = run_batch(spec, meta, envs)
    seen = []
    for reply in outcome.replies:
        assert reply.ok and reply.outputs is not None, reply.error_message
        (t,) = [o for o in reply.outputs if o.name == "META"]
        (raw,) = tensors.from_bytes(t.data, tensors.lookup("BYTES"), t.shape).reshape(-1)
        doc = json.loads(raw)
        seen.append((doc["corr"], doc["flags"]))
    assert seen == [(12, 1), ("s-1", 2), (5, 3), (0, 0)]


def test_a_decoupled_execute_that_returns_a_list_fails_the_requests_it_left_open(tmp_path: Path) -> None:
    emitted: list[Any] = []
    backend = _backend(tmp_path, "listy", DECOUPLED_CONFIG, RETURNS_A_LIST,
                       emit=lambda item, response: emitted.append(response))
    try:
        items = [InferenceItem(inputs={}, wire=[WireTensor("IN", "FP32", (1, 1), struct.pack("<f", v))], key=k)
                 for k, v in (("k1", 1.0), ("k2", 2.0), ("k3", 3.0))]
        first, second, third = backend.execute(items)  # before: waited for final flags that never came
        assert first.error is None and first.wire_outputs is not None
        assert struct.unpack("<f", first.wire_outputs["IN"].data) == (1.0,)
        for failed in (second, third):
            assert failed.error is not None
            assert failed.error.message == ("Python model 'listy' is using the decoupled mode and the execute "
                                            "function must return None.")
        assert emitted == []
    finally:
        backend.close()


def test_a_decoupled_call_the_stub_could_not_run_fails_its_open_requests() -> None:
    """The stub's error reply to a decoupled call (no final flags come): the requests not complete fail
    with it; one the model completed keeps its last response."""
    items = [InferenceItem(inputs={}, key=k) for k in ("done", "open")]
    call = DecoupledCall(items, emit=lambda item, response: None)
    call.on_send({"k": "done", "f": 1})  # the final flag alone
    failed = InferenceFailed("the stub could not decode the call")
    done, still_open = call.results(lambda last: pytest.fail("no response to decode"), failed)
    assert done.empty and done.error is None
    assert still_open.error is failed
    # Without an error (every request completed, or the stub died and the caller restarts it), as before.
    assert [r.empty for r in call.results(lambda last: pytest.fail("no response"))] == [True, True]


# Forks a process of its own at initialize (as multiprocessing's default start method does), which lives
# until the test says so; IN < 0 kills the stub mid-call.
FORKING_MODEL = """
import os, signal, time
from pathlib import Path
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        stop = Path(args["model_repository"]) / "stop"
        if os.fork() == 0:
            deadline = time.monotonic() + 60
            while not stop.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        if x.reshape(-1)[0] < 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)])]
"""
PLAIN_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


def test_a_stub_killed_mid_call_is_seen_dead_though_a_process_it_forked_lives_on(tmp_path: Path) -> None:
    """The worker sees a stub die by its pipe's end; a process the model forked no longer holds that pipe
    open (before, the call waited for as long as the child lived)."""
    backend = _backend(tmp_path, "forking", PLAIN_CONFIG, FORKING_MODEL, max_deliveries=1)
    try:
        started = time.monotonic()
        (killed,) = backend.execute([InferenceItem(inputs={}, wire=[WireTensor("IN", "FP32", (1, 1),
                                                                                struct.pack("<f", -1.0))])])
        assert killed.error is not None and "killed by SIGKILL" in killed.error.message, killed.error
        assert time.monotonic() - started < 30  # the child lives 60 s
        (doubled,) = backend.execute([InferenceItem(inputs={}, wire=[WireTensor("IN", "FP32", (1, 1),
                                                                                 struct.pack("<f", 2.0))])])
        assert doubled.wire_outputs is not None and struct.unpack("<f", doubled.wire_outputs["OUT"].data) == (4.0,)
    finally:
        (tmp_path / "forking" / "stop").write_text("")
        backend.close()


HANGING_FINALIZE = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]

    def finalize(self):
        time.sleep(3600)
"""


def test_an_unload_waits_for_finalize_only_so_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finalize() that never returns: close() (an unload) kills the stub after FINALIZE_TIMEOUT_S (30 s,
    as Triton's stub timeout; 1 s here) instead of waiting for ever."""
    from workers.backends import python_backend

    monkeypatch.setattr(python_backend, "FINALIZE_TIMEOUT_S", 1.0)
    backend = _backend(tmp_path, "stuck", PLAIN_CONFIG, HANGING_FINALIZE)
    proc = backend._proc
    assert proc is not None
    started = time.monotonic()
    backend.close()
    assert time.monotonic() - started < 10 and proc.poll() is not None
