"""Backend selection by config `platform` / `backend`, as Triton chooses them."""

from __future__ import annotations

from fleet.errors import Unsupported
from workers.backends.base import Backend, LoadContext


def load_backend(ctx: LoadContext) -> Backend:
    spec = ctx.spec
    kind = spec.backend or spec.platform
    if kind in ("python",):
        from workers.backends.python_backend import PythonBackend

        return PythonBackend(ctx)
    if kind in ("pytorch", "pytorch_libtorch"):
        from workers.backends.torch_backend import TorchBackend

        return TorchBackend(ctx)
    if kind in ("onnxruntime", "onnxruntime_onnx"):
        from workers.backends.onnx_backend import OnnxBackend

        return OnnxBackend(ctx)
    if kind == "sleep":
        from workers.backends.sleep_backend import SleepBackend

        return SleepBackend(ctx)
    if kind == "llm":
        from workers.backends.llm import LlmSlot

        return LlmSlot(ctx)
    if kind in ("tensorrt", "tensorrt_plan"):
        raise Unsupported(f"{spec.name}: the TensorRT backend needs a GPU worker with TensorRT installed")
    raise Unsupported(f"{spec.name}: no backend for platform '{spec.platform}' / backend '{spec.backend}'")
