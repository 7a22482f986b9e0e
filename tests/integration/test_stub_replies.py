"""Who reads a Python-backend stub's pipes (workers/backends/python_backend.py, stub_pipe.py and
stub_channel.py). The worker's end: the thread that makes a call reads its reply itself while the stub
writes nothing between calls, and so may the event loop (`start_on_loop`); a stub that may (a model with
custom metrics flushes them, a model's own thread makes BLS calls, a decoupled model sends after execute()
returns) gets a reader thread. The stub's end: its main loop reads the worker's calls until a BLS call's
replies need a reader thread."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import uvloop

from fleet.custom_metrics import decode
from fleet.envelope import WireTensor
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from workers.backends.base import InferenceItem, ItemResult, LoadContext
from workers.backends.python_backend import PythonBackend
from workers.custom_metrics import CustomMetricsBook

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""
# Counts each call's rows twice: once in execute(), once more from a timer after execute() has returned.
LATE_METRICS_MODEL = """
import threading
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.rows = pb_utils.MetricFamily("late_rows", "rows, counted late", pb_utils.MetricFamily.COUNTER).Metric()

    def execute(self, requests):
        self.rows.increment(len(requests))
        threading.Timer(0.3, self.rows.increment, args=(len(requests),)).start()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
"""

# A thread of the model's own makes a BLS call between calls, once told to (a file), and writes down what
# it got back.
THREADED_BLS_MODEL = """
import threading, time
from pathlib import Path
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.dir = Path(args["model_repository"])
        threading.Thread(target=self._later, daemon=True).start()

    def _later(self):
        while not (self.dir / "go").exists():
            time.sleep(0.02)
        response = pb_utils.InferenceRequest(model_name="elsewhere", requested_output_names=["OUT"],
                                             inputs=[pb_utils.Tensor("IN", np.ones([1, 1], np.float32))]).exec()
        (self.dir / "got").write_text(response.error().message() if response.has_error() else "a result")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
"""


def _item(value: float) -> InferenceItem:
    return InferenceItem(inputs={}, wire=[WireTensor("IN", "FP32", (1, 1), struct.pack("<f", value))])


def _doubled(backend: PythonBackend, value: float) -> float:
    (result,) = backend.execute([_item(value)])
    assert result.error is None and result.wire_outputs is not None, result.error
    (out,) = struct.unpack("<f", result.wire_outputs["OUT"].data)
    return float(out)


def _model(tmp_path: Path, name: str, source: str) -> tuple[Path, ModelSpec]:
    """A model directory of `source` and CONFIG, and its config."""
    model_dir = tmp_path / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(source)
    (model_dir / "config.pbtxt").write_text(CONFIG)
    return model_dir, parse_config(CONFIG, source="test", model_name=name)


def _readers(instance: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"{instance}-reader"]


def test_a_plain_model_is_read_by_its_caller_and_survives_its_stub_dying_between_calls() -> None:
    model_dir = ROOT / "tests" / "models" / "doubler"
    spec = parse_config((model_dir / "config.pbtxt").read_text(), source=str(model_dir), model_name="doubler")
    backend = PythonBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="plain_0",
                                        device="cpu"))
    try:
        assert [_doubled(backend, v) for v in (1.0, 2.5, -3.0)] == [2.0, 5.0, -6.0]
        assert _readers("plain_0") == []
        # Killed while idle: nobody reads the pipe then; the next call finds it closed, restarts the stub
        # and runs the request again alone (a crash), answering it.
        proc = backend._proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert _doubled(backend, 4.0) == 8.0
        assert backend.alive and backend._proc is not proc
        assert _doubled(backend, 0.5) == 1.0
        assert _readers("plain_0") == []
    finally:
        backend.close()


def test_metrics_changed_between_calls_reach_the_worker_without_another_call(tmp_path: Path) -> None:
    model_dir, spec = _model(tmp_path, "late", LATE_METRICS_MODEL)
    published: list[float] = []
    lock = threading.Lock()

    def publish(model: str, part: bytes) -> None:
        with lock:
            published.extend(s.value for f in decode(msgpack.unpackb(part)) if f.name == "late_rows"
                             for s in f.series)

    book = CustomMetricsBook(publish)
    backend = PythonBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="late_0",
                                        device="cpu", writes=SimpleNamespace(custom_metrics=book)))  # type: ignore[arg-type]
    try:
        assert _doubled(backend, 3.0) == 6.0
        with lock:
            assert published[-1] == 1.0  # counted in execute(): published before the call returned
        assert len(_readers("late_0")) == 1  # the stub flushes between calls: a thread reads them
        deadline = time.monotonic() + 10
        while True:  # the timer's count, flushed by the stub within its METRICS_FLUSH_S, with no call made
            with lock:
                if published[-1] == 2.0:
                    break
            assert time.monotonic() < deadline, f"the late count never arrived: {published}"
            time.sleep(0.05)
        assert _doubled(backend, 1.0) == 2.0  # calls go on through the reader thread
        assert len(_readers("late_0")) == 1
    finally:
        backend.close()


def test_a_bls_call_from_a_models_own_thread_between_calls_is_answered(tmp_path: Path) -> None:
    model_dir, spec = _model(tmp_path, "threaded", THREADED_BLS_MODEL)
    backend = PythonBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="threaded_0",
                                        device="cpu"))  # no BLS handler here: the call is answered UNSUPPORTED
    try:
        assert len(_readers("threaded_0")) == 1  # the model has a thread of its own since initialize()
        (model_dir / "go").write_text("")
        deadline = time.monotonic() + 10
        while not (model_dir / "got").exists():  # with no call in flight
            assert time.monotonic() < deadline, "the BLS call made between calls was never answered"
            time.sleep(0.05)
        assert "BLS calls are not available" in (model_dir / "got").read_text()
        assert _doubled(backend, 2.0) == 4.0
    finally:
        backend.close()

# OUT = how many reader threads this stub runs; a negative input makes a BLS call first (below -5, from
# a thread of the model's own that execute() waits for).
READERS_MODEL = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

def bls(x):
    pb_utils.InferenceRequest(model_name="elsewhere", requested_output_names=["OUT"],
                              inputs=[pb_utils.Tensor("IN", x)]).exec()

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if (x < -5).any():
                t = threading.Thread(target=bls, args=(x,))
                t.start()
                t.join()
            elif (x < 0).any():
                bls(x)
            readers = sum(t.name == "stub-reader" for t in threading.enumerate())
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full_like(x, readers))]))
        return out
"""


@pytest.mark.parametrize("caller", ["execute", "a thread of the model's"])
def test_a_stub_reads_its_own_pipe_until_a_bls_call_needs_a_reader(tmp_path: Path, caller: str) -> None:
    model_dir, spec = _model(tmp_path, "readers", READERS_MODEL)
    backend = PythonBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="readers_0",
                                        device="cpu"))  # no BLS handler here: the call is answered UNSUPPORTED
    bls = -1.0 if caller == "execute" else -10.0
    try:
        assert [_doubled(backend, v) for v in (1.0, 2.0)] == [0.0, 0.0]  # OUT: the stub's main loop reads its pipe
        assert _doubled(backend, bls) == 1.0  # a BLS call's replies need a reader: started before it went out
        assert _doubled(backend, 3.0) == 1.0  # and it reads from then on
        assert _readers("readers_0") == []  # the worker's end still reads each reply on the calling thread
    finally:
        backend.close()


async def _call_on_loop(backend: PythonBackend, value: float) -> tuple[bool, float]:
    """A call the event loop makes: (whether the loop had the results itself, OUT)."""
    assert backend.loop_ready(4)
    loop = asyncio.get_running_loop()
    got: asyncio.Future[list[ItemResult] | Callable[[], list[ItemResult]]] = loop.create_future()
    backend.start_on_loop([_item(value)], loop, got.set_result)
    outcome = await got
    on_loop = not callable(outcome)
    results = outcome if not callable(outcome) else await asyncio.to_thread(outcome)
    (result,) = results
    assert result.error is None and result.wire_outputs is not None, result.error
    return on_loop, struct.unpack("<f", result.wire_outputs["OUT"].data)[0]


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_the_event_loop_makes_a_call_and_hands_one_with_a_bls_call_to_a_thread(
        tmp_path: Path, run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    model_dir, spec = _model(tmp_path, "loop", READERS_MODEL)
    backend = PythonBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="loop_0",
                                        device="cpu"))

    async def call(value: float) -> tuple[bool, float]:
        return await _call_on_loop(backend, value)

    def blocking() -> bool:
        return os.get_blocking(backend._pipe._in.fileno())

    async def main() -> None:
        assert await call(1.0) == (True, 0.0)
        assert not blocking()  # left non-blocking for the loop's next call (not set back and forth each call)
        # A call larger than the pipe takes without the stub reading: declined, nothing written.
        size = backend._pipe.capacity
        assert not backend.loop_ready(size)
        big = InferenceItem(inputs={}, wire=[WireTensor("IN", "FP32", (1, size // 4), bytes(size))])
        assert not backend.start_on_loop([big], asyncio.get_running_loop(), lambda _: None)
        proc = backend._proc
        assert await call(-1.0) == (False, 1.0)  # the BLS call's frame came first: the rest on a thread
        assert blocking()  # which read the pipe blocking
        assert await call(2.0) == (True, 1.0)
        assert not blocking()
        assert backend._proc is proc and proc is not None  # no restart on the way
        os.kill(proc.pid, signal.SIGKILL)  # the stub gone between calls: the loop sees the pipe closed
        proc.wait(10)
        assert await call(4.0) == (False, 0.0)  # the thread restarts it and runs the request again
        assert await call(5.0) == (True, 0.0)

    try:
        run(main())  # the loop leaves the pipe it read non-blocking: a thread's reads make it blocking first
    finally:
        backend.close()


# Starts a thread of its own in its first execute(): from that reply on, its stub may write between calls.
THREAD_LATER_MODEL = """
import threading
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        if not hasattr(self, "idle"):
            self.idle = threading.Thread(target=threading.Event().wait, daemon=True)
            self.idle.start()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
"""


def test_a_reply_the_event_loop_read_that_starts_a_reader_leaves_the_pipe_blocking_for_it(tmp_path: Path) -> None:
    model_dir, spec = _model(tmp_path, "late_loop", THREAD_LATER_MODEL)
    backend = PythonBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="late_loop_0",
                                        device="cpu"))

    proc = backend._proc
    try:
        # Its reply says the stub writes between calls: the call is finished on a thread.
        assert uvloop.run(_call_on_loop(backend, 3.0)) == (False, 6.0)
        assert not backend.loop_ready(4) and len(_readers("late_loop_0")) == 1
        assert _doubled(backend, 1.0) == 2.0  # read by the reader thread, from the pipe the loop left non-blocking
        assert os.get_blocking(backend._pipe._in.fileno())
        assert backend._proc is proc  # no restart on the way (a non-blocking read would have looked like one)
    finally:
        backend.close()
