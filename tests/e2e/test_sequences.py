"""Sequence batching through real processes (Redis, a gateway, two workers) and Triton's own clients:
Triton's simple_sequence and simple_dyna_sequence give the answers its example clients check
(simple_http_sequence_sync_infer_client.py, the gRPC stream variant), a stateful model carries implicit
state and keeps each sequence on one instance while sequences batch together, idle sequences are
released, and a worker killed mid-sequence makes the sequence's next request a clear 503."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.processes import Cluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT.parent / "shared" / "triton-examples" / "model_repository"
PREFIX = "sequences"
VALUES = [11, 7, 5, 3, 2, 0, 1]  # what Triton's example clients send after a first value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("sequences")
    repo = tmp / "models"
    repo.mkdir()
    for name in ("simple_sequence", "simple_dyna_sequence"):
        shutil.copytree(EXAMPLES / name, repo / name)
    shutil.copytree(ROOT / "tests" / "composition_models" / "accumulate", repo / "accumulate")
    c = Cluster(tmp, repo, {"FLEET_KEY_PREFIX": PREFIX, "FLEET_HEARTBEAT_TTL_S": "3"})
    c.start_redis()
    try:
        c.start_gateway()
        c.start_worker()
        c.start_worker()
        c.wait_ready(120)
        yield c
    finally:
        c.stop()


def http_send(client: Any, model: str, values: list[int], sequence_id: int | str) -> list[int]:
    """As Triton's simple_http_sequence_sync_infer_client.py sends a sequence: START on the first, END on
    the last, one INT32 [1, 1] value each."""
    out = []
    for i, value in enumerate(values):
        tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
        result = client.infer(model, [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT")],
                              sequence_id=sequence_id, sequence_start=i == 0, sequence_end=i == len(values) - 1)
        out.append(int(result.as_numpy("OUTPUT")[0][0]))
    return out


def test_simple_sequence_gives_the_example_clients_answers(cluster: Cluster) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.http_port}")
    seq0 = http_send(client, "simple_sequence", [0, *VALUES], 1000)
    seq1 = http_send(client, "simple_sequence", [100, *(-v for v in VALUES)], 1001)
    text = http_send(client, "simple_sequence", [20, *(-v for v in VALUES)], str(uuid.uuid4()))
    # The client's checks: the first answer is the first value plus START, then each value back.
    assert seq0 == [1, *VALUES]
    assert seq1 == [101, *(-v for v in VALUES)]
    assert text == [21, *(-v for v in VALUES)]


def test_simple_dyna_sequence_adds_the_correlation_id_at_the_end(cluster: Cluster) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.http_port}")
    seq0 = http_send(client, "simple_dyna_sequence", [0, *VALUES], 1000)
    seq1 = http_send(client, "simple_dyna_sequence", [100, *(-v for v in VALUES)], 1001)
    # The client's -d checks: the dyna model adds the correlation id (CORRID) to the request with END.
    assert seq0 == [1, *VALUES[:-1], 1 + 1000]
    assert seq1 == [101, *(-v for v in VALUES[:-1]), -1 + 1001]


def test_grpc_stream_interleaves_two_sequences(cluster: Cluster) -> None:
    """As simple_grpc_sequence_stream_infer_client.py: two sequences' requests sent alternately on one
    stream, each answered in its sequence's order."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        sequences = {2000: [0, *VALUES], 2001: [100, *(-v for v in VALUES)]}
        n = len(VALUES) + 1
        for i in range(n):
            for sid, values in sequences.items():
                tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(np.full((1, 1), values[i], dtype=np.int32))
                client.async_stream_infer("simple_dyna_sequence", [tensor], request_id=f"{sid}_{i}",
                                          sequence_id=sid, sequence_start=i == 0, sequence_end=i == n - 1)
        got: dict[int, dict[int, int]] = {2000: {}, 2001: {}}
        arrived: dict[int, list[int]] = {2000: [], 2001: []}
        for _ in range(2 * n):
            result, error = results.get(timeout=30)
            assert error is None, error.message()
            sid, i = (int(x) for x in result.get_response().id.split("_"))
            got[sid][i] = int(result.as_numpy("OUTPUT")[0][0])
            arrived[sid].append(i)
    finally:
        client.stop_stream()
    # Triton's stream client files each answer under its sequence in the order it arrives.
    assert arrived == {2000: list(range(n)), 2001: list(range(n))}
    assert [got[2000][i] for i in range(n)] == [1, *VALUES[:-1], 1 + 2000]
    assert [got[2001][i] for i in range(n)] == [101, *(-v for v in VALUES[:-1]), -1 + 2001]


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["error"])


def body(value: int = 1, rows: int = 1, **params: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [rows, 1], "data": [value] * rows}],
            "parameters": params}


def test_requests_that_break_sequence_rules_are_400s(cluster: Cluster) -> None:
    url = f"{cluster.base_url}/v2/models/simple_dyna_sequence/infer"
    with httpx.Client(timeout=30) as http:
        assert error_of(http.post(url, json=body()), 400) == (
            "inference request to model 'simple_dyna_sequence' must specify a non-zero or non-empty correlation ID")
        assert error_of(http.post(url, json=body(sequence_id=4242)), 400) == (
            "inference request for sequence 4242 to model 'simple_dyna_sequence' must specify the START flag on "
            "the first request of the sequence")
        assert "batch-size 1" in error_of(http.post(url, json=body(rows=2, sequence_id=5, sequence_start=True)), 400)
        assert "must be an integer" in error_of(
            http.post(url, json=body(sequence_id="abc", sequence_start=True)), 400)  # CORRID is UINT64
        # After END the sequence is over: its id needs START again.
        assert http.post(url, json=body(sequence_id=77, sequence_start=True, sequence_end=True)).status_code == 200
        assert "START flag" in error_of(http.post(url, json=body(sequence_id=77)), 400)


def accumulate(http: httpx.Client, cluster: Cluster, sid: str, value: int, start: bool = False,
               end: bool = False) -> httpx.Response:
    return http.post(f"{cluster.base_url}/v2/models/accumulate/infer",
                     json=body(value, sequence_id=sid, sequence_start=start, sequence_end=end))


def outputs(response: httpx.Response) -> dict[str, int]:
    assert response.status_code == 200, response.text
    return {o["name"]: o["data"][0] for o in response.json()["outputs"]}


def test_implicit_state_and_one_instance_per_sequence_while_sequences_batch(cluster: Cluster) -> None:
    errors: list[str] = []
    batches: list[int] = []

    def run(k: int) -> None:
        with httpx.Client(timeout=30) as http:
            total = 0
            for i in range(12):
                total += k + i
                got = outputs(accumulate(http, cluster, f"acc-{k}", k + i, start=i == 0, end=i == 11))
                batches.append(got["BATCH"])
                if got["OUTPUT"] != total or got["MEMO"] != total:
                    errors.append(f"sequence {k} request {i}: {got}, expected {total}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(batches) == 144
    assert max(batches) > 1, "concurrent sequences never shared a batch"


def test_an_idle_sequence_is_released_after_the_idle_timeout(cluster: Cluster) -> None:
    with httpx.Client(timeout=30) as http:
        assert outputs(accumulate(http, cluster, "idle", 5, start=True))["OUTPUT"] == 5
        assert outputs(accumulate(http, cluster, "idle", 1))["OUTPUT"] == 6
        time.sleep(3.6)  # accumulate's max_sequence_idle_microseconds is 3 s
        assert "START flag" in error_of(accumulate(http, cluster, "idle", 1), 400)


def owner_pid(cluster: Cluster, sid: str) -> int:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        worker = client.get(f"{PREFIX}:{{accumulate}}:v1:sequence:s:{sid}")
        assert worker
        return int(client.hget(f"{PREFIX}:worker:{worker}", "pid") or 0)
    finally:
        client.close()


def test_a_worker_killed_mid_sequence_makes_its_next_request_a_clear_503(cluster: Cluster) -> None:
    with httpx.Client(timeout=60) as http:
        assert outputs(accumulate(http, cluster, "doomed", 3, start=True))["OUTPUT"] == 3
        pid = owner_pid(cluster, "doomed")
        victim = next(w for w in cluster.workers if w.pid == pid)  # one this test session started
        # Frozen first: its heartbeat stops while the next request is queued on its stream.
        os.kill(pid, signal.SIGSTOP)
        try:
            queued: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: queued.append(accumulate(http, cluster, "doomed", 4)))
            sender.start()
            time.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
        finally:
            victim.wait(10)
        sender.join(60)
        # The request that waited on the dead worker's stream is answered by a live worker, not left to time out.
        assert "start the sequence again" in error_of(queued[0], 503)
        # And the next one, routed after the owner is known gone.
        assert "start the sequence again" in error_of(accumulate(http, cluster, "doomed", 5), 503)
        # START again: served by the surviving worker, from the initial state.
        assert outputs(accumulate(http, cluster, "doomed", 6, start=True))["OUTPUT"] == 6
        assert outputs(accumulate(http, cluster, "doomed", 1, end=True))["OUTPUT"] == 7
    with pytest.raises(InferenceServerException):  # the example model keeps its rules over gRPC too
        grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}").infer(
            "simple_sequence", [grpcclient.InferInput("INPUT", [1, 1], "INT32").set_data_from_numpy(
                np.zeros((1, 1), np.int32))], sequence_id=9, sequence_start=False)
