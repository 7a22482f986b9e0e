"""workers/backends/torch_backend.py: a TorchScript forward on an instance's thread runs to its end without the
GIL, and its outputs are read without another op.

The worker's event loop holds the GIL through its own work. A forward that needed it midway (torch lets go of
an input's Python object when the interpreter drops the input) stopped there until the loop let go. Here the
test's thread keeps the GIL (a switch interval no waiter reaches) while the forward runs on another thread,
and reads that thread's CPU clock from the forward's call: the forward must get through most of its work,
not stop after its first op (all it did before, the test's thread never letting the GIL go).
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleet.model_config import parse_config
from workers.backends.base import LoadContext
from workers.generate_models import _JIT_DEPRECATED

CONFIG = """platform: "pytorch_libtorch"
max_batch_size: 64
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] } ]
"""
LONGEST_S = 20.0  # a forward stopped for the GIL never gets there: the test fails after this long


def _load(root: Path, name: str, module: Any, config: str) -> Any:
    """`module` scripted and saved as model `name` under `root`, loaded by the backend as a worker would."""
    import torch

    from workers.backends.torch_backend import TorchBackend

    (root / name / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _JIT_DEPRECATED, DeprecationWarning)
        torch.jit.save(torch.jit.script(module), str(root / name / "1" / "model.pt"))
    spec = parse_config(config, source=name, model_name=name)
    return TorchBackend(LoadContext(spec=spec, model_dir=root / name, version=1, instance_name=f"{name}_0",
                                    device="cpu"))


def _backend(root: Path) -> Any:
    import torch

    class Late(torch.nn.Module):
        """Its input's last use is its first op, which is cheap; the matmuls after it are the work."""

        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(256, 1536)
            self.mid = torch.nn.Linear(1536, 1536)
            self.down = torch.nn.Linear(1536, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x + 1.0
            return self.down(torch.relu(self.mid(torch.relu(self.up(h)))))

    return _load(root, "late", Late(), CONFIG)


def _cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def test_the_forward_does_all_its_work_while_another_thread_holds_the_gil(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    backend = _backend(tmp_path)
    x = np.random.default_rng(0).random((64, 256), dtype=np.float32)
    alone: list[float] = []
    entered: list[float] = []  # the forward thread's CPU time as it calls the module
    go = threading.Event()
    called = threading.Event()

    def run() -> None:
        for _ in range(3):  # warm, then the forward alone: its CPU time
            start = time.thread_time()
            backend._run({"INPUT0": x})
            alone.append(time.thread_time() - start)
        assert go.wait(30)
        module = backend._module

        def entering(*args: object) -> object:
            entered.append(time.thread_time())
            called.set()  # the test's thread takes the GIL when this one lets go: in the forward
            return module(*args)

        backend._module = entering
        backend._run({"INPUT0": x})

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    switch = sys.getswitchinterval()
    try:
        while len(alone) < 3 and thread.is_alive():
            time.sleep(0.01)
        assert len(alone) == 3, "the forward failed on its own"
        needed = 0.7 * min(alone)  # stopped midway, it would have done only `x + 1`: well under a tenth
        sys.setswitchinterval(1000.0)  # from here this thread keeps the GIL until it blocks
        go.set()
        assert called.wait(30)
        worked, deadline = 0.0, time.monotonic() + LONGEST_S
        while worked < needed and time.monotonic() < deadline:  # holding the GIL: pure Python, nothing blocks
            worked = _cpu(thread) - entered[0]
    finally:
        sys.setswitchinterval(switch)
        thread.join(30)
        backend.close()
    assert worked >= needed, (worked, alone)


def test_outputs_are_read_one_that_requires_grad_included(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    class Scaled(torch.nn.Module):
        """Returns its input scaled, and its own parameter (which requires grad, even in inference mode)."""

        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((1, 2), 3.0))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2.0, self.scale

    backend = _load(tmp_path, "scaled", Scaled(), """platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1, 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1, 2 ] }, { name: "S", data_type: TYPE_FP32, dims: [ 1, 2 ] } ]
""")
    x = np.frombuffer(np.array([[1.0, 2.0]], dtype=np.float32).tobytes(), dtype=np.float32).reshape(1, 2)
    assert not x.flags.writeable  # as decoded from a request (zero-copy): the backend copies it
    try:
        out = backend._run({"X": x})
    finally:
        backend.close()
    assert out["Y"].tolist() == [[2.0, 4.0]] and out["S"].tolist() == [[3.0, 3.0]]


@pytest.mark.parametrize("fails", [False, True])
def test_the_forward_runs_in_inference_mode_unoptimized_and_the_thread_gets_its_modes_back(
        tmp_path: Path, fails: bool) -> None:
    """The modes are set with torch's C calls for the forward's length and put back after it, however it ends;
    the thread's list that holds the inputs for the call holds nothing after it."""
    torch = pytest.importorskip("torch")
    backend = _backend(tmp_path)
    module = backend._module
    seen: list[tuple[bool, bool]] = []
    inputs: list[Any] = []

    def recording(*args: Any) -> Any:
        seen.append((torch.is_inference_mode_enabled(), torch._C._get_graph_executor_optimize()))
        assert len(backend._configured.held) == len(args) == 1  # held for the call
        inputs.extend(args)
        if fails:
            raise RuntimeError("the model failed")
        return module(*args)

    backend._module = recording
    x = np.random.default_rng(0).random((2, 256), dtype=np.float32)
    try:
        for optimized in (True, False):  # whatever the thread had, it has again
            torch._C._set_graph_executor_optimize(optimized)
            try:
                backend._run({"INPUT0": x})
            except RuntimeError as exc:  # (checked here, while the exception still holds the call's frame)
                assert fails and str(exc) == "the model failed"
                assert (torch.is_inference_mode_enabled(), torch._C._get_graph_executor_optimize()) == \
                    (False, optimized)
            assert (torch.is_inference_mode_enabled(), torch._C._get_graph_executor_optimize()) == (False, optimized)
            assert len(backend._configured.held) == 0
    finally:
        torch._C._set_graph_executor_optimize(True)
        backend.close()
    assert seen == [(True, False), (True, False)]
    assert [tuple(i.shape) for i in inputs] == [(2, 256), (2, 256)]


def test_a_read_only_input_is_copied_without_letting_go_of_the_gil() -> None:
    """numpy lets go of the GIL to copy a large array, and the instance's thread then waits for the worker's loop
    to give it back (bench/RESULTS.md, stop 64). The backend's copy of a read-only input keeps it: a thread that
    runs only while this one lets go never runs during the copy. The copy is the input's, writable, and apart."""
    from workers.backends.torch_backend import _own_copy

    source = np.frombuffer(np.arange(1 << 22, dtype=np.float32).tobytes(), dtype=np.float32).reshape(-1, 256)
    turns = [0]
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            turns[0] += 1
            time.sleep(0)  # lets go of the GIL every turn

    thread = threading.Thread(target=other, daemon=True)
    switch = sys.getswitchinterval()
    # From here a thread keeps the GIL until it lets go of it (set before the other starts waiting for it, so
    # that no wait begun under the usual interval can force a switch later).
    sys.setswitchinterval(1000.0)
    thread.start()
    try:
        while turns[0] == 0:
            time.sleep(0.001)
        before = turns[0]
        copy = _own_copy(source)
        during = turns[0] - before
    finally:
        sys.setswitchinterval(switch)
        stop.set()
        thread.join(10)
    assert during == 0
    assert copy.flags.writeable and copy.dtype == source.dtype and copy.shape == source.shape
    assert np.array_equal(copy, source)
    copy[0, 0] = -1.0
    assert source[0, 0] == 0.0


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bool", "int8", "int16", "int32", "int64",
                                   "uint8", "uint16", "uint32", "uint64"])
def test_the_copy_of_a_read_only_input_is_its_values_in_every_layout(dtype: str) -> None:
    """Whatever a model's input may be: contiguous or strided (transposed, reversed, sliced), empty, or 0-d
    (a 0-d integer array is a size to bytearray() itself)."""
    from workers.backends.torch_backend import _own_copy

    base = (np.arange(24) % 7 + 1).astype(dtype).reshape(4, 6)
    frozen = np.frombuffer(base.tobytes(), dtype=base.dtype).reshape(base.shape)  # read-only, as decoded
    for arr in (frozen, frozen.T, frozen[::-1, ::2], frozen[1:3], frozen[:0], frozen[:, :0], frozen[2, 3:4].reshape(()),
                np.frombuffer(np.array(8, dtype=dtype).tobytes(), dtype=dtype).reshape(())):
        copy = _own_copy(arr)
        assert copy.dtype == arr.dtype and copy.shape == arr.shape and copy.flags.writeable
        assert copy.flags.c_contiguous and np.array_equal(copy, arr)
        assert not np.shares_memory(copy, frozen)
