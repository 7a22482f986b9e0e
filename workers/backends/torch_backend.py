"""`pytorch_libtorch`: a TorchScript model.pt run in the worker process (torch releases the GIL).

Inputs are fed positionally in config order, then the config's batch inputs in config order; the output
(tensor, tuple or list) maps to the config's outputs in order, as Triton's libtorch backend does without
INPUT__i naming.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np

from fleet.errors import ConfigError
from workers.backends.base import (
    InferenceItem,
    InProcessBackend,
    ItemResult,
    LoadContext,
    int_parameter,
    run_merged,
)


def _own_copy(arr: np.ndarray) -> np.ndarray:
    """A writable copy of `arr`, in C order, made without letting go of the GIL. numpy's copy of more than a
    few hundred elements lets go of it, and this thread then waits to get it back from the worker's event
    loop, which holds it through its own work (up to the switch interval, workers/gil.py): in a served worker
    on a bulk job's 64-row batches, 45-60 µs a batch on average (19-22 of them the thread's CPU), against 6-8
    this way (bench/RESULTS.md, stop 64). Through the array's memoryview (`.data`): bytearray() of a 0-d
    integer array would take it for a size."""
    return np.frombuffer(bytearray(arr.data), dtype=arr.dtype).reshape(arr.shape)


class TorchBackend(InProcessBackend):
    def __init__(self, ctx: LoadContext) -> None:
        import torch

        self._torch = torch
        spec = ctx.spec
        if any(t.datatype.name == "BYTES" for t in (*spec.inputs, *spec.outputs)):
            raise ConfigError(f"{spec.name}: TorchScript models cannot take or return BYTES tensors")
        # Triton's pytorch backend reads the same parameter. It must be applied on the thread that
        # runs the model: OpenMP keeps the team size per thread, and an instance thread left at the
        # default gets a team of one thread per core whose idle member spin-waits (measured: 80% of a
        # core burnt next to a 10% model, taking the CPU the gateway needs).
        self._threads = max(1, int_parameter(spec, "INTRA_OP_THREAD_COUNT", 1))
        self._configured = threading.local()
        self._device = torch.device(ctx.device)
        self.host_bound = self._device.type == "cpu"
        # A forward on the loop's thread would give that thread an OpenMP team of its own (above).
        self.runs_inline = self.host_bound and self._threads == 1
        path = ctx.model_dir / str(ctx.version) / spec.default_model_filename
        if not path.exists():
            raise ConfigError(f"{spec.name}: model file {path} is missing (run `make models`?)")
        with warnings.catch_warnings():  # TorchScript is what Triton's pytorch backend loads: deprecated or not
            warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
            module = torch.jit.load(str(path), map_location=self._device)
        self._module = module.eval()
        self._spec = spec
        self._arg_names = [t.name for t in spec.inputs] + [b.target_name for b in spec.batch_inputs]

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        held = getattr(self._configured, "held", None)
        if held is None:  # this thread's first batch
            torch.set_num_threads(self._threads)
            held = self._configured.held = torch._C.ScriptList([torch.empty(0)])  # a list of tensors...
            held.pop()  # ...empty
        args = []
        for name in self._arg_names:
            arr = inputs[name]
            if not arr.flags.writeable:
                # A view of the request's bytes (zero-copy decode): torch.from_numpy would share it (with a
                # warning), and a model that writes its input in place would write into an immutable bytes.
                arr = _own_copy(arr)
            tensor = torch.from_numpy(arr)
            # On the CPU, no .to(): it would return the same tensor, after letting go of the GIL (below).
            args.append(tensor if self.host_bound else tensor.to(self._device))
        # A C++ list holding the inputs for the call's length, so that the forward does not take the GIL
        # when the interpreter drops an input (its last use). Without it that brings the tensor's C++ count
        # from 2 to 1, and torch then lets go of the Python object it owns, which takes the GIL in the
        # middle of the forward: from the worker's event loop, which holds it through its own work (up to
        # the switch interval, or through a long socket write). Measured beside a busy Python thread: two
        # waits for the GIL a forward without it, one (at the end) with it (bench/RESULTS.md, stop 46).
        # The thread's own list, made once: a new ScriptList a batch (its type inferred from the elements)
        # took 85 µs with the caches cold, as they are between served batches, against 8 to append to
        # this one. With the modes below set by torch's C calls rather than its Python context managers
        # (inference_mode, optimized_execution), what a batch spends around its forward went, caches flushed,
        # from ~100 µs before it and ~25 after to ~35 in all; in a served worker, from 70-113 µs before it to
        # 30-57 (bench/RESULTS.md, stop 63).
        # Not optimized: TorchScript's profiling executor re-specialises on new batch shapes (a 25 ms stall
        # on first sight of each); the plain interpreter is as fast here. Both modes are the thread's own,
        # set for the call and put back after it, as the context managers do (`torch.inference_mode()` enters
        # and exits the same guard).
        optimized = torch._C._get_graph_executor_optimize()
        inference = torch._C._InferenceMode(True)
        inference.__enter__()
        try:
            torch._C._set_graph_executor_optimize(False)
            for arg in args:
                held.append(arg)
            out: Any = self._module(*args)
        finally:
            for _ in range(len(held)):
                held.pop()
            torch._C._set_graph_executor_optimize(optimized)
            inference.__exit__(None, None, None)
        if isinstance(out, torch.Tensor):
            out = (out,)
        # An output on the CPU is read as it is: no detach() or cpu() call, each of which lets go of the
        # GIL (torch's bindings do, around every op) and may have to wait for the loop to get it back.
        return {t.name: o.numpy() if o.is_cpu and not o.requires_grad else o.detach().cpu().numpy()
                for t, o in zip(self._spec.outputs, out, strict=False)}

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return run_merged(self._spec, items, self._run)

    def close(self) -> None:
        self._module = None
