"""`fleet up --gateways N` (and `fleet gateway --processes N`): N gateway processes share the HTTP,
metrics and gRPC ports (SO_REUSEPORT). The kernel spreads connections over them, each answers, a
shared-memory region registered over one connection serves requests on all of them (tritonclient's and
perf_analyzer's flow), and one gateway killed by PID leaves the others serving while it is restarted."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from bench.procs import TCP_ESTABLISHED, TCP_LISTEN, fleet_children, stop, tcp_ports
from fleet.redis_server import free_port
from tests.e2e.conftest import ROOT

MODELS = ROOT / "tests" / "models"
HOST = "127.0.0.1"
PERF_ANALYZER = ROOT / ".tools/perf_analyzer/perf_analyzer"
GATEWAYS = 2


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    log: Path
    http_port: int
    metrics_port: int
    grpc_port: int

    def gateways(self) -> list[int]:
        return fleet_children(self.proc.pid, "gateway")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("gateways")
    repo = tmp / "repo"
    shutil.copytree(MODELS / "doubler", repo / "doubler")
    ports = free_port(), free_port(), free_port()
    log = tmp / "fleet.log"
    cmd = [sys.executable, "-m", "fleet", "up", "--model-repository", str(repo), "--data-dir", str(tmp / "data"),
           "--http-port", str(ports[0]), "--metrics-port", str(ports[1]), "--grpc-port", str(ports[2]),
           "--workers", "1", "--job-workers", "0", "--gateways", str(GATEWAYS)]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    system = Up(proc, log, *ports)
    try:
        _until_all_serve(system)
        yield system
    finally:
        stop(proc, signal.SIGINT)


def _until_all_serve(system: Up, timeout_s: float = 120) -> None:
    """Every process listens on all three ports (a shared socket listens once its process has started),
    then each answers ready once it has seen the worker: 20 fresh connections in a row, each hashed to
    either process, say both do."""
    ports = {system.http_port, system.metrics_port, system.grpc_port}
    deadline, in_a_row = time.monotonic() + timeout_s, 0
    while in_a_row < 20:
        assert system.proc.poll() is None and time.monotonic() < deadline, system.tail()
        pids = system.gateways()
        up = len(pids) == GATEWAYS and all(ports <= _listening(pid) for pid in pids)
        in_a_row = in_a_row + 1 if up and _ready(system.http_port) else 0
        time.sleep(0.02 if in_a_row else 0.2)


def _ready(port: int) -> bool:
    try:
        return _get(port, "/v2/health/ready")[0] == 200
    except OSError:
        return False


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _infer(conn: http.client.HTTPConnection, value: float) -> tuple[int, object]:
    body = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [value]}]})
    conn.request("POST", "/v2/models/doubler/infer", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    doc = json.loads(r.read())
    return r.status, doc["outputs"][0]["data"] if r.status == 200 else doc


def _answered_on_fresh_connections(port: int, n: int) -> None:
    for i in range(n):
        conn = http.client.HTTPConnection(HOST, port, timeout=30)
        try:
            assert _infer(conn, float(i)) == (200, [2.0 * i])
        finally:
            conn.close()


def _spread(pids: list[int], port: int, total: int | None = None) -> dict[int, int]:
    """Connections each process holds on `port`, once every one holds some (and `total` in all, if given):
    a read of /proc/net/tcp can skip a line while other tests open and close sockets, so read again."""
    deadline = time.monotonic() + 10
    while True:
        spread = {pid: tcp_ports(pid, TCP_ESTABLISHED).count(port) for pid in pids}
        good = all(n > 0 for n in spread.values()) and total in (None, sum(spread.values()))
        if good or time.monotonic() > deadline:
            return spread
        time.sleep(0.1)


def _listening(pid: int) -> set[int]:
    return set(tcp_ports(pid, TCP_LISTEN))


def test_every_gateway_listens_on_all_three_ports_and_connections_spread(up: Up) -> None:
    pids = up.gateways()
    for pid in pids:
        deadline = time.monotonic() + 10  # one read of /proc/net/tcp may skip a line (_spread)
        while not {up.http_port, up.metrics_port, up.grpc_port} <= _listening(pid):
            assert time.monotonic() < deadline, (pid, _listening(pid))
            time.sleep(0.1)
    # 24 connections held open: the kernel hashes each to one of the processes (all on one: p = 2^-23).
    conns = [http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=30) for _ in range(24)]
    try:
        for i, conn in enumerate(conns):
            assert _infer(conn, float(i)) == (200, [2.0 * i])
        spread = _spread(pids, up.http_port, total=len(conns))
        assert sum(spread.values()) == len(conns) and all(n > 0 for n in spread.values()), spread
    finally:
        for conn in conns:
            conn.close()
    status, text = _get(up.metrics_port, "/metrics")
    assert status == 200 and b'nv_inference_request_success{model="doubler",version="1"}' in text


def test_grpc_is_served_by_each_process(up: Up) -> None:
    pids = up.gateways()
    # A channel of its own per client (gRPC shares subchannels across channels by default).
    clients = [grpcclient.InferenceServerClient(f"127.0.0.1:{up.grpc_port}",
                                                channel_args=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(16)]
    try:
        for i, client in enumerate(clients):
            inp = grpcclient.InferInput("IN", [1, 1], "FP32")
            inp.set_data_from_numpy(np.array([[float(i)]], dtype=np.float32))
            result = client.infer("doubler", [inp])
            assert result.as_numpy("OUT").tolist() == [[2.0 * i]]
        spread = _spread(pids, up.grpc_port)
        assert all(n > 0 for n in spread.values()), spread
    finally:
        for client in clients:
            client.close()


def test_a_region_registered_over_one_connection_serves_them_all(up: Up) -> None:
    tag = uuid.uuid4().hex[:10]
    url = f"127.0.0.1:{up.http_port}"
    handles = [shm.create_shared_memory_region(f"{io}_{tag}", f"/{io}_{tag}", 16, create_only=True)
               for io in ("in", "out")]
    registrar = httpclient.InferenceServerClient(url)
    clients: list[httpclient.InferenceServerClient] = []
    try:
        shm.set_shared_memory_region(handles[0], [np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)])
        for io in ("in", "out"):
            registrar.register_system_shared_memory(f"{io}_{tag}", f"/{io}_{tag}", 16)
        clients = [httpclient.InferenceServerClient(url) for _ in range(16)]  # a connection each
        for client in clients:
            inp = httpclient.InferInput("IN", [1, 4], "FP32")
            inp.set_shared_memory(f"in_{tag}", 16)
            out = httpclient.InferRequestedOutput("OUT", binary_data=True)
            out.set_shared_memory(f"out_{tag}", 16)
            client.infer("doubler", [inp], outputs=[out])
            assert shm.get_contents_as_numpy(handles[1], np.float32, [1, 4]).tolist() == [[2.0, 4.0, 6.0, 8.0]]
            shm.set_shared_memory_region(handles[1], [np.zeros((1, 4), dtype=np.float32)])
            assert {r["name"] for r in client.get_system_shared_memory_status()} == {f"in_{tag}", f"out_{tag}"}
        spread = _spread(up.gateways(), up.http_port)
        assert all(n > 0 for n in spread.values()), spread
        registrar.unregister_system_shared_memory()
        assert all(c.get_system_shared_memory_status() == [] for c in clients)
    finally:
        for client in [registrar, *clients]:
            client.close()
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def test_perf_analyzer_with_system_shared_memory(up: Up) -> None:
    exe = str(PERF_ANALYZER) if PERF_ANALYZER.exists() else shutil.which("perf_analyzer")
    assert exe, "perf_analyzer is not installed: run `make perf-analyzer` (make test does)"
    for protocol, port in (("http", up.http_port), ("grpc", up.grpc_port)):
        cmd = [exe, "-m", "doubler", "-i", protocol, "-u", f"127.0.0.1:{port}", "--shared-memory", "system",
               "--shape", "IN:4", "--concurrency-range", "8", "--measurement-interval", "1000",
               "--stability-percentage", "100"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Request concurrency: 8" in proc.stdout


def test_a_killed_gateway_leaves_the_others_serving_and_is_restarted(up: Up) -> None:
    victim, *others = up.gateways()
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    # Gone once fleet up has reaped it: only then have all its threads exited and its sockets closed (its
    # main thread turns zombie before the others finish).
    while Path(f"/proc/{victim}").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Its socket is gone with it: every new connection lands on a process that is there.
    _answered_on_fresh_connections(up.http_port, 20)
    deadline = time.monotonic() + 60
    while len(now := up.gateways()) < GATEWAYS or victim in now:
        assert time.monotonic() < deadline, up.tail()
        time.sleep(0.2)
    assert set(others) <= set(now)
    assert "exited with -9; restarting it" in up.log.read_text()
    # The new process listens only once it has started (its readiness read first): none of these fails.
    _answered_on_fresh_connections(up.http_port, 20)


def test_fleet_gateway_processes_serve_one_set_of_ports_supervised(up: Up, tmp_path: Path) -> None:
    """`fleet gateway --processes 2` (what compose's gateway container runs with FLEET_GATEWAYS=2), on the
    Redis and worker of `up`: two children on its ports, both answering, one killed is restarted, and
    SIGTERM stops them all and removes their shared-memory directory."""
    # The Redis and repository `up` gave its gateways.
    sibling = up.gateways()[0]
    environ = Path(f"/proc/{sibling}/environ").read_bytes().split(b"\0")
    redis_url = next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"FLEET_REDIS_URL="))
    argv = Path(f"/proc/{sibling}/cmdline").read_bytes().split(b"\0")
    repo = argv[argv.index(b"--model-repository") + 1].decode()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_GATEWAYS")}
    env["FLEET_REDIS_URL"] = redis_url
    ports = free_port(), free_port(), free_port()
    shm_parent = tmp_path / "shm"
    shm_parent.mkdir()
    cmd = [sys.executable, "-m", "fleet", "gateway", "--processes", str(GATEWAYS), "--model-repository",
           repo, "--http-port", str(ports[0]), "--metrics-port", str(ports[1]),
           "--grpc-port", str(ports[2]), "--shared-memory-dir", str(shm_parent),
           "--trace-file", str(tmp_path / "trace.json")]
    log = tmp_path / "gateways.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    group = Up(proc, log, *ports)
    try:
        _until_all_serve(group)
        [own] = shm_parent.iterdir()  # the group's own directory, fresh at each start, given to each child
        for pid in group.gateways():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert argv[argv.index(b"--shared-memory-dir") + 1] == str(own).encode()
        conns = [http.client.HTTPConnection(HOST, group.http_port, timeout=30) for _ in range(24)]
        try:
            for i, conn in enumerate(conns):
                assert _infer(conn, float(i)) == (200, [2.0 * i])
            spread = _spread(group.gateways(), group.http_port, total=len(conns))
            assert all(n > 0 for n in spread.values()), spread
        finally:
            for conn in conns:
                conn.close()
        victim = group.gateways()[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while len(now := group.gateways()) < GATEWAYS or victim in now:
            assert time.monotonic() < deadline, group.tail()
            time.sleep(0.2)
        assert "exited with -9; restarting it" in log.read_text()
        _until_all_serve(group)
        children = group.gateways()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, group.tail()
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)
        assert list(shm_parent.iterdir()) == []
    finally:
        stop(proc, signal.SIGTERM)


@pytest.mark.parametrize("command", [["up", "--gateways", "2"], ["gateway", "--processes", "2"]])
def test_gateways_refuse_ports_another_process_listens_on(tmp_path: Path, command: list[str]) -> None:
    """SO_REUSEPORT would let the new gateways join any listener of this user's: they check first."""
    holder = socket.create_server((HOST, 0))
    port = holder.getsockname()[1]
    try:
        data = ["--data-dir", str(tmp_path / "data")] if command[0] == "up" else []
        cmd = [sys.executable, "-m", "fleet", *command, "--model-repository", str(MODELS), *data,
               "--http-port", str(port), "--metrics-port", str(free_port()), "--grpc-port", str(free_port())]
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    finally:
        holder.close()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"cannot take {HOST}:{port}" in proc.stdout + proc.stderr


def test_fleet_up_refuses_one_port_for_two_roles(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "fleet", "up", "--model-repository", str(MODELS), "--data-dir",
           str(tmp_path / "data"), "--http-port", str(port), "--metrics-port", str(port), "--grpc-port",
           str(free_port()), "--gateways", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 gateways need distinct HTTP, metrics and gRPC ports" in proc.stdout + proc.stderr
