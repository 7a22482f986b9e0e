"""The image's HEALTHCHECK (fleet/healthcheck.py): the role read from a container's command line, and
each role's check against a real Redis and a real HTTP listener."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.healthcheck import check, check_worker, pid1_argv, role_of
from fleet.keys import Keys
from fleet.redis_server import LocalServer, free_port
from fleet.settings import Settings


@pytest.mark.parametrize(("argv", "role", "flags"), [
    (["/venv/bin/python", "/venv/bin/fleet", "gateway", "--http-port", "8000", "--jobs-dir", "/jobs"],
     "gateway", {"http-port": "8000", "jobs-dir": "/jobs"}),
    (["fleet", "worker", "--device=cuda:0", "--key-prefix", "p"], "worker", {"device": "cuda:0", "key-prefix": "p"}),
    (["python", "-m", "fleet", "jobs-worker"], "jobs-worker", {}),
    ([], "", {}),
])
def test_the_role_is_read_from_the_command_line(argv: list[str], role: str, flags: dict[str, str]) -> None:
    assert role_of(argv) == (role, flags)


def test_pid1_argv_reads_a_nul_separated_command_line(tmp_path: Path) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"fleet\0worker\0--device\0cpu\0")
    assert pid1_argv(cmdline) == ["fleet", "worker", "--device", "cpu"]
    assert pid1_argv(tmp_path / "missing") == []


def test_a_worker_is_healthy_while_its_heartbeat_names_this_host(redis_server: LocalServer, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(key_prefix)
    assert check_worker(client, keys, "box-1") == "no fresh heartbeat from a worker on host box-1"
    client.hset(keys.worker("w1"), mapping={"host": "box-2"})
    client.zadd(keys.workers(), {"w1": 1})
    assert check_worker(client, keys, "box-1") is not None  # another host's worker
    client.hset(keys.worker("w2"), mapping={"host": "box-1"})
    client.zadd(keys.workers(), {"w2": 1})
    assert check_worker(client, keys, "box-1") is None
    client.delete(keys.worker("w2"))  # the heartbeat expired: the worker stopped beating
    assert check_worker(client, keys, "box-1") is not None


def test_a_job_worker_is_healthy_while_redis_answers(redis_server: LocalServer) -> None:
    assert check("jobs-worker", {}, Settings(redis_url=redis_server.url)) is None
    problem = check("jobs-worker", {}, Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    assert problem is not None and problem.startswith("Redis:")


@pytest.fixture
def live_server() -> Iterator[int]:
    class Live(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_response(200 if self.path == "/v2/health/live" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Live)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_gateway_is_healthy_while_its_liveness_endpoint_answers(live_server: int) -> None:
    assert check("gateway", {"http-port": str(live_server)}, Settings()) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert "Connection refused" in str(check("gateway", {"http-port": str(closed)}, Settings()))


def test_the_command_exits_0_or_1_and_says_why(live_server: int) -> None:
    ok = subprocess.run([sys.executable, "-m", "fleet.healthcheck", "--role", "gateway", "--http-port",
                         str(live_server)], capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout) == (0, "gateway: healthy\n")
    bad = subprocess.run([sys.executable, "-m", "fleet.healthcheck", "--role", "gateway", "--http-port",
                          str(free_port())], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "Connection refused" in bad.stdout
