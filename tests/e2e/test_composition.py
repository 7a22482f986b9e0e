"""Decoupled models and BLS through real processes (Redis, a gateway, a worker) and Triton's own clients:
gRPC ModelStreamInfer with tritonclient (responses as they come, the empty final response when asked
for), BLS with tritonclient over HTTP, and a client that goes away cancelling a decoupled request: the
model sees request.is_cancelled() (it writes the request id to a log) for an HTTP event stream and for
a gRPC stream."""

from __future__ import annotations

import http.client
import json
import queue
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support.processes import Cluster

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "composition_models"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("composition")
    repo = tmp / "models"
    repo.mkdir()
    for name in ("square", "ticker", "square_sum", "bls_sync"):
        shutil.copytree(MODELS / name, repo / name)
    shutil.copytree(ROOT / "model_repository" / "add_sub", repo / "add_sub")
    config = repo / "ticker" / "config.pbtxt"
    log = tmp / "cancelled"
    config.write_text(config.read_text().replace('key: "CANCEL_LOG", value: { string_value: "" }',
                                                 f'key: "CANCEL_LOG", value: {{ string_value: "{log}" }}'))
    c = Cluster(tmp, repo, {"FLEET_KEY_PREFIX": "composition"})
    c.start_redis()
    try:
        c.start_gateway()
        c.start_worker()
        c.wait_ready(90)
        yield c
    finally:
        c.stop()


def cancelled(c: Cluster) -> list[str]:
    log = c.tmp / "cancelled"
    return log.read_text().splitlines() if log.exists() else []


def wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def int32(name: str, value: int, client: Any = grpcclient) -> Any:
    tensor = client.InferInput(name, [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    return tensor


def test_grpc_stream_of_a_decoupled_model(cluster: Cluster) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("square", [int32("IN", 3)], request_id="sq", enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            got.append((response.id, None if final else int(result.as_numpy("OUT")[0]), final))
            if final:
                break
        # Three responses of 3, then the final flag alone as an empty response.
        assert got == [("sq", 3, False)] * 3 + [("sq", None, True)]

        # Without the empty final response: just the responses; several requests in flight on one stream.
        for n in (2, 4):
            client.async_stream_infer("ticker", [int32("N", n)], request_id=f"t{n}")
        ticks: dict[str, list[int]] = {"t2": [], "t4": []}
        finals: dict[str, list[bool]] = {"t2": [], "t4": []}
        while len(ticks["t2"]) < 2 or len(ticks["t4"]) < 4:
            result, error = results.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            ticks[response.id].append(int(result.as_numpy("TICK")[0]))
            finals[response.id].append(response.parameters["triton_final_response"].bool_param)
        assert ticks == {"t2": [0, 1], "t4": [0, 1, 2, 3]}
        # Marked as tritonserver 2.51 marks them without the parameter: each one, the last (sent with the
        # final flag by this model) final.
        assert finals == {"t2": [False, True], "t4": [False, False, False, True]}

        # An unknown input is that request's error; the stream stays open.
        client.async_stream_infer("square", [int32("NOPE", 1)], request_id="bad")
        result, error = results.get(timeout=30)
        assert result is None and "NOPE" in str(error)
        client.async_stream_infer("square", [int32("IN", 1)], request_id="ok")
        result, error = results.get(timeout=30)
        assert error is None and int(result.as_numpy("OUT")[0]) == 1
    finally:
        client.stop_stream()
        client.close()


def test_bls_with_tritonclient(cluster: Cluster) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.http_port}")
    name = httpclient.InferInput("MODEL_NAME", [1], "BYTES")
    name.set_data_from_numpy(np.array([b"add_sub"], dtype=np.object_))
    a, b = np.arange(4, dtype=np.float32), np.full(4, 2.0, dtype=np.float32)
    inputs = [name, httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
    inputs[1].set_data_from_numpy(a)
    inputs[2].set_data_from_numpy(b)
    result = client.infer("bls_sync", inputs)
    assert (result.as_numpy("OUTPUT0") == a + b).all() and (result.as_numpy("OUTPUT1") == a - b).all()
    result = client.infer("square_sum", [int32("IN", 5, httpclient)])
    assert int(result.as_numpy("SUM")[0]) == 25
    client.close()


def test_a_client_that_goes_away_cancels_its_decoupled_request(cluster: Cluster) -> None:
    before = len(cancelled(cluster))
    # HTTP: read two events of a long stream (200 ticks, 50 ms apart), then close the connection.
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=30)
    conn.request("POST", "/v2/models/ticker/generate_stream", body=json.dumps({"N": 200, "DELAY_MS": 50, "id": "h1"}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    seen = b""
    while seen.count(b"\n\n") < 2:
        seen += response.read1(4096)
    conn.close()
    wait_for(lambda: len(cancelled(cluster)) > before)
    assert cancelled(cluster)[-1].startswith("h1 at "), cancelled(cluster)
    assert int(cancelled(cluster)[-1].split(" at ")[1]) < 100  # stopped early, not at the end

    # gRPC: the client stops its stream with cancel_requests.
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("ticker", [int32("N", 200), int32("DELAY_MS", 50)], request_id="g1")
    for _ in range(2):
        result, error = results.get(timeout=30)
        assert error is None, error
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_for(lambda: len(cancelled(cluster)) > before + 1)
    assert cancelled(cluster)[-1].startswith("g1 at "), cancelled(cluster)

    # The instance is free again: a short request is answered at once, not after 200 ticks.
    started = time.monotonic()
    http_client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.http_port}")
    ticks = http_client.infer("ticker", [int32("N", 1, httpclient)])
    assert int(ticks.as_numpy("TICK")[0]) == 0 and time.monotonic() - started < 5
    http_client.close()
