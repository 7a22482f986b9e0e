"""Start the whole system as `make up` does (`fleet up`: embedded Redis, gateway, worker) once per
test session (once in each pytest-xdist process that runs an e2e file), serving this project's
repository and Triton's example repository, and stop it by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.procs import children
from fleet.redis_server import free_port
from tests.support.model_repo import TRITON_EXAMPLES
from tests.support.processes import http_status

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningSystem:
    url: str  # host:port, as tritonclient takes it
    metrics_url: str
    process: subprocess.Popen[bytes]
    log: Path
    grpc_url: str = ""  # host:port of the gateway's gRPC service, as tritonclient.grpc takes it

    def children(self, role: str) -> list[int]:
        """PIDs of this system's child processes running `fleet <role>`."""
        return [pid for pid, argv in children(self.process.pid) if role.encode() in argv]


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    tmp = tmp_path_factory.mktemp("fleet-up")
    http_port, metrics_port, grpc_port = free_port(), free_port(), free_port()
    log = tmp / "fleet.log"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
    # A job whose runner was killed is resumed once its lease lapses: 2 s here instead of 10.
    env["FLEET_JOB_LEASE_MS"] = "2000"
    env["FLEET_JOB_PARSE_PROCESSES"] = "2"  # JSONL jobs through the line parsers, whatever the host's cores
    # Jobs may name server-side inputs under this session's pytest temp dirs (each test's tmp_path).
    env["FLEET_JOB_INPUT_DIRS"] = json.dumps([str(tmp_path_factory.getbasetemp())])
    cmd = [sys.executable, "-m", "fleet", "up", "--model-repository", str(ROOT / "model_repository"),
           "--model-repository", str(TRITON_EXAMPLES), "--http-port", str(http_port),
           "--metrics-port", str(metrics_port), "--grpc-port", str(grpc_port), "--data-dir", str(tmp / "data")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    running = RunningSystem(f"127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics", proc, log,
                            f"127.0.0.1:{grpc_port}")
    deadline = time.monotonic() + 180
    while http_status(f"http://127.0.0.1:{http_port}/v2/health/ready") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"fleet up did not become ready:\n{log.read_text()[-5000:]}")
        time.sleep(0.2)
    yield running
    proc.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"fleet up did not stop on Ctrl-C:\n{log.read_text()[-3000:]}")
