"""SIGTERM on a real gateway process with gRPC calls in flight (unary and on a stream): it stops
accepting gRPC at once, answers every call it accepted with its own value, ends the stream, and exits
as after an HTTP drain (tests/e2e/test_faults.py's SIGTERM test is the HTTP twin)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from fleet.keys import Keys
from fleet.redis_server import free_port
from tests.support.processes import Cluster
from tests.support.queue_models import sleeper_repository

pytestmark = pytest.mark.e2e
STOPPED_BY_SIGTERM = (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM it caught once drained
SLEEP_MS = 600  # 9 calls in batches of two: ~3 s of work, long past the checks right after SIGTERM


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    repo = sleeper_repository(tmp_path, "slow", sleep_ms=SLEEP_MS, max_batch_size=2,
                              dynamic_batching="max_queue_delay_microseconds: 1000")
    c = Cluster(tmp_path, repo, {"FLEET_KEY_PREFIX": "grpcstop", "FLEET_BLOCK_MS": "200"})
    c.start_redis()
    c.start_gateway()
    c.start_worker()
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def one(value: float) -> list[tg.InferInput]:
    x = tg.InferInput("IN", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[value]], np.float32))
    return [x]


def _until_enqueued(cluster: Cluster, n: int) -> None:
    queue_key = Keys("grpcstop").queue("slow", version=1)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        deadline = time.monotonic() + 30
        while not (client.exists(queue_key) and client.xinfo_stream(queue_key)["entries-added"] >= n):
            assert time.monotonic() < deadline, "the calls were not enqueued within 30 s"
            time.sleep(0.02)
    finally:
        client.close()


def test_sigterm_answers_the_grpc_calls_in_flight(cluster: Cluster) -> None:
    gateway = cluster.gateway
    assert gateway is not None
    target = f"127.0.0.1:{cluster.grpc_port}"
    client = tg.InferenceServerClient(target)
    unary: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
    for i in range(6):  # three batches of two
        client.async_infer("slow", one(float(i)), request_id=str(i),
                           callback=lambda result, error, i=i: unary.put((i, result, error)))
    stream_client = tg.InferenceServerClient(target)
    stream_client.start_stream(lambda result, error: streamed.put((result, error)))
    for i in range(3):
        stream_client.async_stream_infer("slow", one(100.0 + i), request_id=f"s{i}")
    _until_enqueued(cluster, 9)  # all accepted: a call that came after the SIGTERM would be refused
    gateway.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert gateway.poll() is None, "the gateway exited with calls in flight"
    late = tg.InferenceServerClient(target)
    deadline = time.monotonic() + 10  # a loaded host may take a while to run the signal's handler
    while True:
        try:
            late.is_server_live(client_timeout=3)
        except InferenceServerException as exc:
            assert exc.status() == "StatusCode.UNAVAILABLE", exc.message()
            break
        assert time.monotonic() < deadline, "a new call was still served 10 s after SIGTERM"
        time.sleep(0.1)
    got = sorted((unary.get(timeout=30) for _ in range(6)), key=lambda t: t[0])
    assert [(i, e) for i, _, e in got if e is not None] == []
    assert [r.as_numpy("OUT").tolist() for _, r, _ in got] == [[[float(i)]] for i in range(6)]
    answers = [streamed.get(timeout=30) for _ in range(3)]
    assert all(e is None for _, e in answers), answers
    assert sorted((r.get_response().id, r.as_numpy("OUT").tolist()) for r, _ in answers) == \
        [(f"s{i}", [[100.0 + i]]) for i in range(3)]
    assert gateway.wait(30) in STOPPED_BY_SIGTERM, cluster.log_of(gateway)[-3000:]
    log = cluster.log_of(gateway)
    assert "gRPC inference service stopped" in log
    stream_client.stop_stream()
    for c in (client, stream_client, late):
        c.close()


def test_a_taken_grpc_port_fails_the_start(tmp_path: Path) -> None:
    """As a taken HTTP port does: no second gateway silently sharing the port (SO_REUSEPORT is off)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
        proc = subprocess.run([sys.executable, "-m", "fleet", "gateway", "--model-repository", str(tmp_path),
                               "--redis-url", "redis://127.0.0.1:1/0", "--http-port", str(free_port()),
                               "--metrics-port", str(free_port()), "--grpc-port", str(port)],
                              capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"cannot serve gRPC: cannot take 127.0.0.1:{port}" in proc.stdout + proc.stderr
