"""The gateway's gRPC service against a real worker and real Redis, driven by Triton's own client
(tritonclient.grpc) and by raw messages: every datatype, BF16 rounding, hypothesis-generated
ModelInferRequests (every OK answer checked value by value, every refusal an INVALID_ARGUMENT that never
reached a worker), deadlines and cancellation (never computed), streams, the shared admission count,
message limits and gzip, and auth. The gateway runs as `fleet gateway` runs it: the gRPC server and
the gateway's state on one uvloop loop (tests/support/grpc_system.py)."""

from __future__ import annotations

import gzip
import queue
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tg
from google.protobuf import json_format
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg
from tritonclient.utils import InferenceServerException

from fleet.keys import GROUP
from fleet.redis_server import LocalServer
from gateway.grpc import h2_frames as wire
from tests.integration.test_datatypes import bf16_round_to_nearest_even, inputs_where_rounding_matters
from tests.support.grpc_system import GrpcSystem
from tests.support.queue_models import SLEEPER

ROOT = Path(__file__).resolve().parents[2]
TYPES = {"BOOL": ("TYPE_BOOL", np.bool_), "UINT8": ("TYPE_UINT8", np.uint8), "UINT16": ("TYPE_UINT16", np.uint16),
         "UINT32": ("TYPE_UINT32", np.uint32), "UINT64": ("TYPE_UINT64", np.uint64), "INT8": ("TYPE_INT8", np.int8),
         "INT16": ("TYPE_INT16", np.int16), "INT32": ("TYPE_INT32", np.int32), "INT64": ("TYPE_INT64", np.int64),
         "FP16": ("TYPE_FP16", np.float16), "FP32": ("TYPE_FP32", np.float32), "FP64": ("TYPE_FP64", np.float64),
         "BF16": ("TYPE_BF16", ml_dtypes.bfloat16), "BYTES": ("TYPE_STRING", np.object_)}
IDENTITY_PY = """
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.names = [(i["name"], o["name"]) for i, o in zip(config["input"], config["output"])]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(o, pb_utils.get_input_tensor_by_name(r, i).as_numpy())
                                            for i, o in self.names]) for r in requests]
"""
SLOW_MS = 1000  # long beside the tests' 0.1-0.2 s steps: a loaded host must not finish it before a cancel lands
FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _sleeper(repo: Path, name: str, batcher: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(SLEEPER, repo / name / "1" / "model.py")
    (repo / name / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: 1
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }} ]
dynamic_batching {{ {batcher} }}
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
parameters {{ key: "SLEEP_MS" value: {{ string_value: "{SLOW_MS}" }} }}
""")


@pytest.fixture(scope="module")
def live(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcSystem]:
    repo = tmp_path_factory.mktemp("grpc-repo")
    shutil.copytree(ROOT / "tests" / "models" / "doubler", repo / "doubler")
    shutil.copytree(ROOT / "tests" / "models" / "bf16_scale", repo / "bf16_scale")
    shutil.copytree(ROOT / "model_repository" / "simple_identity", repo / "simple_identity")
    shutil.copytree(ROOT / "model_repository" / "add_sub", repo / "add_sub")
    (repo / "every_type" / "1").mkdir(parents=True)
    (repo / "every_type" / "1" / "model.py").write_text(IDENTITY_PY)
    io = "\n".join(f'{{ name: "{kind}_{d}", data_type: {t}, dims: [ -1 ] }},'
                   for kind in ("IN", "OUT") for d, (t, _) in TYPES.items())
    ins, outs = io.split("\n")[:len(TYPES)], io.split("\n")[len(TYPES):]
    (repo / "every_type" / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: 0\ninput [ {" ".join(ins).rstrip(",")} ]\n'
        f'output [ {" ".join(outs).rstrip(",")} ]\n')
    _sleeper(repo, "slow", "")
    _sleeper(repo, "strict", "default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 300000 }")
    system = GrpcSystem(redis_server.url, [repo])
    try:
        yield system
    finally:
        system.close()


@pytest.fixture
def client(live: GrpcSystem) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(live.target)
    yield c
    c.close()


def tensor(name: str, array: np.ndarray, datatype: str) -> tg.InferInput:
    i = tg.InferInput(name, list(array.shape), datatype)
    i.set_data_from_numpy(array)
    return i


def slow_input(value: float) -> list[tg.InferInput]:
    return [tensor("IN", np.array([[value]], np.float32), "FP32")]


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ── data ────────────────────────────────────────────────────────────────────────────────────────────


def arrays(n: int) -> st.SearchStrategy[dict[str, np.ndarray]]:
    def of(d: str) -> st.SearchStrategy[np.ndarray]:
        np_type = TYPES[d][1]
        if d == "BYTES":
            return st.lists(st.binary(max_size=10), min_size=n, max_size=n).map(
                lambda v: np.array(v + [b""], dtype=np.object_)[:n])
        if d == "BOOL":
            return st.lists(st.booleans(), min_size=n, max_size=n).map(lambda v: np.array(v, np.bool_))
        if np.dtype(np_type).kind in "iu":
            info = np.iinfo(np_type)
            return st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n).map(
                lambda v: np.array(v, np_type))
        if d == "BF16":  # every bit pattern but NaN's (a model sees BF16 as float32: NaN payloads are not kept)
            patterns = st.integers(0, 0xFFFF).filter(lambda b: b & 0x7F80 != 0x7F80 or not b & 0x7F)
            return st.lists(patterns, min_size=n, max_size=n).map(
                lambda v: np.array(v, np.uint16).view(ml_dtypes.bfloat16))
        width = {"FP16": 16, "FP32": 32, "FP64": 64}[d]
        return st.lists(st.floats(width=width), min_size=n, max_size=n).map(lambda v: np.array(v, np_type))
    return st.fixed_dictionaries({d: of(d) for d in TYPES})


@pytest.mark.parametrize("streaming", [False, True])
def test_big_tensors_cross_the_flow_control_windows_both_ways(live: GrpcSystem, streaming: bool) -> None:
    """12 MiB each way: more than the client's initial windows and the server's frame size, so both
    directions wait for WINDOW_UPDATEs and split into many DATA frames."""
    x = np.random.default_rng(7).standard_normal((1, 3 * 1024 * 1024)).astype(np.float32)
    c = tg.InferenceServerClient(live.target)
    try:
        if not streaming:
            out = c.infer("doubler", [tensor("IN", x, "FP32")], client_timeout=60).as_numpy("OUT")
        else:
            answers: queue.Queue[Any] = queue.Queue()
            c.start_stream(callback=lambda result, error: answers.put((result, error)))
            c.async_stream_infer("doubler", [tensor("IN", x, "FP32")], request_id="big")
            result, error = answers.get(timeout=60)
            c.stop_stream()
            assert error is None, error
            out = result.as_numpy("OUT")
        np.testing.assert_array_equal(out, x * 2)
    finally:
        c.close()


@pytest.mark.parametrize("payload", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    wire.PREFACE + wire.frame(wire.PING, 0, 0, b"12345678"),  # no SETTINGS first
    wire.PREFACE + wire.frame(wire.SETTINGS, 0, 0) + wire.frame(wire.HEADERS, wire.END_HEADERS, 1, b"\xff" * 7),
    wire.PREFACE + wire.frame(wire.SETTINGS, 0, 0) + bytes(range(256)) * 20,
], ids=["http1", "no-settings", "bad-hpack", "garbage"])
def test_protocol_errors_end_only_their_connection(live: GrpcSystem, client: tg.InferenceServerClient,
                                                   payload: bytes) -> None:
    host, port = live.target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(payload)
        received = b""
        while chunk := raw.recv(65536):  # the server answers GOAWAY and closes
            received += chunk
    kinds = [f[0] for f in _frames(received)]
    assert kinds[0] == wire.SETTINGS and kinds[-1] == wire.GOAWAY
    assert client.is_server_live()


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        out.append((data[pos + 3], data[pos + 9:pos + 9 + length]))
        pos += 9 + length
    return out


@settings(max_examples=25, deadline=None, database=None)
@given(st.integers(0, 5).flatmap(arrays))
def test_every_datatype_round_trips(live: GrpcSystem, values: dict[str, np.ndarray]) -> None:
    client = tg.InferenceServerClient(live.target)
    try:
        result = client.infer("every_type", [tensor(f"IN_{d}", a, d) for d, a in values.items()], request_id="all")
    finally:
        client.close()
    assert result.get_response().id == "all"
    for d, a in values.items():
        got = result.as_numpy(f"OUT_{d}")
        assert got.shape == a.shape
        assert got.tolist() == a.tolist() if d == "BYTES" else got.tobytes() == a.tobytes(), d


def test_bf16_outputs_are_rounded_to_nearest_even(client: tg.InferenceServerClient) -> None:
    x = inputs_where_rounding_matters()
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32) * np.float32(3)
    result = client.infer("bf16_scale", [tensor("IN", x.reshape(1, -1), "BF16")])
    nan = np.isnan(y)
    for name in ("OUT_CAST", "OUT_TAGGED"):
        got = result.as_numpy(name)
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == (1, x.size)
        np.testing.assert_array_equal(np.isnan(got.reshape(-1).astype(np.float32)), nan)  # a NaN's sign may differ
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint16)[~nan], bf16_round_to_nearest_even(y)[~nan])


def test_typed_contents_are_served(live: GrpcSystem) -> None:
    """What tritonclient never sends but the proto allows: InferTensorContents instead of raw bytes."""
    request = pb.ModelInferRequest(model_name="add_sub", id="typed")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[4]).contents.fp32_contents.extend([1, 2, 3, 4.5])
    with grpc.insecure_channel(live.target) as channel:
        response = pbg.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    result = tg.InferResult(response)
    assert result.as_numpy("OUTPUT0").tolist() == [2, 4, 6, 9] and result.as_numpy("OUTPUT1").tolist() == [0] * 4


# ── fuzzing ModelInferRequests ──────────────────────────────────────────────────────────────────────

MODELS = {"doubler": [("IN", "FP32", True)], "simple_identity": [("INPUT0", "BYTES", True)],
          "add_sub": [("INPUT0", "FP32", False), ("INPUT1", "FP32", False)]}
FIELDS = ["bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents", "fp32_contents",
          "fp64_contents", "bytes_contents"]


def _frame(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """A valid request for one of MODELS, then (mostly) one or more mutations of what a client controls."""
    model = draw(st.sampled_from(sorted(MODELS)))
    request = pb.ModelInferRequest(model_name=model, id=draw(st.text(max_size=6)))
    rows = draw(st.integers(1, 3))
    raws = []
    for name, datatype, batched in MODELS[model]:
        if datatype == "BYTES":
            n = draw(st.integers(0, 4))
            values = draw(st.lists(st.binary(max_size=6), min_size=n, max_size=n))
            shape, raw = [1, n], _frame(values)
        elif batched:
            n = draw(st.integers(0, 4))
            shape, raw = [rows, n], np.array(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=rows * n,
                                                            max_size=rows * n)), np.float32).tobytes()
        else:
            shape, raw = [4], np.array(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=4, max_size=4)),
                                       np.float32).tobytes()
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        raws.append(raw)
    request.raw_input_contents.extend(raws)
    for _ in range(draw(st.integers(0, 2))):
        mutation = draw(st.sampled_from(["shape", "datatype", "name", "raw", "drop_raw", "typed", "extra_input",
                                         "param", "output", "model", "version", "truncate_bytes"]))
        event(mutation)
        i = draw(st.integers(0, len(request.inputs) - 1))
        if mutation == "shape":
            del request.inputs[i].shape[:]
            request.inputs[i].shape.extend(draw(st.lists(st.integers(-2, 2**40), max_size=3)))
        elif mutation == "datatype":
            request.inputs[i].datatype = draw(st.sampled_from(["FP16", "INT32", "BYTES", "BF16", "", "fp32", "X"]))
        elif mutation == "name":
            request.inputs[i].name = draw(st.text(max_size=5))
        elif mutation == "raw" and i < len(request.raw_input_contents):
            request.raw_input_contents[i] = draw(st.binary(max_size=40))
        elif mutation == "drop_raw" and request.raw_input_contents:
            del request.raw_input_contents[-1]
        elif mutation == "typed":
            field = draw(st.sampled_from(FIELDS))
            values = draw(st.lists(st.binary(max_size=3) if field == "bytes_contents" else
                                   st.booleans() if field == "bool_contents" else
                                   st.floats(width=32) if field.startswith("fp") else st.integers(0, 255),
                                   max_size=6))
            getattr(request.inputs[i].contents, field).extend(values)
            if draw(st.booleans()):
                del request.raw_input_contents[:]
        elif mutation == "extra_input":
            request.inputs.add(name=draw(st.sampled_from(["IN", "INPUT0", "Z"])), datatype="FP32", shape=[1])
        elif mutation == "param":
            key = draw(st.sampled_from(["priority", "timeout", "sequence_id", "triton_x", "p", "binary_data_output"]))
            kind = draw(st.sampled_from(["int64_param", "uint64_param", "string_param", "bool_param", "double_param"]))
            value = draw({"int64_param": st.integers(-(2**63), 2**63 - 1), "uint64_param": st.integers(0, 2**64 - 1),
                          "string_param": st.text(max_size=4), "bool_param": st.booleans(),
                          "double_param": st.floats()}[kind])
            setattr(request.parameters[key], kind, value)
        elif mutation == "output":
            request.outputs.add(name=draw(st.sampled_from(["OUT", "OUTPUT0", "OUTPUT1", "NOPE"])))
        elif mutation == "model":
            request.model_name = draw(st.sampled_from(["", "nope", "DOUBLER"]))
        elif mutation == "version":
            request.model_version = draw(st.sampled_from(["1", "2", "x", "-1", "01"]))
        elif mutation == "truncate_bytes" and request.raw_input_contents:
            request.raw_input_contents[i % len(request.raw_input_contents)] = \
                request.raw_input_contents[i % len(request.raw_input_contents)][:-1]
    return request


def check_answer(request: pb.ModelInferRequest, response: pb.ModelInferResponse) -> None:
    """An OK answer holds what the model computes from what the request sent, output by output."""
    assert response.id == request.id and response.model_name == request.model_name
    sent = {t.name: (t, raw) for t, raw in zip(request.inputs, request.raw_input_contents, strict=False)}
    for t in request.inputs:  # typed contents (when raw was dropped)
        if t.name not in sent or not request.raw_input_contents:
            sent[t.name] = (t, None)
    result = tg.InferResult(response)
    wanted = {o.name for o in request.outputs}
    names = [o.name for o in response.outputs]
    assert not wanted or set(names) == wanted
    if request.model_name == "doubler":
        t, raw = sent["IN"]
        x = np.frombuffer(raw, np.float32) if raw is not None else np.array(t.contents.fp32_contents, np.float32)
        np.testing.assert_array_equal(result.as_numpy("OUT").reshape(-1), x * 2)
    elif request.model_name == "simple_identity":
        t, raw = sent["INPUT0"]
        expect = raw if raw is not None else _frame(list(t.contents.bytes_contents))
        assert response.raw_output_contents[0] == expect
    else:
        a, b = (np.frombuffer(sent[n][1], np.float32) if sent[n][1] is not None
                else np.array(sent[n][0].contents.fp32_contents, np.float32) for n in ("INPUT0", "INPUT1"))
        if "OUTPUT0" in names:
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        if "OUTPUT1" in names:
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


@FUZZ
@given(infer_requests())
def test_fuzzed_infer_requests(live: GrpcSystem, request: pb.ModelInferRequest) -> None:
    before = live.queued()
    with grpc.insecure_channel(live.target) as channel:
        try:
            response = pbg.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
        except grpc.RpcError as exc:
            event(exc.code().name)
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
                (exc.code(), exc.details())
            assert exc.details()
            assert live.queued() == before, "a refused request reached a model stream"
            return
    event("OK")
    check_answer(request, response)


@settings(max_examples=80, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_invalid_argument_or_served(live: GrpcSystem, payload: bytes) -> None:
    with grpc.insecure_channel(live.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        try:
            call(payload, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), exc.details()


def test_the_gateway_still_serves_after_the_fuzzing(client: tg.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    assert client.infer("doubler", [tensor("IN", x, "FP32")]).as_numpy("OUT").tolist() == (x * 2).tolist()


# ── deadlines, cancellation, queue policy ───────────────────────────────────────────────────────────


def computed(live: GrpcSystem, model: str) -> int:
    return live.stats(model).get("1:inference_count", 0)


def read_by_the_worker(live: GrpcSystem, model: str) -> bool:
    return bool(live.redis.xpending(live.keys.queue(model, version=1), GROUP)["pending"])


def test_a_client_deadline_cancels_the_request(live: GrpcSystem, client: tg.InferenceServerClient) -> None:
    """Behind a busy instance, a request whose deadline passes is deleted from its stream (or dropped by
    the worker holding it): never computed."""
    assert client.is_server_live()  # the channel is connected: the deadline below is spent in the gateway
    before = computed(live, "slow")
    busy: queue.Queue[Any] = queue.Queue()
    client.async_infer("slow", slow_input(1.0), lambda result, error: busy.put((result, error)))
    time.sleep(0.1)  # the first one computes
    with pytest.raises(InferenceServerException) as err:
        client.infer("slow", slow_input(2.0), client_timeout=0.15)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED", err.value.message()
    result, error = busy.get(timeout=10)
    assert error is None and result.as_numpy("OUT").tolist() == [[1.0]]
    time.sleep(SLOW_MS / 1000 * 1.5)
    assert computed(live, "slow") == before + 1, "the request whose caller gave up was computed"


def test_a_cancelled_async_request_is_not_computed(live: GrpcSystem, client: tg.InferenceServerClient) -> None:
    assert client.is_server_live()
    before = computed(live, "slow")
    first: queue.Queue[Any] = queue.Queue()
    client.async_infer("slow", slow_input(1.0), lambda result, error: first.put(error))
    time.sleep(0.1)
    second: queue.Queue[Any] = queue.Queue()
    call = client.async_infer("slow", slow_input(2.0), lambda result, error: second.put(error))
    time.sleep(0.1)
    call.cancel()
    assert "CANCELLED" in str(second.get(timeout=5).status())
    assert first.get(timeout=10) is None
    time.sleep(SLOW_MS / 1000 * 1.5)
    assert computed(live, "slow") == before + 1


def test_a_queue_policy_timeout_is_unavailable(live: GrpcSystem, client: tg.InferenceServerClient) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client.async_infer("strict", slow_input(1.0), lambda result, error: answers.put(error))
    # Executing (1 s) before the next one is sent: that one's 300 ms in the queue then run out.
    wait_for(lambda: read_by_the_worker(live, "strict"), 10, "the first request to be read")
    with pytest.raises(InferenceServerException) as err:
        client.infer("strict", slow_input(2.0))
    assert err.value.status() == "StatusCode.UNAVAILABLE"
    assert err.value.message() == "Request timeout expired"
    assert answers.get(timeout=10) is None


# ── streams ─────────────────────────────────────────────────────────────────────────────────────────


def test_a_stream_answers_its_requests_in_the_order_they_came(live: GrpcSystem,
                                                               client: tg.InferenceServerClient) -> None:
    """As tritonserver (its stream handler queues each response behind the requests before it): the fast
    requests and the errors, all done long before the slow first one, are written after it, in order."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("slow", slow_input(7.0), request_id="slow-1")
        for i in range(6):
            x = np.full((1, 3), i, np.float32)
            client.async_stream_infer("doubler", [tensor("IN", x, "FP32")], request_id=f"fast-{i}")
        client.async_stream_infer("nope", slow_input(0.0), request_id="bad-model")
        shape_error = tensor("IN", np.zeros((1, 2, 2), np.float32), "FP32")
        client.async_stream_infer("doubler", [shape_error], request_id="bad-shape")
        got = [answers.get(timeout=20) for _ in range(9)]
        # The stream stays open after errors: one more request on it.
        client.async_stream_infer("doubler", [tensor("IN", np.ones((1, 1), np.float32), "FP32")], request_id="after")
        last, last_error = answers.get(timeout=20)
    finally:
        client.stop_stream()
    ok = [r for r, e in got if e is None]
    assert [r.get_response().id for r, e in got[:7]] == ["slow-1", *(f"fast-{i}" for i in range(6))]
    assert {r.get_response().id: r.as_numpy("OUT").tolist() for r in ok if r.get_response().id != "slow-1"} == \
        {f"fast-{i}": [[2.0 * i] * 3] for i in range(6)}
    errors = [str(e) for _, e in got[7:]]
    assert "Request for unknown model: 'nope' is not found" in errors[0]
    assert "unexpected shape for input 'IN'" in errors[1]
    assert last_error is None and last.get_response().id == "after"


def test_a_stream_error_carries_its_request_id(live: GrpcSystem) -> None:
    def requests() -> Iterator[pb.ModelInferRequest]:
        yield pb.ModelInferRequest(model_name="nope", id="r-1")
    with grpc.insecure_channel(live.target) as channel:
        (answer,) = list(pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=10))
    assert answer.error_message == "Request for unknown model: 'nope' is not found"
    assert answer.infer_response.id == "r-1"


def test_a_cancelled_stream_cancels_what_it_has_in_flight(live: GrpcSystem, client: tg.InferenceServerClient) -> None:
    before = computed(live, "slow")
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(lambda result, error: answers.put((result, error)))
    for i in range(4):
        client.async_stream_infer("slow", slow_input(float(i)), request_id=str(i))
    time.sleep(0.15)  # the first is computing, three are queued behind it
    client.stop_stream(cancel_requests=True)
    time.sleep(SLOW_MS / 1000 * 3)
    assert computed(live, "slow") - before <= 1, "requests of a cancelled stream were computed"
    wait_for(lambda: all(v == (0, 0) for v in left_in_queues(live)), 5, "the queues to empty")


def left_in_queues(live: GrpcSystem) -> list[tuple[int, int]]:
    out = []
    for key in live.redis.scan_iter(match=live.keys.queue("slow", 0, version=1).removesuffix("0") + "*"):
        out.append((int(live.redis.xlen(key)), sum(int(g["pending"]) for g in live.redis.xinfo_groups(key))))
    return out


# ── health and repository ───────────────────────────────────────────────────────────────────────────


def test_model_control_is_off_without_keys_as_over_http(live: GrpcSystem, client: tg.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.get_model_repository_index()
    assert err.value.status() == "StatusCode.PERMISSION_DENIED"
    assert live.post("/v2/repository/index").status_code == 403


def test_every_model_has_its_http_config_and_metadata(live: GrpcSystem, client: tg.InferenceServerClient) -> None:
    for name in ("doubler", "bf16_scale", "simple_identity", "add_sub", "every_type", "slow", "strict"):
        # The HTTP JSON is the proto's JSON form (fleet/config_json.py): the same message, field by field.
        http = live.run(live.system.client.get(f"/v2/models/{name}/config")).json()
        assert client.get_model_config(name).config == json_format.ParseDict(http, model_config_pb2.ModelConfig())
        meta = client.get_model_metadata(name, as_json=True)
        http_meta = live.run(live.system.client.get(f"/v2/models/{name}")).json()
        assert {k: meta[k] for k in ("name", "versions", "platform")} == \
            {k: http_meta[k] for k in ("name", "versions", "platform")}
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in meta["inputs"]] == \
            [(t["name"], t["datatype"], t["shape"]) for t in http_meta["inputs"]]


# ── limits and auth, on a gateway of their own ──────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def guarded(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcSystem]:
    repo = tmp_path_factory.mktemp("grpc-guarded")
    _sleeper(repo, "slow", "")
    # Responses gzip-compressed at tritonserver's "high" level: every answer below also decodes through it.
    # Keepalive pings every 300 ms, also without calls: Triton's clients answer them as they go.
    system = GrpcSystem(redis_server.url, [repo], api_keys="key-one,key-two", max_in_flight=2,
                        max_input_bytes=64 * 1024, grpc_response_compression_level="high",
                        grpc_keepalive_time_ms=300, grpc_keepalive_timeout_ms=500,
                        grpc_keepalive_permit_without_calls=True, grpc_http2_max_pings_without_data=0)
    try:
        yield system
    finally:
        system.close()


KEY = {"authorization": "Bearer key-two"}


def test_keepalive_pings_and_closes_a_connection_that_never_answers(guarded: GrpcSystem) -> None:
    host, port = guarded.target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(wire.PREFACE + wire.frame(wire.SETTINGS, 0, 0))
        started = time.monotonic()
        received = b""
        while chunk := raw.recv(65536):  # never answering the pings: closed after 300 + 500 ms
            received += chunk
        elapsed = time.monotonic() - started
    kinds = [f[0] for f in _frames(received)]
    assert wire.PING in kinds, kinds
    assert 0.7 < elapsed < 4.0, elapsed
    # Clients that answer pings keep their connection across several keepalive periods.
    client = tg.InferenceServerClient(guarded.target)
    try:
        for _ in range(3):
            assert client.is_server_live()
            time.sleep(0.4)
        assert client.is_server_live()
    finally:
        client.close()


def test_auth_uses_http_s_keys_and_scopes(guarded: GrpcSystem) -> None:
    client = tg.InferenceServerClient(guarded.target)
    try:
        assert client.is_server_live() and client.is_server_ready()  # health stays open, as over HTTP
        for call in (lambda h: client.get_model_metadata("slow", headers=h),
                     lambda h: client.is_model_ready("slow", headers=h),
                     lambda h: client.infer("slow", slow_input(1.0), headers=h),
                     lambda h: client.get_model_repository_index(headers=h)):
            for headers in (None, {"authorization": "Bearer nope"}, {"authorization": "key-two"}):
                with pytest.raises(InferenceServerException) as err:
                    call(headers)
                assert err.value.status() == "StatusCode.UNAUTHENTICATED"
                assert "missing or invalid API key" in err.value.message()
            assert call(KEY) is not None
        assert client.infer("slow", slow_input(3.0), headers={"authorization": "bearer key-one"}).as_numpy("OUT") == 3
    finally:
        client.close()


def test_a_stream_without_a_key_is_refused(guarded: GrpcSystem) -> None:
    with grpc.insecure_channel(guarded.target) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="slow")]), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_and_grpc_share_the_in_flight_limit(guarded: GrpcSystem) -> None:
    client = tg.InferenceServerClient(guarded.target)
    answers: queue.Queue[Any] = queue.Queue()
    try:
        for i in range(2):
            client.async_infer("slow", slow_input(float(i)), lambda result, error: answers.put(error), headers=KEY)
        wait_for(lambda: guarded.system.state.dataplane.in_flight == 2, 5, "two requests in flight")
        with pytest.raises(InferenceServerException) as err:
            client.infer("slow", slow_input(9.0), headers=KEY)
        assert err.value.status() == "StatusCode.UNAVAILABLE" and "limit of 2 requests in flight" in err.value.message()
        body = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1,1],"data":[1]}]}'
        http = guarded.post("/v2/models/slow/infer", content=body, headers={"Authorization": "Bearer key-one"})
        assert http.status_code == 503 and "limit of 2" in http.json()["error"]
        assert [answers.get(timeout=10) for _ in range(2)] == [None, None]
    finally:
        client.close()


def test_messages_over_the_body_limit_are_refused(guarded: GrpcSystem) -> None:
    client = tg.InferenceServerClient(guarded.target)
    try:
        big = np.zeros((1, 20_000), np.float32)  # 80 KB > 64 KiB
        with pytest.raises(InferenceServerException) as err:
            client.infer("slow", [tensor("IN", big, "FP32")], headers=KEY)
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        # gzip as tritonclient sends it: served when it fits, refused when it inflates past the limit.
        small = np.arange(100, dtype=np.float32).reshape(1, 100)
        result = client.infer("slow", [tensor("IN", small, "FP32")], headers=KEY, compression_algorithm="gzip")
        assert result.as_numpy("OUT").tolist() == small.tolist()
        assert len(gzip.compress(big.tobytes())) < 1000
        with pytest.raises(InferenceServerException) as err:
            client.infer("slow", [tensor("IN", big, "FP32")], headers=KEY, compression_algorithm="gzip")
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert client.is_server_live()
    finally:
        client.close()


def test_stopping_answers_what_was_accepted(guarded: GrpcSystem) -> None:
    """The last test of the module: the server stops while a unary call and a stream are in flight;
    both are answered, the stream then ends, and new calls are refused."""
    client = tg.InferenceServerClient(guarded.target)
    unary: queue.Queue[Any] = queue.Queue()
    streamed: queue.Queue[Any] = queue.Queue()
    client.async_infer("slow", slow_input(1.0), lambda result, error: unary.put((result, error)), headers=KEY)
    client.start_stream(lambda result, error: streamed.put((result, error)), headers=KEY)
    client.async_stream_infer("slow", slow_input(2.0), request_id="s")
    wait_for(lambda: guarded.system.state.dataplane.in_flight == 2, 10, "both calls to be accepted")
    stopper = threading.Thread(target=guarded.run, args=(guarded.frontend.stop(30),))
    stopper.start()
    deadline = time.monotonic() + 10
    while True:  # the listener closes once the stop has begun
        probe = tg.InferenceServerClient(guarded.target)
        try:
            probe.is_server_live(client_timeout=2)
        except InferenceServerException as err:
            assert err.status() == "StatusCode.UNAVAILABLE", err.message()
            break
        finally:
            probe.close()
        assert time.monotonic() < deadline, "new calls were still served 10 s after the stop began"
        time.sleep(0.02)
    assert streamed.empty(), "the listener closed only once the calls in flight were answered"
    result, error = unary.get(timeout=10)
    assert error is None and result.as_numpy("OUT").tolist() == [[1.0]]
    result, error = streamed.get(timeout=10)
    assert error is None and result.get_response().id == "s"
    stopper.join(10)
    assert not stopper.is_alive()
    client.stop_stream()
    client.close()
