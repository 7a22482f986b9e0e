"""Triton's logging and trace extensions against real processes (Redis, two gateways, workers), driven
by tritonclient: settings round trips (global and per model), a change reaching a worker and the other
gateway through Redis and a process started later picking it up, a traced request's hops in one trace
file on one clock, untraced requests' envelopes unchanged, and invalid settings refused with clear texts."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from fleet.redis_server import free_port
from fleet.trace_points import (
    BATCH_FORMED,
    COMPUTE_END,
    COMPUTE_INPUT_END,
    COMPUTE_OUTPUT_START,
    COMPUTE_START,
    GRPC_SEND_END,
    GRPC_SEND_START,
    GRPC_WAITREAD_END,
    GRPC_WAITREAD_START,
    HTTP_RECV_END,
    HTTP_RECV_START,
    HTTP_SEND_END,
    HTTP_SEND_START,
    QUEUE_START,
    REPLY_RECEIVED,
    REPLY_WRITE,
    REQUEST_END,
    REQUEST_START,
    WORKER_READ,
)
from tests.support.processes import Cluster

pytestmark = pytest.mark.e2e

DOUBLER = Path(__file__).resolve().parents[1] / "models" / "doubler"  # OUT = 2 * IN, 20 ms queue delay
PREFIX = "settings"
# Heartbeats, and with them a worker's samples of Redis's clock, every 0.2 s: its estimate settles sooner.
ENV = {"FLEET_KEY_PREFIX": PREFIX, "FLEET_BLOCK_MS": "200", "FLEET_HEARTBEAT_TTL_S": "60",
       "FLEET_HEARTBEAT_INTERVAL_S": "0.2"}
DEFAULT_LOG = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
               "log_format": "default"}
# How far two processes' estimates of Redis's clock may disagree here (fleet/redis_time.py: half the best
# sample's round trip; observed up to ~5 ms on 2 starved shared cores in a process's first seconds).
CLOCK_ERROR_NS = 10_000_000
HOPS = [HTTP_RECV_START, HTTP_RECV_END, REQUEST_START, QUEUE_START, WORKER_READ, BATCH_FORMED, COMPUTE_START,
        COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END, REPLY_WRITE, REPLY_RECEIVED, REQUEST_END,
        HTTP_SEND_START, HTTP_SEND_END]


class System:
    def __init__(self, cluster: Cluster, other_url: str, trace_dir: Path) -> None:
        self.cluster = cluster
        self.client = http.InferenceServerClient(cluster.base_url.removeprefix("http://"), network_timeout=60)
        self.other = http.InferenceServerClient(other_url, network_timeout=60)  # the second gateway
        self.trace_dir = trace_dir
        self.trace_file = str(trace_dir / "trace.json")


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    tmp = tmp_path_factory.mktemp("settings")
    repo = tmp / "models"
    for name in ("double", "double_b"):
        shutil.copytree(DOUBLER, repo / name)
    c = Cluster(tmp, repo, ENV)
    c.start_redis()
    c.start_gateway({"FLEET_TRACE_FILE": str(tmp / "traces" / "trace.json")})
    other_port = free_port()
    c.start_gateway({"FLEET_TRACE_FILE": str(tmp / "traces-b" / "trace.json")}, http_port=other_port)
    c.start_worker()
    try:
        c.wait_ready()
        c.wait_ready(base_url=f"http://127.0.0.1:{other_port}")
        yield System(c, f"127.0.0.1:{other_port}", tmp / "traces")
    finally:
        c.stop()


def infer(client: http.InferenceServerClient, model: str, request_id: str = "") -> np.ndarray:
    x = http.InferInput("IN", [1, 4], "FP32")
    x.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
    out = client.infer(model, [x], request_id=request_id).as_numpy("OUT")
    assert out is not None
    return out


def eventually(check: Callable[[], Any], what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.1)


def refused(call: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as exc:
        call()
    return str(exc.value.status()), exc.value.message()


def post(system: System, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(system.cluster.base_url + path, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ------------------------------------------------------------------------------------------------ logging


def test_log_settings_round_trip_and_reach_every_process(system: System) -> None:
    client, worker = system.client, system.cluster.workers[0]
    assert client.get_log_settings() == DEFAULT_LOG
    assert "logging" in client.get_server_metadata()["extensions"]
    try:
        updated = client.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
        assert updated == DEFAULT_LOG | {"log_verbose_level": 1, "log_format": "ISO8601"}
        assert client.get_log_settings() == updated
        # The other gateway and the worker apply it from Redis: the worker's own log shows the verbose
        # line of the change, in Triton's ISO8601 format.
        eventually(lambda: system.other.get_log_settings() == updated, "the other gateway follows")
        applied = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z DEBUG fleet\.logs: log settings applied: "
                             r".*log_verbose_level=1 log_format=ISO8601$", re.M)
        eventually(lambda: applied.search(system.cluster.log_of(worker)), "the worker logs at verbose level 1")
        # A worker started now reads the settings in force at start.
        later = system.cluster.start_worker()
        eventually(lambda: applied.search(system.cluster.log_of(later)), "a later worker picks them up", 60)
    finally:
        client.update_log_settings({"log_verbose_level": 0, "log_format": "default"})
    assert client.get_log_settings() == DEFAULT_LOG


@pytest.mark.parametrize(("settings", "status", "text"), [
    ({"log_info": "yes"}, "400", "attempt to access JSON non-boolean as boolean: 'log_info' must be true or false"),
    ({"log_verbose_level": -1}, "400", "'log_verbose_level' must be an integer from 0 to 2147483647, got -1"),
    ({"log_format": "json"}, "400", "invalid argument for --log_format, got: json"),
    ({"log_warnings": False}, "400", "unknown log setting 'log_warnings'"),
    ({"log_file": "/tmp/fleet.log"}, "501", "log file location can not be updated through network protocol"),
])
def test_invalid_log_settings_are_refused_and_change_nothing(system: System, settings: dict[str, Any],
                                                             status: str, text: str) -> None:
    got_status, message = refused(lambda: system.client.update_log_settings({"log_verbose_level": 3, **settings}))
    assert got_status == status and text in message
    assert system.client.get_log_settings() == DEFAULT_LOG


# ------------------------------------------------------------------------------------------------- tracing


def test_trace_settings_round_trip_globally_and_per_model(system: System) -> None:
    client = system.client
    default = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
               "trace_file": system.trace_file, "trace_mode": "triton"}
    assert client.get_trace_settings() == default
    assert client.get_trace_settings(model_name="double") == default
    try:
        model = client.update_trace_settings(model_name="double", settings={"trace_rate": "1"})
        assert model == default | {"trace_rate": "1"}
        assert client.get_trace_settings(model_name="double_b") == default
        # The model follows the global setting in the fields it leaves unset.
        glob = client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_count": "10"})
        assert glob == default | {"trace_level": ["TIMESTAMPS"], "trace_count": "10"}
        assert client.get_trace_settings(model_name="double") == glob | {"trace_rate": "1"}
        # The other gateway follows through Redis (its own trace file, its own counts).
        other_file = {"trace_file": str(system.trace_dir.parent / "traces-b" / "trace.json")}
        eventually(lambda: system.other.get_trace_settings(model_name="double") == glob | {"trace_rate": "1"}
                   | other_file, "the other gateway follows")
        # Restating the file and mode (as a get/update round trip does) is accepted; null clears: the
        # model follows the global setting entirely again.
        cleared = client.update_trace_settings(model_name="double", settings={
            "trace_file": system.trace_file, "trace_mode": "triton", "trace_rate": None})
        assert cleared == glob
    finally:
        client.update_trace_settings(settings={"trace_level": None, "trace_count": None})
    assert client.get_trace_settings(model_name="double") == default


def trace_files(system: System) -> set[Path]:
    return set(system.trace_dir.glob("trace.json.*"))


def complete_json(path: Path) -> Any:
    """The file's JSON once it is all written (None before: it is created, then written)."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def test_a_traced_request_records_every_hop_in_order_on_one_clock(system: System) -> None:
    client = system.client
    try:
        client.update_trace_settings(model_name="double", settings={
            "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1", "log_frequency": "1"})
        before = trace_files(system)
        infer(client, "double_b")  # another model: the global setting (OFF) applies
        start_ns = time.time_ns()
        out = infer(client, "double", request_id="traced-1")
        end_ns = time.time_ns()
        np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32).reshape(1, 4) * 2)
        new = eventually(lambda: trace_files(system) - before, "the trace file is written")
        assert len(new) == 1
        (record,) = eventually(lambda: complete_json(next(iter(new))), "the trace file is complete")
        assert record["model_name"] == "double" and record["model_version"] == 1
        assert record["request_id"] == "traced-1"
        names = [t["name"] for t in record["timestamps"]]
        stamps = [t["ns"] for t in record["timestamps"]]
        assert names == HOPS
        at = dict(zip(names, stamps, strict=True))
        # Each process's hops in order; from one process to the other in order too, up to the error of
        # their estimates of Redis's clock.
        gateway_in, worker, gateway_out = stamps[:4], stamps[4:11], stamps[11:]
        for hops in (gateway_in, worker, gateway_out):
            assert hops == sorted(hops), list(zip(names, stamps, strict=True))
        assert at[QUEUE_START] - CLOCK_ERROR_NS <= at[WORKER_READ], list(zip(names, stamps, strict=True))
        assert at[REPLY_WRITE] - CLOCK_ERROR_NS <= at[REPLY_RECEIVED], list(zip(names, stamps, strict=True))
        # One clock: all within the call as the test saw it (one host: Redis's clock is this clock).
        assert start_ns - CLOCK_ERROR_NS <= stamps[0] and stamps[-1] <= end_ns + CLOCK_ERROR_NS
        # The model's 20 ms queue delay shows where it belongs: between the enqueue and the batch.
        assert at[BATCH_FORMED] - at[QUEUE_START] >= 20_000_000 - CLOCK_ERROR_NS
        # trace_count 1 is spent: the next request is not traced, and GET says so.
        infer(client, "double")
        assert client.get_trace_settings(model_name="double")["trace_count"] == "0"
        time.sleep(0.2)
        assert trace_files(system) - before == new
    finally:
        client.update_trace_settings(model_name="double", settings={
            "trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None})


def test_a_grpc_request_is_traced_with_triton_s_grpc_stamps(system: System) -> None:
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{system.cluster.grpc_port}")
    try:
        system.client.update_trace_settings(model_name="double", settings={
            "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1", "log_frequency": "1"})
        before = trace_files(system)
        x = grpcclient.InferInput("IN", [1, 4], "FP32")
        x.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        out = grpc.infer("double", [x], request_id="traced-grpc").as_numpy("OUT")
        np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32).reshape(1, 4) * 2)
        new = eventually(lambda: trace_files(system) - before, "the trace file is written")
        (record,) = eventually(lambda: complete_json(next(iter(new))), "the trace file is complete")
        assert record["request_id"] == "traced-grpc" and record["model_name"] == "double"
        names = [t["name"] for t in record["timestamps"]]
        assert names == [GRPC_WAITREAD_START, GRPC_WAITREAD_END, *HOPS[2:-2], GRPC_SEND_START, GRPC_SEND_END]
        gateway_in = [t["ns"] for t in record["timestamps"]][:4]
        assert gateway_in == sorted(gateway_in)
    finally:
        system.client.update_trace_settings(model_name="double", settings={
            "trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None})
        grpc.close()


def queued_envelope(system: System, model: str, request_id: str) -> dict[str, Any]:
    """The request as it waits in its lane (workers frozen, so nobody takes it meanwhile)."""
    r = redis.Redis.from_url(system.cluster.redis_url)
    workers = [w for w in system.cluster.workers if w.poll() is None]
    for w in workers:
        w.send_signal(signal.SIGSTOP)
    try:
        x = http.InferInput("IN", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        pending = system.client.async_infer(model, [x], request_id=request_id)

        def find() -> dict[str, Any] | None:
            for key in r.scan_iter(f"{PREFIX}:{{{model}}}:v*:q:*"):
                for _, fields in r.xrange(key):
                    envelope: dict[str, Any] = msgpack.unpackb(fields[b"d"])
                    if envelope["c"] == request_id:
                        return envelope
            return None
        envelope = eventually(find, "the request is queued")
    finally:
        for w in workers:
            w.send_signal(signal.SIGCONT)
        r.close()
    pending.get_result()
    return envelope  # type: ignore[no-any-return]


def test_only_traced_requests_carry_a_trace_in_their_envelope(system: System) -> None:
    assert "tr" not in queued_envelope(system, "double", "plain-1")
    try:
        system.client.update_trace_settings(model_name="double", settings={"trace_level": ["TIMESTAMPS"],
                                                                           "trace_rate": "1"})
        assert queued_envelope(system, "double", "traced-2")["tr"] == {}
    finally:
        system.client.update_trace_settings(model_name="double", settings={"trace_level": None, "trace_rate": None})


@pytest.mark.parametrize(("model", "settings", "status", "text"), [
    (None, {"trace_level": ["OFF", "TIMESTAMPS"]}, "400", "Expect only one trace level 'OFF' is specified"),
    (None, {"trace_level": ["SECONDS"]}, "400", "unknown trace level 'SECONDS'"),
    (None, {"trace_rate": "often"}, "400", "Unable to parse 'trace_rate', got: often"),
    (None, {"trace_count": "-5"}, "400", "Unable to parse 'trace_count'. Expecting value >= -1, got:-5"),
    ("double", {"trace_level": ["TIMESTAMPS"], "trace_rate": "0"}, "400",
     "Attempting to set invalid trace setting :sample rate must be non-zero"),
    ("nope", {"trace_rate": "1"}, "400", "Request for unknown model : nope"),  # tritonserver 2.51's words
    (None, {"trace_file": "/etc/cron.d/x"}, "501", "trace file location can not be updated through network protocol"),
    (None, {"trace_mode": "opentelemetry"}, "501", "trace mode \"opentelemetry\" is not supported"),
])
def test_invalid_trace_settings_are_refused_and_change_nothing(system: System, model: str | None,
                                                               settings: dict[str, Any], status: str,
                                                               text: str) -> None:
    got_status, message = refused(lambda: system.client.update_trace_settings(model_name=model, settings=settings))
    assert got_status == status and text in message
    assert system.client.get_trace_settings(model_name="double")["trace_level"] == ["OFF"]


def test_malformed_bodies_and_versioned_trace_urls_are_400s(system: System) -> None:
    assert post(system, "/v2/logging", b"{not json") == \
        (400, {"error": "failed to parse the request JSON buffer: it is not UTF-8 JSON"})
    status, doc = post(system, "/v2/models/double/versions/1/trace/setting", b"{}")
    assert status == 400 and "use /v2/models/double/trace/setting" in doc["error"]


def test_grpc_serves_the_same_settings(system: System) -> None:
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{system.cluster.grpc_port}")
    try:
        logs = grpc.get_log_settings(as_json=True)["settings"]
        assert logs["log_verbose_level"] == {"uint32_param": 0} and logs["log_info"] == {"bool_param": True}
        assert logs["log_format"] == {"string_param": "default"}
        updated = grpc.update_log_settings({"log_warning": False}, as_json=True)["settings"]
        assert updated["log_warning"] == {"bool_param": False}
        assert system.client.get_log_settings() == DEFAULT_LOG | {"log_warning": False}
        trace = grpc.update_trace_settings(model_name="double", settings={"trace_rate": "7"}, as_json=True)
        assert trace["settings"]["trace_rate"] == {"value": ["7"]}
        assert trace["settings"]["trace_level"] == {"value": ["OFF"]}
        assert system.client.get_trace_settings(model_name="double")["trace_rate"] == "7"
        # A request without settings reads them; one without a value clears that setting.
        assert grpc.get_trace_settings(model_name="double", as_json=True) == trace
        cleared = grpc.update_trace_settings(model_name="double", settings={"trace_rate": None}, as_json=True)
        assert cleared["settings"]["trace_rate"] == {"value": ["1000"]}
        with pytest.raises(InferenceServerException) as exc:
            grpc.update_trace_settings(settings={"trace_level": ["OFF", "TENSORS"]})
        assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "Expect only one trace level 'OFF' is specified" in exc.value.message()
        with pytest.raises(InferenceServerException) as exc:
            grpc.update_log_settings({"log_file": "/tmp/x.log"})
        assert exc.value.status() == "StatusCode.UNIMPLEMENTED"
    finally:
        system.client.update_log_settings({"log_warning": True})
        grpc.close()
