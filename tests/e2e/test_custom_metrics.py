"""Python models' own metrics (pb_utils.MetricFamily) on fleet's metrics port, through real processes:
Redis, a gateway and two workers. Triton's python_backend `custom_metrics` example (vendored unchanged in
tests/models/custom_metrics) passes its client's checks; a probe model's counter, gauge and histogram
are the sums over both workers; a killed worker's counters stay and its gauge goes."""

from __future__ import annotations

import re
import shutil
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from fleet.custom_metrics import decode
from fleet.keys import Keys
from tests.support.processes import Cluster

pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[1] / "models"
PREFIX = "custommetrics"
PROBE = 'model="metrics_probe",version="1"'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("custom-metrics")
    repo = tmp / "models"
    for name in ("custom_metrics", "metrics_probe"):
        shutil.copytree(MODELS / name, repo / name)
    # Short heartbeats: the killed worker is noticed within a few seconds.
    env = {"FLEET_KEY_PREFIX": PREFIX, "FLEET_BLOCK_MS": "200", "FLEET_HEARTBEAT_INTERVAL_S": "0.3",
           "FLEET_HEARTBEAT_TTL_S": "2"}
    c = Cluster(tmp, repo, env)
    c.start_redis()
    c.start_gateway()
    c.start_worker()
    c.start_worker()
    try:
        c.wait_ready(timeout_s=120)
        # wait_ready reads the heartbeats itself; the gateway reads them every HEARTBEAT_POLL_S, and counts a
        # worker's gauges only once it has seen that worker's heartbeat: wait until it has seen both.
        deadline = time.monotonic() + 30
        while _instances(c) != 2:
            assert time.monotonic() < deadline, f"the gateway never counted both workers:\n{get_metrics(c)}"
            time.sleep(0.1)
        yield c
    finally:
        c.stop()


def _instances(c: Cluster) -> float | None:
    match = re.search(rf"^probe_instances{{{re.escape(PROBE)}}} (\S+)$", get_metrics(c), re.MULTILINE)
    return None if match is None else float(match.group(1))


def get_metrics(c: Cluster) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def sample(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"no {name}{{{labels}}} in:\n{text}"
    return float(match.group(1))


def test_tritons_custom_metrics_example_passes(cluster: Cluster) -> None:
    """python_backend/examples/custom_metrics/client.py, its checks as they are (an assert for each of its
    `sys.exit(1)`), against fleet's ports instead of localhost:8000 and :8002."""
    model_name = "custom_metrics"
    shape = [4]
    with httpclient.InferenceServerClient(f"127.0.0.1:{cluster.http_port}") as client:
        input0_data = np.random.rand(*shape).astype(np.float32)
        input1_data = np.random.rand(*shape).astype(np.float32)
        inputs = [
            httpclient.InferInput("INPUT0", input0_data.shape, np_to_triton_dtype(input0_data.dtype)),
            httpclient.InferInput("INPUT1", input1_data.shape, np_to_triton_dtype(input1_data.dtype)),
        ]
        inputs[0].set_data_from_numpy(input0_data)
        inputs[1].set_data_from_numpy(input1_data)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
        response = client.infer(model_name, inputs, request_id=str(1), outputs=outputs)
        output0_data = response.as_numpy("OUTPUT0")
        output1_data = response.as_numpy("OUTPUT1")
        assert np.allclose(input0_data + input1_data, output0_data), "custom_metrics example error: incorrect sum"
        assert np.allclose(input0_data - input1_data, output1_data), \
            "custom_metrics example error: incorrect difference"

        metrics = get_metrics(cluster)
        patterns = [
            "# HELP requests_process_latency_ns Cumulative time spent processing requests",
            "# TYPE requests_process_latency_ns counter",
            'requests_process_latency_ns{model="custom_metrics",version="1"}',
        ]
        for pattern in patterns:
            assert pattern in metrics, f"custom_metrics example error: missing pattern '{pattern}' in metrics"
    # Beyond the example: the response's execute() is counted by the time the response arrives.
    assert sample(metrics, "requests_process_latency_ns", 'model="custom_metrics",version="1"') > 0
    assert metrics.count("# TYPE requests_process_latency_ns ") == 1


def _probe(c: Cluster, values: list[float]) -> None:
    def one(value: float) -> None:
        with httpclient.InferenceServerClient(f"127.0.0.1:{c.http_port}") as client:
            data = np.full(4, value, dtype=np.float32)
            inp = httpclient.InferInput("IN", [4], "FP32")
            inp.set_data_from_numpy(data)
            assert np.array_equal(client.infer("metrics_probe", [inp]).as_numpy("OUT"), data)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, values))


def _parts(c: Cluster) -> dict[str, float]:
    """Each worker's part of probe_requests, as published in Redis."""
    client = redis.Redis.from_url(c.redis_url)
    try:
        raw = client.hgetall(Keys(PREFIX).custom_metrics("metrics_probe"))
    finally:
        client.close()
    out = {}
    for worker, blob in raw.items():
        families = {f.name: f for f in decode(msgpack.unpackb(blob, raw=False))}
        out[worker.decode()] = families["probe_requests"].series[0].value
    return out


def test_two_workers_metrics_are_combined(cluster: Cluster) -> None:
    before = get_metrics(cluster)
    assert sample(before, "probe_instances", PROBE) == 2  # one instance per worker, each set its gauge to 1
    requests_before = sample(before, "probe_requests", PROBE)
    values = [0.5] * 10 + [3.0] * 6 + [9.0] * 4
    _probe(cluster, values)
    after = get_metrics(cluster)
    # Read as soon as the last response arrived: each execute()'s metrics are published before its reply.
    assert sample(after, "probe_requests", PROBE) == requests_before + len(values)
    parts = _parts(cluster)
    assert len(parts) == 2 and all(v > 0 for v in parts.values()), f"both workers served some: {parts}"
    assert sum(parts.values()) == requests_before + len(values)
    assert "# TYPE probe_values histogram" in after
    count = sample(after, "probe_values_count", PROBE)
    assert count >= len(values)
    for le, expected in (("1", 10), ("2", 10), ("4", 16), ("+Inf", 20)):
        assert sample(after, "probe_values_bucket", f'{PROBE},le="{le}"') - sample(
            before, "probe_values_bucket", f'{PROBE},le="{le}"') == expected
    assert sample(after, "probe_values_sum", PROBE) - sample(before, "probe_values_sum", PROBE) == \
        pytest.approx(sum(values))


def test_a_killed_workers_counters_stay_and_its_gauges_go(cluster: Cluster) -> None:
    """Last in this module: it kills one of the two workers."""
    _probe(cluster, [1.0] * 8)
    before = get_metrics(cluster)
    requests_before = sample(before, "probe_requests", PROBE)
    cluster.workers[1].send_signal(signal.SIGKILL)
    cluster.workers[1].wait(10)
    deadline = time.monotonic() + 30
    while sample(text := get_metrics(cluster), "probe_instances", PROBE) != 1:
        assert time.monotonic() < deadline, f"the dead worker's gauge is still counted:\n{text}"
        assert sample(text, "probe_requests", PROBE) == requests_before  # never backwards meanwhile
        time.sleep(0.2)
    assert sample(text, "probe_requests", PROBE) == requests_before
    _probe(cluster, [1.0] * 3)
    assert sample(get_metrics(cluster), "probe_requests", PROBE) == requests_before + 3
