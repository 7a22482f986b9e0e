"""The triton_python_backend_utils shim (protocol.md §5.2), imported the way models import it."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.errors import ErrorCode
from fleet.tensors import serialize_bytes

SHIM_DIR = Path(__file__).resolve().parents[2] / "workers" / "backends" / "python_shim"
if str(SHIM_DIR) not in sys.path:
    sys.path.insert(0, str(SHIM_DIR))

import triton_python_backend_utils as pb_utils

NUMERIC = [
    ("TYPE_BOOL", 1, np.bool_),
    ("TYPE_UINT8", 2, np.uint8),
    ("TYPE_UINT16", 3, np.uint16),
    ("TYPE_UINT32", 4, np.uint32),
    ("TYPE_UINT64", 5, np.uint64),
    ("TYPE_INT8", 6, np.int8),
    ("TYPE_INT16", 7, np.int16),
    ("TYPE_INT32", 8, np.int32),
    ("TYPE_INT64", 9, np.int64),
    ("TYPE_FP16", 10, np.float16),
    ("TYPE_FP32", 11, np.float32),
    ("TYPE_FP64", 12, np.float64),
]


def test_import_does_not_load_torch() -> None:
    code = "import sys, triton_python_backend_utils; sys.exit('torch' in sys.modules)"
    root = str(SHIM_DIR.parents[2])
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": f"{SHIM_DIR}:{root}"}, check=False)
    assert done.returncode == 0


def test_constants() -> None:
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START == 1
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END == 2
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2
    assert {pb_utils.TRITONSERVER_MEMORY_GPU, pb_utils.TRITONSERVER_MEMORY_CPU} == {0, 1}
    mem = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
    assert mem.preferred_memory_type == pb_utils.TRITONSERVER_MEMORY_CPU


# --- datatypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("config_name", "code", "np_type"), NUMERIC)
def test_type_tables_agree(config_name: str, code: int, np_type: type) -> None:
    assert np.dtype(pb_utils.triton_string_to_numpy(config_name)) == np.dtype(np_type)
    assert pb_utils.triton_to_numpy_type(code) == np_type
    assert pb_utils.numpy_to_triton_type(np_type) == code
    assert pb_utils.numpy_to_triton_type(np.dtype(np_type)) == code
    tensor = pb_utils.Tensor("x", np.zeros((2, 3), dtype=np_type))
    assert tensor.triton_dtype() == code


def test_bytes_and_bf16_types() -> None:
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_STRING"] is np.object_
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_BOOL"] is bool  # as in Triton's table
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.triton_to_numpy_type(14) is np.float32  # fleet widens BF16
    assert pb_utils.triton_to_numpy_type(0) is None
    for dtype in (np.object_, np.bytes_, np.dtype("S4"), np.dtype("U3")):
        assert pb_utils.numpy_to_triton_type(dtype) == 13
    assert pb_utils.numpy_to_triton_type(np.complex64) is None
    with pytest.raises(KeyError):
        pb_utils.triton_string_to_numpy("TYPE_NOPE")


# --- Tensor -------------------------------------------------------------------------------------


def test_tensor_surface() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("INPUT0", array)
    assert tensor.name() == "INPUT0"
    assert tensor.as_numpy() is array
    assert tensor.shape() == [2, 3]
    assert tensor.triton_dtype() == 11
    assert tensor._datatype() == "FP32"
    assert tensor.is_cpu()
    assert tensor.__dlpack_device__() == (1, 0)


def test_string_arrays_become_object_bytes() -> None:
    tensor = pb_utils.Tensor("s", np.array([["a", "é"]]))
    out = tensor.as_numpy()
    assert out.dtype == np.object_ and out.shape == (1, 2)
    assert out.tolist() == [[b"a", "é".encode()]]
    assert tensor._datatype() == "BYTES"
    assert pb_utils.Tensor("b", np.array([b"xy"])).as_numpy().tolist() == [b"xy"]


def test_unsupported_tensor_dtype() -> None:
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.Tensor("c", np.zeros(2, dtype=np.complex64))


def test_bf16_tensor_is_float32_with_bf16_dtype() -> None:
    tensor = pb_utils.Tensor("h", np.ones(2, dtype=np.float32), triton_dtype=14)
    assert tensor.triton_dtype() == 14 and tensor._datatype() == "BF16"


def test_dlpack_round_trips_through_torch() -> None:
    torch = pytest.importorskip("torch")
    array = np.arange(4, dtype=np.float32)
    tensor = pb_utils.Tensor("x", array)
    assert torch.equal(torch.from_dlpack(tensor), torch.arange(4, dtype=torch.float32))
    assert torch.equal(torch.utils.dlpack.from_dlpack(tensor.to_dlpack()), torch.from_numpy(array))
    back = pb_utils.Tensor.from_dlpack("y", torch.utils.dlpack.to_dlpack(torch.ones(3)))
    assert back.name() == "y" and back.as_numpy().tolist() == [1.0, 1.0, 1.0]
    assert pb_utils.Tensor.from_dlpack("z", torch.zeros(2, dtype=torch.int64)).triton_dtype() == 9
    bf16 = pb_utils.Tensor.from_dlpack("w", torch.ones(2, dtype=torch.bfloat16))
    assert bf16._datatype() == "BF16" and bf16.as_numpy().dtype == np.float32


def test_dlpack_copies_read_only_data_and_refuses_bytes() -> None:
    torch = pytest.importorskip("torch")
    readonly = np.frombuffer(np.arange(3, dtype=np.int32).tobytes(), dtype=np.int32)
    assert torch.from_dlpack(pb_utils.Tensor("r", readonly)).tolist() == [0, 1, 2]
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.Tensor("s", np.array([b"a"], dtype=object)).to_dlpack()


# --- BYTES serialization ------------------------------------------------------------------------


@given(st.lists(st.binary(max_size=20), max_size=12))
def test_serialize_round_trip(items: list[bytes]) -> None:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    encoded = pb_utils.serialize_byte_tensor(array)
    assert encoded is not None and encoded == serialize_bytes(array)
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == items


def test_serialize_details() -> None:
    array = np.array([[b"ab", b""], [b"\xff\x00", "é"]], dtype=object)
    encoded = pb_utils.serialize_byte_tensor(array)
    assert encoded is not None and encoded[:6] == b"\x02\x00\x00\x00ab"
    decoded = pb_utils.deserialize_bytes_tensor(encoded)
    assert decoded.dtype == np.object_
    assert decoded.tolist() == [b"ab", b"", b"\xff\x00", "é".encode()]
    assert pb_utils.serialize_byte_tensor(np.zeros(3, dtype=np.float32)) is None


# --- errors -------------------------------------------------------------------------------------


def test_triton_error_codes() -> None:
    codes = {
        "UNKNOWN": 0,
        "INTERNAL": 1,
        "NOT_FOUND": 2,
        "INVALID_ARG": 3,
        "UNAVAILABLE": 4,
        "UNSUPPORTED": 5,
        "ALREADY_EXISTS": 6,
        "CANCELLED": 7,
    }
    for name, value in codes.items():
        code = getattr(pb_utils.TritonError, name)
        assert code == value
        assert ErrorCode(code.name)  # every code has a fleet ErrorCode of the same name
        error = pb_utils.TritonError("boom", code)
        assert error.code() == code and error.code().name == name
    default = pb_utils.TritonError("bad input")
    assert default.message() == "bad input" and str(default) == "bad input"
    assert default.code() == pb_utils.TritonError.INTERNAL


def test_model_exception() -> None:
    with pytest.raises(pb_utils.TritonModelException) as info:
        raise pb_utils.TritonModelException("fatal")
    assert info.value.message() == "fatal" and str(info.value) == "fatal"


# --- responses and requests ---------------------------------------------------------------------


def test_inference_response() -> None:
    out = pb_utils.Tensor("OUTPUT0", np.ones(2, dtype=np.float32))
    response = pb_utils.InferenceResponse(output_tensors=[out], parameters={"a": 1, "b": True})
    assert response.output_tensors() == [out] and not response.has_error()
    assert response.error() is None
    assert json.loads(response.parameters()) == {"a": 1, "b": True}
    assert pb_utils.get_output_tensor_by_name(response, "OUTPUT0") is out
    assert pb_utils.get_output_tensor_by_name(response, "NOPE") is None

    failed = pb_utils.InferenceResponse([], error=pb_utils.TritonError("no", pb_utils.TritonError.INVALID_ARG))
    error = failed.error()
    assert failed.has_error() and error is not None and error.message() == "no"
    assert pb_utils.InferenceResponse().parameters() == "{}"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"output_tensors": pb_utils.Tensor("x", np.zeros(1))},
        {"output_tensors": [np.zeros(1)]},
        {"output_tensors": [], "error": "text"},
        {"output_tensors": [], "parameters": {"a": [1]}},
    ],
)
def test_inference_response_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(**kwargs)


def test_incoming_request() -> None:
    request = pb_utils._incoming_request(
        {"INPUT0": np.arange(3, dtype=np.int32), "TEXT": np.array([b"hi"], dtype=object)},
        request_id="r1",
        parameters={"priority": 2, "tag": "x"},
        requested_output_names=["OUTPUT0"],
        correlation_id=7,
        flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        timeout=5_000,
    )
    assert [t.name() for t in request.inputs()] == ["INPUT0", "TEXT"]
    assert request.request_id() == "r1"
    assert request.correlation_id() == 7
    assert request.flags() == 1
    assert request.timeout() == 5_000
    assert json.loads(request.parameters()) == {"priority": 2, "tag": "x"}
    assert request.requested_output_names() == ["OUTPUT0"]
    assert not request.is_cancelled()
    text = pb_utils.get_input_tensor_by_name(request, "TEXT")
    assert text is not None and text.as_numpy().tolist() == [b"hi"]
    assert pb_utils.get_input_tensor_by_name(request, "MISSING") is None

    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    assert request._release_flags == 2

    sender = request.get_response_sender()
    assert request.get_response_sender() is sender
    sender._cancel()
    assert request.is_cancelled() and sender.is_cancelled()


def test_incoming_request_defaults_and_writable_inputs() -> None:
    readonly = np.frombuffer(np.ones(4, dtype=np.float32).tobytes(), dtype=np.float32)
    request = pb_utils._incoming_request([pb_utils.Tensor("X", readonly)])
    assert request.request_id() == "" and request.correlation_id() == 0
    assert request.parameters() == "{}" and request.requested_output_names() == []
    assert request.inputs()[0].as_numpy().flags.writeable
    assert pb_utils._incoming_request({}, parameters='{"k": "v"}').parameters() == '{"k": "v"}'


def test_response_sender_collects_in_order() -> None:
    seen: list[tuple[object, int]] = []
    sender = pb_utils.InferenceResponseSender(on_send=lambda r, f: seen.append((r, f)))
    request = pb_utils._incoming_request({}, response_sender=sender)
    first = pb_utils.InferenceResponse([pb_utils.Tensor("O", np.zeros(1, dtype=np.float32))])
    second = pb_utils.InferenceResponse([pb_utils.Tensor("O", np.ones(1, dtype=np.float32))])
    request.get_response_sender().send(first)
    sender.send(second)
    assert not sender.closed
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sender.closed
    assert sender.sent == [(first, 0), (second, 0), (None, 1)] == seen
    with pytest.raises(pb_utils.TritonModelException, match="closed"):
        sender.send(first, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def test_response_sender_needs_a_response_or_the_final_flag() -> None:
    sender = pb_utils.InferenceResponseSender()
    with pytest.raises(pb_utils.TritonModelException):
        sender.send()
    with pytest.raises(pb_utils.TritonModelException):
        not_a_response: Any = "text"
        sender.send(not_a_response)
    response = pb_utils.InferenceResponse([])
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sender.sent == [(response, 1)]


# --- BLS ----------------------------------------------------------------------------------------


def _bls_request() -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(
        model_name="add_sub",
        inputs=[pb_utils.Tensor("INPUT0", np.ones(4, dtype=np.float32))],
        requested_output_names=["OUTPUT0"],
        parameters={"k": 1},
    )


def test_bls_request_constructor() -> None:
    request = _bls_request()
    assert request.model_name() == "add_sub"
    assert request.correlation_id() == 0 and request.flags() == 0 and request.timeout() == 0
    assert json.loads(request.parameters()) == {"k": 1}
    with pytest.raises(pb_utils.TritonModelException):
        request.get_response_sender()
    with pytest.raises(TypeError):
        pb_utils.InferenceRequest(inputs=[], requested_output_names=[])


def test_bls_is_not_supported_without_an_executor() -> None:
    request = _bls_request()
    with pytest.raises(pb_utils.TritonModelException, match="BLS .* is not supported yet"):
        request.exec()
    with pytest.raises(pb_utils.TritonModelException, match="not supported yet"):
        asyncio.run(request.async_exec())
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.load_model("x")


def test_bls_uses_the_executor_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, bool]] = []

    def executor(request: pb_utils.InferenceRequest, decoupled: bool) -> pb_utils.InferenceResponse:
        calls.append((request.model_name(), decoupled))
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.zeros(4, dtype=np.float32))])

    monkeypatch.setattr(pb_utils, "_bls_executor", executor)
    request = _bls_request()
    assert not request.exec().has_error()
    assert not asyncio.run(request.async_exec(decoupled=True)).has_error()
    assert calls == [("add_sub", False), ("add_sub", True)]


# --- config helpers, ModelConfig ----------------------------------------------------------------

CONFIG: dict[str, Any] = {
    "name": "m",
    "max_batch_size": 8,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "OUT", "data_type": "TYPE_STRING", "dims": [-1]}],
}


def test_config_helpers() -> None:
    assert pb_utils.get_input_config_by_name(CONFIG, "IN") == CONFIG["input"][0]
    assert pb_utils.get_output_config_by_name(CONFIG, "OUT") == CONFIG["output"][0]
    assert pb_utils.get_input_config_by_name(CONFIG, "OUT") is None
    assert pb_utils.get_output_config_by_name({}, "OUT") is None
    assert not pb_utils.using_decoupled_model_transaction_policy(CONFIG)
    assert pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}})


def test_model_config_auto_complete() -> None:
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 0, "input": [], "output": []}))
    config.set_max_batch_size(16)
    config.set_dynamic_batching()
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True})
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})  # same again: fine
    config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
    config.set_model_transaction_policy({"decoupled": True})
    assert config.as_dict() == {
        "name": "m",
        "max_batch_size": 16,
        "dynamic_batching": {},
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
        "model_transaction_policy": {"decoupled": True},
    }


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.set_max_batch_size(4),
        lambda c: c.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [4]}),
        lambda c: c.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [5]}),
        lambda c: c.add_input({"name": "X", "data_type": "TYPE_FP32"}),
        lambda c: c.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1], "optional": True}),
        lambda c: c.set_model_transaction_policy({"decoupled": True, "other": 1}),
    ],
)
def test_model_config_conflicts_raise(change: Callable[[Any], object]) -> None:
    config = pb_utils.ModelConfig(CONFIG | {"sequence_batching": {}})
    with pytest.raises(ValueError):
        change(config)


def test_model_config_keeps_other_schedulers() -> None:
    with pytest.raises(ValueError, match="sequence_batching"):
        pb_utils.ModelConfig({"name": "m", "sequence_batching": {}}).set_dynamic_batching()


# --- Logger, metrics ----------------------------------------------------------------------------


def test_logger_goes_to_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="triton_python_backend_utils")
    logger = pb_utils.Logger
    logger.log_info("i")
    pb_utils.Logger.log_warn("w")
    pb_utils.Logger.log_error("e")
    pb_utils.Logger.log_verbose("v")
    pb_utils.Logger.log("x", pb_utils.Logger.LogLevel.ERROR)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "i"),
        (logging.WARNING, "w"),
        (logging.ERROR, "e"),
        (logging.DEBUG, "v"),
        (logging.ERROR, "x"),
    ]


def test_metrics() -> None:
    counter = pb_utils.MetricFamily("test_requests", "requests", pb_utils.MetricFamily.COUNTER)
    metric = counter.Metric(labels={"model": "m"})
    metric.increment(2)
    metric.increment(1)
    assert metric.value() == 3
    assert counter.Metric(labels={"model": "m"}) is metric
    with pytest.raises(ValueError):
        metric.increment(-1)
    with pytest.raises(ValueError):
        metric.set(1)

    gauge = pb_utils.MetricFamily("test_gauge", "g", pb_utils.MetricFamily.GAUGE).Metric()
    gauge.set(5)
    gauge.increment(-2)
    assert gauge.value() == 3

    family = pb_utils.MetricFamily("test_latency", "l", pb_utils.MetricFamily.HISTOGRAM)
    hist = family.Metric(labels={}, buckets=[1.0, 10.0])
    for value in (0.5, 5, 50):
        hist.observe(value)
    assert (hist.count, hist.sum, hist.bucket_counts) == (3, 55.5, [1, 1, 1])
    with pytest.raises(ValueError):
        family.Metric(labels={"a": "b"})  # histograms need buckets
    with pytest.raises(ValueError):
        pb_utils.MetricFamily("test_requests", "requests", pb_utils.MetricFamily.GAUGE)


def test_a_bls_request_takes_names_as_bytes_as_tritons_binding_does() -> None:
    """Triton's bls example passes a model name read from a BYTES input: numpy bytes, not str."""
    name = np.array([b"add_sub"], dtype=object)[0]
    request = pb_utils.InferenceRequest(model_name=np.bytes_(name), requested_output_names=[b"OUTPUT0"],
                                        inputs=[], request_id=b"r1")
    assert (request.model_name(), request.requested_output_names(), request.request_id()) == \
        ("add_sub", ["OUTPUT0"], "r1")
