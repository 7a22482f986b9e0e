"""fleet's stand-in for Triton's `triton_python_backend_utils` (imported by models as `pb_utils`).

The Python backend worker puts this folder on `sys.path` in the model's subprocess, so a Triton
Python-backend `model.py` runs unchanged. The surface follows protocol.md §5.2 and Triton's
python_backend (`src/resources/triton_python_backend_utils.py` for the pure-Python helpers,
`src/pb_stub.cc` for the pybind classes); argument names and defaults match Triton's.

What the worker uses (underscore names are fleet-internal, not part of Triton's surface):
    _incoming_request(inputs, ...) -> InferenceRequest   build what execute() receives
    Tensor._datatype()                                    protocol name ("FP32", "BYTES", ...)
    InferenceResponse.output_tensors()/.error()           read a returned response
    TritonError.code().name                               "INTERNAL", "INVALID_ARG", ... (fleet ErrorCode)
    request.get_response_sender().sent                    [(response | None, flags), ...] in send order
    request._release_flags                                what the model passed to set_release_flags
    _bls_executor / _bls_async_executor                   hooks that make BLS exec()/async_exec() work

torch is never imported at module import time (only inside the DLPack helpers).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# --- constants (TRITONSERVER_* values as pb_stub.cc exports them) --------------------------------

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
# PreferredMemory::MemoryType in the python backend (GPU=0, CPU=1, DEFAULT=2).
TRITONSERVER_MEMORY_GPU = 0
TRITONSERVER_MEMORY_CPU = 1
_MEMORY_DEFAULT = 2

_BLS_UNSUPPORTED = "BLS (calling another model from a Python model) is not supported yet"

# Set by the stub (workers/backends/stub_bls.py) to enable BLS: `_bls_executor(request, decoupled)`
# returns an InferenceResponse (or an iterator of them when decoupled). `_bls_async_executor` is the
# awaitable twin; without it async_exec() runs `_bls_executor` in a thread.
_bls_executor: Callable[[InferenceRequest, bool], Any] | None = None
_bls_async_executor: Callable[[InferenceRequest, bool], Any] | None = None


_SHIM_DIR = os.path.dirname(os.path.abspath(__file__))


class PreferredMemory:
    def __init__(self, preferred_memory_type: int = _MEMORY_DEFAULT, preferred_device_id: int = 0):
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


# Datatypes, errors and Tensor live next door. Models import this module as a top-level one (the shim
# directory on sys.path); make sure the siblings resolve the same way when imported as a package.
if _SHIM_DIR not in sys.path:
    sys.path.append(_SHIM_DIR)
from _pb_utils_tensor import Tensor  # noqa: E402
from _pb_utils_types import (  # noqa: E402, F401
    _DTYPES,
    _FROM_NAME,
    _FROM_NUMPY,
    _TO_NAME,
    _TO_NUMPY,
    TRITON_STRING_TO_NUMPY,
    TYPE_INVALID,
    TritonError,
    TritonModelException,
    _ErrorCode,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)

# --- requests, responses, response sender -------------------------------------------------------


def _parameters_json(parameters: Any) -> str:
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        json.loads(parameters)  # validate; keeps a JSON string the worker already has
        return parameters
    if not isinstance(parameters, Mapping):
        raise TritonModelException("parameters must be a dict of str -> bool | int | str")
    for key, value in parameters.items():
        if not isinstance(key, str) or not isinstance(value, (bool, int, str)):
            raise TritonModelException(f"parameter '{key}' must have a str key and a bool, int or str value")
    return json.dumps(dict(parameters))


class InferenceResponse:
    """One response: output tensors or an error, plus optional parameters (dict of bool/int/str)."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        if output_tensors is None:
            output_tensors = []
        if not isinstance(output_tensors, (list, tuple)):
            raise TritonModelException('"output_tensors" must be a list.')
        for t in output_tensors:
            if not isinstance(t, Tensor):
                raise TritonModelException('"output_tensors" must contain pb_utils.Tensor objects.')
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException('"error" must be a pb_utils.TritonError or None.')
        self._output_tensors = list(output_tensors)
        self._error = error
        self._parameters = _parameters_json(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """Collects what a model sends for one request, in order, as (response | None, flags) in `sent`.

    `on_send(response, flags)` (fleet extension) lets the worker stream each send as it happens.
    Exactly one send carries TRITONSERVER_RESPONSE_COMPLETE_FINAL; later sends raise.
    """

    def __init__(self, on_send: Callable[[InferenceResponse | None, int], None] | None = None) -> None:
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self._on_send = on_send
        self._closed = False
        self._cancelled = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if response is None and flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException("send() expects a pb_utils.InferenceResponse")
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._closed = True
        self.sent.append((response, flags))
        if self._on_send is not None:
            self._on_send(response, flags)

    def is_cancelled(self) -> bool:
        return self._cancelled

    @property
    def closed(self) -> bool:
        """True once the final flag has been sent."""
        return self._closed

    def _cancel(self) -> None:
        self._cancelled = True


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class InferenceRequest:
    """A request: the one execute() receives, or (BLS) one a model builds to call another model.

    The constructor is the BLS one (Triton's argument order and defaults). Incoming requests are
    built by `_incoming_request`, which also attaches a response sender.
    """

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] | None = None,
        requested_output_names: Sequence[str] | None = None,
        model_name: str | None = None,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: Any = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        if inputs is None or requested_output_names is None or model_name is None:
            raise TypeError("InferenceRequest() needs inputs, requested_output_names and model_name")
        if not all(isinstance(t, Tensor) for t in inputs):
            raise TritonModelException('"inputs" must contain pb_utils.Tensor objects.')
        # Triton's binding takes std::string, so bytes work as well as str: Triton's own bls example passes
        # a model name read from a BYTES input (`.as_numpy()[0]`, numpy bytes).
        self._request_id = _text(request_id)
        self._correlation_id = _text(correlation_id) if isinstance(correlation_id, bytes) else correlation_id
        self._inputs = list(inputs)
        self._requested_output_names = [_text(name) for name in requested_output_names]
        self._model_name = _text(model_name)
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._preferred_memory = preferred_memory or PreferredMemory()
        self._trace = trace
        self._parameters = _parameters_json(parameters)
        self._response_sender: InferenceResponseSender | None = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        """Timeout in microseconds (0 = none)."""
        return self._timeout

    def parameters(self) -> str:
        """The request parameters as a JSON string ("{}" when there are none)."""
        return self._parameters

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def model_name(self) -> str:
        return self._model_name or ""

    def get_response_sender(self) -> InferenceResponseSender:
        if self._response_sender is None:
            raise TritonModelException("A BLS request has no response sender.")
        return self._response_sender

    def is_cancelled(self) -> bool:
        return self._response_sender is not None and self._response_sender.is_cancelled()

    def set_release_flags(self, flags: int) -> None:
        self._release_flags = int(flags)

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another model (BLS): an InferenceResponse, or an iterator of them."""
        if _bls_executor is None:
            raise TritonModelException(_BLS_UNSUPPORTED)
        return _bls_executor(self, decoupled)

    def stream_exec(self) -> Any:
        """Older releases' name for exec(decoupled=True)."""
        return self.exec(decoupled=True)

    async def async_exec(self, decoupled: bool = False) -> Any:
        if _bls_async_executor is not None:
            return await _bls_async_executor(self, decoupled)
        if _bls_executor is None:
            raise TritonModelException(_BLS_UNSUPPORTED)
        result = await asyncio.to_thread(_bls_executor, self, decoupled)
        if inspect.isawaitable(result):
            result = await result
        return result


def _incoming_request(
    inputs: Iterable[Tensor] | Mapping[str, np.ndarray],
    request_id: str = "",
    parameters: Mapping[str, Any] | str | None = None,
    requested_output_names: Sequence[str] | None = None,
    correlation_id: int | str = 0,
    flags: int = 0,
    timeout: int = 0,
    model_name: str = "",
    model_version: int = -1,
    response_sender: InferenceResponseSender | None = None,
) -> InferenceRequest:
    """Build a request as execute() receives it (fleet-internal; the worker and tests use it).

    `inputs` is a list of Tensor or a mapping name -> array. Read-only arrays are copied, because
    Triton hands models writable inputs (and torch.from_numpy warns on read-only ones); pass
    writable arrays (np.frombuffer over a bytearray) to avoid the copy. A sender is created when
    none is given; read what the model sent from `request.get_response_sender().sent`.
    """
    if isinstance(inputs, Mapping):
        tensors = [Tensor(name, array) for name, array in inputs.items()]
    else:
        tensors = list(inputs)
    for i, t in enumerate(tensors):
        if not t._array.flags.writeable:
            tensors[i] = Tensor(t._name, t._array.copy(), t._triton_dtype)
    request = InferenceRequest(
        request_id=request_id,
        correlation_id=correlation_id,
        inputs=tensors,
        requested_output_names=list(requested_output_names or []),
        model_name=model_name,
        model_version=model_version,
        flags=flags,
        timeout=timeout,
        parameters=None,
    )
    # Incoming requests carry whatever the client sent (doubles included), unlike BLS requests.
    request._parameters = parameters if isinstance(parameters, str) else \
        json.dumps(dict(parameters)) if parameters else "{}"  # most requests have none: no encoder call
    request._response_sender = response_sender or InferenceResponseSender()
    return request


# Logger, ModelConfig (auto_complete_config) and metrics live next door; models see them as
# pb_utils.* as in Triton. The worker imports this module as a top-level one (shim dir on sys.path).
from _pb_utils_config import ModelConfig  # noqa: E402
from _pb_utils_extras import Logger, LogLevel, Metric, MetricFamily  # noqa: E402
from _pb_utils_extras import _changes as _metric_changes  # noqa: E402, F401  (the stub reports metrics)
from _pb_utils_extras import _families as _metric_families  # noqa: E402, F401
from _pb_utils_extras import _snapshot as _metric_snapshot  # noqa: E402, F401
from _pb_utils_helpers import (  # noqa: E402
    get_input_config_by_name,
    get_input_tensor_by_name,
    get_output_config_by_name,
    get_output_tensor_by_name,
    is_model_ready,
    load_model,
    unload_model,
    using_decoupled_model_transaction_policy,
)

__all__ = [
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "LogLevel",
    "Logger",
    "Metric",
    "MetricFamily",
    "ModelConfig",
    "PreferredMemory",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]
