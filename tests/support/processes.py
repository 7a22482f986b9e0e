"""Real fleet processes for fault-injection tests: one Redis (AOF), a gateway (and any extra gateways on
ports of their own) and N workers, each a `python -m fleet ...` child the test can signal by PID, like a
supervisor or an operator would. Each process may get environment variables of its own on top of the
cluster's (a fixed FLEET_GATEWAY_ID, a faked clock, a larger read-ahead)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from fleet.redis_server import LocalServer, free_port, start_server

ROOT = Path(__file__).resolve().parents[2]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except Exception:
        return 0


@dataclass
class Cluster:
    tmp: Path
    repository: Path
    env: dict[str, str]
    redis: LocalServer | None = None
    redis_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)  # the cluster's gateway's (extra gateways: a free one each)
    metrics_port: int = field(default_factory=free_port)  # the cluster's gateway's (extra gateways: a free one each)
    gateway: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    extra_gateways: list[subprocess.Popen[bytes]] = field(default_factory=list)
    job_workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _logs: list[Path] = field(default_factory=list)
    _log_of: dict[int, Path] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start_redis(self) -> None:
        self.redis = start_server(self.tmp / "redis", self.redis_port, appendonly=True)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}-{len(self._logs)}.log"
        self._logs.append(log)
        environ = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
        environ |= self.env | (env or {})
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fleet", *args, "--redis-url", self.redis_url,
                                     "--model-repository", str(self.repository), "--jobs-dir",
                                     str(self.tmp / "jobs")], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env=environ)
        self._log_of[proc.pid] = log
        return proc

    def start_gateway(self, env: dict[str, str] | None = None, http_port: int | None = None
                      ) -> subprocess.Popen[bytes]:
        """The cluster's gateway (on `http_port`), or with another `http_port` an extra one, stopped with
        the cluster; `env` is added to the cluster's environment for this process only."""
        port = http_port or self.http_port
        metrics_port = self.metrics_port if port == self.http_port else free_port()
        proc = self._spawn("gateway", ["gateway", "--http-port", str(port), "--metrics-port", str(metrics_port),
                                       "--grpc-port", str(self.grpc_port if port == self.http_port else free_port())],
                           env)
        if port == self.http_port:
            self.gateway = proc
        else:
            self.extra_gateways.append(proc)
        return proc

    def start_worker(self, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = self._spawn("worker", ["worker", "--device", "cpu"], env)
        self.workers.append(proc)
        return proc

    def start_jobs_worker(self, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A `fleet jobs-worker` (an RQ worker running bulk jobs) on the cluster's Redis and jobs dir."""
        proc = self._spawn("jobs-worker", ["jobs-worker"], env)
        self.job_workers.append(proc)
        return proc

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        """Everything one process has logged so far."""
        return self._log_of[proc.pid].read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60.0, base_url: str | None = None) -> None:
        """The gateway (at `base_url`, default the cluster's) is ready and every live worker has loaded
        every model (a test that freezes or kills workers must not catch one half-started)."""
        deadline = time.monotonic() + timeout_s
        while http_status(f"{base_url or self.base_url}/v2/health/ready") != 200 or not self._workers_loaded():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready within {timeout_s}s:\n{self.logs()}")
            time.sleep(0.1)

    def _workers_loaded(self) -> bool:
        """Each live worker process has a heartbeat advertising every model of the repository."""
        models = {p.name for p in self.repository.iterdir() if (p / "config.pbtxt").exists()}
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            prefix = self.env.get("FLEET_KEY_PREFIX", "fleet")
            served: dict[int, set[str]] = {}
            for key in client.scan_iter(f"{prefix}:worker:*"):
                beat = client.hgetall(key)
                if beat.get("pid"):
                    served[int(beat["pid"])] = {item[0] for item in json.loads(beat.get("models", "[]"))}
        except redis.RedisError:
            return False
        finally:
            client.close()
        live = [w.pid for w in self.workers if w.poll() is None]
        return all(served.get(pid, set()) >= models for pid in live)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self._logs if p.exists())

    def stop(self) -> None:
        procs = [p for p in [self.gateway, *self.extra_gateways, *self.workers, *self.job_workers] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.redis is not None:
            self.redis.stop()


@contextmanager
def explicit_cluster(tmp: Path, repository: Path, prefix: str, startup_model: str) -> Iterator[Cluster]:
    """Redis, a gateway and a worker in explicit model-control mode with the control API on, `startup_model`
    loaded and ready (the model-control and `fleet analyze` tests)."""
    env = {"FLEET_KEY_PREFIX": prefix, "FLEET_BLOCK_MS": "200", "FLEET_CONTROL_API": "true",
           "FLEET_MODEL_CONTROL_MODE": "explicit", "FLEET_LOAD_MODELS": json.dumps([startup_model]),
           "FLEET_HEARTBEAT_INTERVAL_S": "0.3", "FLEET_MODEL_LOAD_TIMEOUT_S": "60", "FLEET_UNLOAD_GRACE_S": "1",
           "FLEET_MODEL_LOAD_DIR": str(tmp / "loads")}
    c = Cluster(tmp, repository, env)
    c.start_redis()
    c.start_gateway()
    c.start_worker()
    try:
        deadline = time.monotonic() + 60
        while http_status(f"{c.base_url}/v2/models/{startup_model}/ready") != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{startup_model} not ready:\n{c.logs()}")
            time.sleep(0.1)
        yield c
    finally:
        c.stop()
