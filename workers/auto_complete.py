"""Triton's model configuration auto-completion (`--disable-auto-complete-config` turns it off).

Workers run it, never gateways: it opens model files and runs user code. Gateways get the completed
config from the workers.

Contract:
* `complete_config(cfg, model_dir, versions)` completes a raw `ModelConfig` (parsed, not yet validated;
  possibly empty when there is no config.pbtxt) in place, and raises `ConfigError` ("<model_dir>: <why>")
  when the model contradicts it or its code fails. `fleet.model_config.spec_from_proto` then validates
  the result as it would a config.pbtxt.
* Backend (Triton core's AutoCompleteBackendFields): with neither platform nor backend, the backend
  comes from `default_model_filename` or else from the files of the highest version directory holding
  one of model.plan, model.onnx, model.pt, model.py (in Triton's order of precedence).
* ONNX (Triton's onnxruntime backend, ModelState::AutoCompleteConfig): nothing to do when the config
  has inputs (or batch inputs) and outputs. Otherwise the model is opened: if every input and output
  has a variable first dim, max_batch_size 0 becomes 4 (Triton's default-max-batch-size) and a
  model that batches (max_batch_size > 1) without a scheduler gets `dynamic_batching {}`; a model that
  cannot batch with max_batch_size > 0 fails. An empty input (or output) list is filled from the model
  (batch dim dropped when max_batch_size > 0, variable dims -1, a scalar gets dims [1]); tensors the
  config already lists are checked against the model like the backend's ValidateInputs/ValidateOutputs.
* TorchScript: a .pt file carries no usable names, so, as in Triton, only the backend is completed.
* Python (Triton's python_backend): `TritonPythonModel.auto_complete_config(pb_utils.ModelConfig)`, if
  model.py defines it, runs in a short-lived child (`python -m workers.auto_complete MODEL_PY
  PARENT_PID`: the config JSON on stdin, `{"config": ...}` or `{"error": ...}` on stdout), so user code
  never runs in the worker. The configuration it returns replaces `cfg`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from google.protobuf import json_format

from fleet.config_checks import BACKENDS, ENSEMBLE_PLATFORM, PLATFORMS, WILDCARD_DIM
from fleet.config_json import config_to_json
from fleet.config_proto import model_config_pb2 as pb
from fleet.errors import ConfigError
from fleet.lifetime import die_with_parent
from workers.backends.python_stub import SHIM_DIR, import_model_module

DEFAULT_MAX_BATCH_SIZE = 4  # Triton's --backend-config=onnxruntime,default-max-batch-size default
PYTHON_TIMEOUT_S = 60.0
# Triton core's order of precedence when a version directory holds several model files.
_MODEL_FILES = (("model.plan", "tensorrt"), ("model.onnx", "onnxruntime"), ("model.pt", "pytorch"),
                ("model.py", "python"))
_ORT_TYPES = {
    "tensor(bool)": pb.TYPE_BOOL, "tensor(uint8)": pb.TYPE_UINT8, "tensor(uint16)": pb.TYPE_UINT16,
    "tensor(uint32)": pb.TYPE_UINT32, "tensor(uint64)": pb.TYPE_UINT64, "tensor(int8)": pb.TYPE_INT8,
    "tensor(int16)": pb.TYPE_INT16, "tensor(int32)": pb.TYPE_INT32, "tensor(int64)": pb.TYPE_INT64,
    "tensor(float16)": pb.TYPE_FP16, "tensor(float)": pb.TYPE_FP32, "tensor(double)": pb.TYPE_FP64,
    "tensor(bfloat16)": pb.TYPE_BF16, "tensor(string)": pb.TYPE_STRING,
}
_Fail = Callable[[str], NoReturn]


def complete_config(cfg: pb.ModelConfig, model_dir: Path, versions: tuple[int, ...]) -> None:
    """Complete `cfg` from the model in `model_dir` (see the module contract). `versions`: the version
    directories present, ascending; the highest one holding the model file is used."""

    def fail(message: str) -> NoReturn:
        raise ConfigError(f"{model_dir}: {message}")

    if cfg.platform == ENSEMBLE_PLATFORM:
        return
    if not cfg.platform and not cfg.backend:
        inferred = _infer_backend(cfg, model_dir, versions)
        if inferred is None:
            return  # validation reports the missing platform/backend
        cfg.backend = inferred
    backend = cfg.backend or PLATFORMS.get(cfg.platform, "")
    if backend not in BACKENDS:
        return  # validation reports the unknown backend or platform
    filename = cfg.default_model_filename or BACKENDS[backend][1]
    name = cfg.name or model_dir.name
    if backend == "onnxruntime":
        _complete_onnx(cfg, name, _model_file(model_dir, versions, filename), filename, fail)
    elif backend == "python":
        path = _model_file(model_dir, versions, filename)
        if path is not None:  # without model.py, loading reports what is missing
            _complete_python(cfg, name, path, fail)


def _model_file(model_dir: Path, versions: Sequence[int], filename: str) -> Path | None:
    for version in sorted(versions, reverse=True):
        path = model_dir / str(version) / filename
        if path.exists():  # a file, or (ONNX with external data) a directory
            return path
    return None


def _infer_backend(cfg: pb.ModelConfig, model_dir: Path, versions: Sequence[int]) -> str | None:
    by_file = dict(_MODEL_FILES)
    if cfg.default_model_filename:
        return by_file.get(cfg.default_model_filename)
    for version in sorted(versions, reverse=True):
        found = [backend for filename, backend in _MODEL_FILES if (model_dir / str(version) / filename).exists()]
        if found:
            return found[0]
    return None


# --- ONNX ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _OnnxTensor:
    name: str
    data_type: int  # a model_config DataType
    dims: tuple[int, ...]  # -1 for a variable dim


def _complete_onnx(cfg: pb.ModelConfig, name: str, path: Path | None, filename: str, fail: _Fail) -> None:
    has_inputs = bool(len(cfg.input) + len(cfg.batch_input))
    has_outputs = bool(len(cfg.output))
    if has_inputs and has_outputs:
        return  # as in Triton: the model is not even opened
    if path is None:
        fail(f"unable to auto-complete model '{name}': no version directory holds '{filename}'")
    inputs, outputs = _onnx_signature(path, name, fail)
    _complete_max_batch(cfg, name, [*inputs, *outputs], fail)
    mbs = cfg.max_batch_size
    if has_inputs:
        _check_ios(cfg.input, "input", inputs, name, mbs, fail, exact=False)
    else:
        _fill_ios(cfg.input, inputs, mbs)
    if has_outputs:
        _check_ios(cfg.output, "output", outputs, name, mbs, fail, exact=True)
    else:
        _fill_ios(cfg.output, outputs, mbs)


def _onnx_signature(path: Path, name: str, fail: _Fail) -> tuple[list[_OnnxTensor], list[_OnnxTensor]]:
    import onnxruntime as ort  # lazy: only ONNX models pay for it

    opts = ort.SessionOptions()
    # Only the signature is read: graph optimisation would cost load time and change nothing here.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's errors share no useful base class
        fail(f"unable to auto-complete model '{name}': onnxruntime cannot load {path}: {exc}")

    def tensors(kind: str, args: list[Any]) -> list[_OnnxTensor]:
        out = []
        for arg in args:
            data_type = _ORT_TYPES.get(arg.type)
            if data_type is None:
                fail(f"unable to auto-complete model '{name}': {kind} '{arg.name}' has ONNX type {arg.type}, "
                     "which Triton does not support")
            # onnxruntime reports a variable dim as None or as its symbolic name.
            dims = tuple(d if isinstance(d, int) and d >= 0 else WILDCARD_DIM for d in (arg.shape or ()))
            out.append(_OnnxTensor(arg.name, data_type, dims))
        return out

    return tensors("input", session.get_inputs()), tensors("output", session.get_outputs())


def _complete_max_batch(cfg: pb.ModelConfig, name: str, tensors: Sequence[_OnnxTensor], fail: _Fail) -> None:
    """Triton's AutoCompleteMaxBatch: a model batches when every tensor has a variable first dim."""
    if all(t.dims and t.dims[0] == WILDCARD_DIM for t in tensors):
        if cfg.max_batch_size == 0:
            cfg.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        if cfg.max_batch_size > 1 and not cfg.HasField("dynamic_batching") \
                and not cfg.HasField("sequence_batching"):
            cfg.dynamic_batching.SetInParent()
    elif cfg.max_batch_size != 0:
        fail(f"autofill failed for model '{name}': model does not support batching while non-zero "
             "max_batch_size is specified")


def _fill_ios(ios: Any, tensors: Sequence[_OnnxTensor], mbs: int) -> None:
    """Triton's AutoCompleteIO, in the model's tensor order."""
    for t in tensors:
        io = ios.add()
        io.name, io.data_type = t.name, t.data_type
        dims = t.dims[1:] if mbs > 0 else t.dims
        io.dims.extend(dims or (1,))
        if not dims and mbs > 0:
            io.reshape.SetInParent()  # empty reshape: one scalar per batch item


def _check_ios(ios: Any, kind: str, tensors: Sequence[_OnnxTensor], name: str, mbs: int, fail: _Fail,
               *, exact: bool) -> None:
    """The config's own tensors against the model, like the backend's ValidateInputs/ValidateOutputs.
    Missing data types and dims are left to validation, which names them."""
    by_name = {t.name: t for t in tensors}
    for io in ios:
        t = by_name.get(io.name)
        if t is None:
            fail(f"unable to load model '{name}', unexpected inference {kind} '{io.name}', allowed {kind}s "
                 f"are: {', '.join(by_name)}")
        if io.data_type not in (pb.TYPE_INVALID, t.data_type):
            fail(f"unable to load model '{name}', configuration expects datatype "
                 f"{pb.DataType.Name(io.data_type)} for {kind} '{io.name}', model provides "
                 f"{pb.DataType.Name(t.data_type)}")
        if (kind == "input" and io.allow_ragged_batch) or not (io.dims or io.HasField("reshape")):
            continue
        dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
        if t.dims:
            _compare_dims(name, io.name, list(t.dims), dims, mbs, fail, exact=exact)
        elif any(d != 1 for d in dims):
            fail(f"unable to load model '{name}', scalar tensor '{io.name}', should only provide 1 in the "
                 f"model configuration when the model doesn't support batching. Model configuration "
                 f"provided: {_shape(dims)}.")


def _compare_dims(name: str, tensor: str, model: list[int], dims: list[int], mbs: int, fail: _Fail,
                  *, exact: bool) -> None:
    """Triton's CompareDimsSupported: a variable model dim matches any config dim unless `exact`."""
    where = f"model '{name}', tensor '{tensor}'"
    if mbs > 0 and (not model or model[0] != WILDCARD_DIM):
        fail(f"{where}: for the model to support batching the shape should have at least 1 dimension and "
             f"the first dimension must be -1; but shape expected by the model is {_shape(model)}")
    full = [WILDCARD_DIM, *dims] if mbs > 0 else dims
    ok = len(model) == len(full) and all(m == d for m, d in zip(model, full, strict=True)
                                         if exact or m != WILDCARD_DIM)
    if ok:
        return
    if mbs > 0:
        fail(f"{where}: the model expects {len(model)} dimensions (shape {_shape(model)}) but the model "
             f"configuration specifies {len(full)} dimensions (an initial batch dimension because "
             f"max_batch_size > 0 followed by the explicit tensor shape, making complete shape "
             f"{_shape(full)})")
    fail(f"{where}: the model expects {len(model)} dimensions (shape {_shape(model)}) but the model "
         f"configuration specifies {len(dims)} dimensions (shape {_shape(dims)})")


def _shape(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


# --- Python -------------------------------------------------------------------------------------


def _complete_python(cfg: pb.ModelConfig, name: str, model_py: Path, fail: _Fail) -> None:
    try:
        if b"auto_complete_config" not in model_py.read_bytes():
            return  # nothing to call: spare the worker a child interpreter per load
    except OSError as exc:
        fail(f"cannot read {model_py}: {exc}")
    doc = config_to_json(cfg)  # Triton's JSON form, which auto_complete_config code indexes
    doc["name"] = name
    argv = [sys.executable, "-m", "workers.auto_complete", str(model_py), str(os.getpid())]
    try:
        proc = subprocess.run(argv, input=json.dumps(doc), capture_output=True, text=True,
                              timeout=PYTHON_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        fail(f"auto_complete_config of model '{name}' did not return within {PYTHON_TIMEOUT_S:g} s")
    except OSError as exc:
        fail(f"cannot run auto_complete_config of model '{name}': {exc}")
    try:
        reply = json.loads(proc.stdout)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        fail(f"auto_complete_config of model '{name}' failed (exit status {proc.returncode}): "
             f"{proc.stderr.strip()[-2000:] or 'no output'}")
    if "error" in reply:
        fail(f"auto_complete_config of model '{name}' failed: {reply['error']}")
    if reply.get("config") is None:
        return  # model.py has no auto_complete_config
    completed = pb.ModelConfig()
    try:
        json_format.ParseDict(reply["config"], completed)
    except json_format.ParseError as exc:
        fail(f"auto_complete_config of model '{name}' returned an invalid configuration: {exc}")
    cfg.CopyFrom(completed)


def _run_auto_complete(model_py: Path, config_json: str) -> dict[str, Any] | None:
    """In the child: the completed config as a dict, or None when there is nothing to call."""
    sys.path.insert(0, str(SHIM_DIR))
    import triton_python_backend_utils as pb_utils

    module = import_model_module(model_py)
    hook = getattr(getattr(module, "TritonPythonModel", None), "auto_complete_config", None)
    if hook is None:
        return None  # a model.py without TritonPythonModel fails when it loads, with the stub's message
    config = pb_utils.ModelConfig(config_json)
    result = hook(config)
    if not isinstance(result, pb_utils.ModelConfig):
        raise TypeError(f"auto_complete_config function in model '{config.as_dict().get('name', '')}' must "
                        "return a valid pb.ModelConfig object.")
    completed: dict[str, Any] = result.as_dict()
    return completed


def _child_main(argv: list[str]) -> int:
    model_py, parent_pid = Path(argv[0]), int(argv[1])
    die_with_parent(signal.SIGKILL, parent_pid)
    config_json = sys.stdin.read()
    # stdout carries only the reply: the model's prints (and any C library's writes to fd 1) go to stderr.
    sys.stdout.flush()
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        reply = json.dumps({"config": _run_auto_complete(model_py, config_json)})
    except BaseException as exc:  # SystemExit too: a model that exits has not completed its config
        reply = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    with os.fdopen(reply_fd, "w", encoding="utf-8") as out:
        out.write(reply)
    sys.stderr.flush()
    # Like Triton's stub, the interpreter goes at once: threads the model started must not keep it.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
