"""`onnxruntime_onnx`: an ONNX model run with onnxruntime in the worker process (releases the GIL)."""

from __future__ import annotations

import numpy as np

from fleet.errors import ConfigError, InvalidInput
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
        from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument, RuntimeException

        # onnxruntime's own verdict that the data it was given is wrong (Triton's onnxruntime backend maps
        # ORT_INVALID_ARGUMENT to TRITONSERVER_ERROR_INVALID_ARG, a 400): the client's fault, not ours.
        self._invalid_argument: type[Exception] = InvalidArgument
        self._runtime_exception: type[Exception] = RuntimeException

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
        self.host_bound = self._session.get_providers()[0] == "CPUExecutionProvider"
        self.runs_inline = self.host_bound and opts.intra_op_num_threads == 1
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
                # onnxruntime string tensors take str elements; the wire carries bytes. Bytes that are not
                # UTF-8 are refused rather than replaced: the model must see what the client sent.
                try:
                    arr = np.vectorize(lambda b: b.decode("utf-8"), otypes=[object])(arr)
                except UnicodeDecodeError:
                    raise InvalidInput(f"input '{name}' of model '{self._spec.name}' holds bytes that are not "
                                       f"UTF-8 text, which onnxruntime string tensors cannot take") from None
            feed[name] = arr
        return feed

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            outs = self._session.run(self._output_names, self._feed(inputs))
        except self._invalid_argument as exc:
            raise InvalidInput(f"model '{self._spec.name}' (onnxruntime) refused the request's data: {exc}") from exc
        except self._runtime_exception as exc:
            # A Cast over string tensors fails only on text it cannot parse as the target type (Triton's
            # simple_string given "a": "Status Message: stoll"): the data is at fault, not the model.
            # Every other runtime failure stays the model's (500), as in Triton.
            if "running Cast node" in str(exc) and any(a.dtype == np.object_ for a in inputs.values()):
                raise InvalidInput(f"model '{self._spec.name}' could not convert its string input to a number "
                                   f"(onnxruntime: {exc}): send text the model can parse") from exc
            raise
        return dict(zip(self._output_names, outs, strict=True))

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return run_merged(self._spec, items, self._run)

    def close(self) -> None:
        self._session = None
