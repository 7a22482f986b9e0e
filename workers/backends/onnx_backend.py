"""`onnxruntime_onnx`: an ONNX model run with onnxruntime in the worker process (releases the GIL)."""

from __future__ import annotations

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


class OnnxBackend(InProcessBackend):
    def __init__(self, ctx: LoadContext) -> None:
        import onnxruntime as ort

        spec = ctx.spec
        path = ctx.model_dir / str(ctx.version) / spec.default_model_filename
        if not path.exists():
            raise ConfigError(f"{spec.name}: model file {path} is missing")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, int_parameter(spec, "intra_op_thread_count", 1))
        opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if ctx.device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self._session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        model_inputs = {i.name for i in self._session.get_inputs()}
        missing = [t.name for t in spec.inputs if t.name not in model_inputs]
        missing += [b.target_name for b in spec.batch_inputs if b.target_name not in model_inputs]
        if missing:
            raise ConfigError(f"{spec.name}: config inputs (or batch inputs) {missing} are not inputs of "
                              f"{path.name}")
        self._spec = spec
        self._output_names = [t.name for t in spec.outputs]

    def _feed(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for name, arr in inputs.items():
            if arr.dtype == np.object_:
                # onnxruntime string tensors take str elements; the wire carries bytes.
                arr = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])(arr)
            feed[name] = arr
        return feed

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self._session.run(self._output_names, self._feed(inputs))
        return dict(zip(self._output_names, outs, strict=True))

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return run_merged(self._spec, items, self._run)

    def close(self) -> None:
        self._session = None
