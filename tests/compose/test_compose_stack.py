"""`docker compose up` for real: compose.yaml with tests/compose/compose.test.yaml, built and run on a
Docker daemon this test starts (tests/compose/stack.py), with profile `cpu` and two worker replicas.

In order: the gateway container runs two gateway processes; tritonclient infers through the published
HTTP port; a bulk job runs through the jobs service;
a worker container killed with requests in hand has them answered by the other replica; Redis restarted
with requests queued answers them after it (AOF on its volume); Prometheus scrapes the gateway and
Redis's exporter and has fleet's series and Redis's; `down` leaves no container, network or volume. Run
by `make compose-test` (and .ci/run), not by `make test`: tests/compose/conftest.py collects it only
with FLEET_COMPOSE_TEST=1.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from fleet.keys import GROUP, Keys
from fleet.redis_server import free_port
from tests.compose import stack
from tests.support.mlp_direct import mlp_direct
from tests.unit.test_grafana_dashboard import dashboard

pytestmark = pytest.mark.timeout(2400)

PROJECT = "fleetci"
WORKERS = 2
SLOW = "slow"
# 200 ms per batch of up to 8, no CPU: 200 requests keep two workers busy ~2.5 s, long enough to see
# one hold requests and kill it.
SLOW_CONFIG = """backend: "sleep"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2 ] } ]
dynamic_batching { max_queue_delay_microseconds: 1000 }
parameters { key: "execute_delay_us" value { string_value: "200000" } }
"""
SERVICES = ["redis", "redis-exporter", "gateway", "worker-cpu", "jobs", "prometheus"]


@dataclass
class Stack:
    env: dict[str, str]
    http_port: int
    prometheus_port: int
    models: Path
    timings: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        return stack.run(["docker-compose", "-p", PROJECT, "-f", str(stack.ROOT / "compose.yaml"),
                          "-f", str(stack.ROOT / "tests" / "compose" / "compose.test.yaml"), *args],
                         env=self.env, timeout=timeout, check=check)

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return stack.run(["docker", *args], env=self.env, timeout=300, check=check)

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def redis_cli(self, *args: str) -> str:
        # `docker exec`, not `docker-compose exec`: compose v1 takes ~1 s to start, too slow to watch a queue.
        return self.docker("exec", self.redis_id, "redis-cli", *args).stdout

    @functools.cached_property
    def redis_id(self) -> str:
        return self.containers("redis")[0]  # `restart` keeps the container

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"


def host_port(usual: int) -> str:
    """The port compose.yaml publishes by default where it is free on loopback, else any free one."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", usual))
        except OSError:
            return str(free_port())
    return str(usual)


def write_models(dest: Path) -> None:
    """mlp (TorchScript, from `make models`) and a sleep model; readable by the image's user."""
    mlp = stack.ROOT / "model_repository" / "mlp"
    if not (mlp / "1" / "model.pt").exists():
        pytest.fail("model_repository/mlp/1/model.pt is missing: run `make models` first")
    shutil.copytree(mlp, dest / "mlp")
    (dest / SLOW / "1").mkdir(parents=True)
    (dest / SLOW / "config.pbtxt").write_text(SLOW_CONFIG)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def wait_healthy(s: Stack, deadline_s: float) -> None:
    """Every fleet container healthy (the image's `python -m fleet.healthcheck`), Redis too, Prometheus answering."""
    deadline = time.monotonic() + deadline_s
    while True:
        ids = s.compose("ps", "-q").stdout.split()
        states = {}
        for cid in ids:
            info = json.loads(s.docker("inspect", cid).stdout)[0]
            health = info["State"].get("Health", {}).get("Status", "none")
            states[info["Name"].lstrip("/")] = health if info["State"]["Running"] else info["State"]["Status"]
        fleet_ok = states and all(v in ("healthy", "none") for v in states.values())
        if fleet_ok and len(ids) == len(SERVICES) - 1 + WORKERS and prometheus_ready(s):
            return
        if time.monotonic() > deadline:
            logs = s.compose("logs", "--tail", "40", check=False).stdout
            pytest.fail(f"the stack did not become healthy: {states}\n{logs[-6000:]}")
        time.sleep(2)


def prometheus_ready(s: Stack) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{s.prometheus_port}/-/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def up(request: pytest.FixtureRequest) -> Iterator[Stack]:
    with ExitStack() as cleanup:
        try:
            stack.ensure_packages()
            work = Path(tempfile.mkdtemp(prefix="fleet-compose-"))
            cleanup.callback(shutil.rmtree, work, True)
            daemon = cleanup.enter_context(stack.docker_daemon(work))
            env = {**os.environ, "DOCKER_HOST": daemon.host}
            started = time.monotonic()
            stack.ensure_base_image(env)
        except stack.Unavailable as exc:
            pytest.skip(f"Docker cannot run here: {exc}")
        base_s = time.monotonic() - started
        index = cleanup.enter_context(stack.wheel_index(stack.wheelhouse(), work))
        models = work / "models"
        write_models(models)
        s = Stack(env={**env, "INDEX_URL": index, "TORCH_CPU_INDEX_URL": index, "COMPOSE_PROFILES": "cpu",
                       "FLEET_PUBLISH_ADDRESS": "127.0.0.1", "FLEET_HTTP_PORT": host_port(8000),
                       "FLEET_GRPC_PORT": host_port(8001), "FLEET_METRICS_PORT": host_port(8002),
                       "FLEET_PROMETHEUS_PORT": host_port(9090), "FLEET_TEST_MODELS": str(models)},
                  http_port=0, prometheus_port=0, models=models)
        s.http_port, s.prometheus_port = int(s.env["FLEET_HTTP_PORT"]), int(s.env["FLEET_PROMETHEUS_PORT"])
        s.timings["base image"] = base_s
        s.compose("down", "-v", "--remove-orphans", check=False)  # a run killed half-way left its containers
        cleanup.callback(lambda: s.compose("down", "-v", "--remove-orphans", "-t", "5", check=False))
        cleanup.callback(lambda: s.docker("image", "prune", "-f", check=False))  # old layers out of the cache
        t = time.monotonic()
        stack.log("building the images")
        s.compose("build", "gateway", "redis", "redis-exporter", "prometheus", timeout=1800)
        s.timings["build"] = time.monotonic() - t
        t = time.monotonic()
        s.compose("up", "-d", "--scale", f"worker-cpu={WORKERS}", *SERVICES)
        wait_healthy(s, 240)
        s.timings["up until healthy"] = time.monotonic() - t
        size = s.docker("image", "inspect", "-f", "{{.Size}}", "fleet:cpu").stdout.strip()
        timings = ", ".join(f"{k} {v:.0f} s" for k, v in s.timings.items())
        stack.log(f"fleet:cpu is {int(size) / 1e6:.0f} MB; {timings}")
        yield s
        if request.session.testsfailed:  # what the services said, before `down` removes them
            print(s.compose("logs", "--no-color", "--tail", "60", check=False).stdout[-20000:], file=sys.stderr)


def test_the_image_is_multi_stage_non_root_and_healthchecked(up: Stack) -> None:
    info = json.loads(up.docker("image", "inspect", "fleet:cpu").stdout)[0]
    assert info["Config"]["User"] == "fleet"
    assert info["Config"]["Healthcheck"]["Test"] == ["CMD", "python", "-m", "fleet.healthcheck"]
    assert info["Config"]["Entrypoint"] == ["fleet"]
    cid = up.containers("gateway")[0]
    # The build stage's source tree and pip are not in the runtime image.
    probe = up.docker("exec", cid, "sh", "-c", "test ! -e /src && id -un && python -m fleet.healthcheck", check=False)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.splitlines() == ["fleet", "gateway: healthy"]


def test_the_gateway_container_runs_two_gateway_processes(up: Stack) -> None:
    """compose.test.yaml sets FLEET_GATEWAYS=2: PID 1 (`fleet gateway`) supervises two gateway processes
    on the container's ports, and every test here reaches them through the published ports."""
    cid = up.containers("gateway")[0]
    top = up.docker("top", cid, "-o", "pid,ppid,args").stdout.splitlines()[1:]  # (args cut at ps's width)
    rows = [line.split(None, 2) for line in top]
    gateways = {pid: ppid for pid, ppid, args in rows if "fleet gateway" in args}
    [supervisor] = [pid for pid, ppid in gateways.items() if ppid not in gateways]
    assert len(gateways) == 3 and [ppid for ppid in gateways.values() if ppid == supervisor] == [supervisor] * 2, top
    # Both listen on the HTTP port: two LISTEN sockets on 0.0.0.0:8000 (1F40) in the container's netns.
    tcp = up.docker("exec", cid, "cat", "/proc/net/tcp").stdout.splitlines()[1:]
    listening = [line for line in tcp if line.split()[1] == "00000000:1F40" and line.split()[3] == "0A"]
    assert len(listening) == 2, tcp


def test_tritonclient_infers_through_the_published_port(up: Stack) -> None:
    client = httpclient.InferenceServerClient(url=up.url)
    assert client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready(SLOW)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer("mlp", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), mlp_direct(x), rtol=1e-5, atol=1e-5)


def test_a_bulk_job_runs_through_the_jobs_service(up: Stack, tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((500, 256)).astype(np.float32)
    source, out = tmp_path / "rows.npy", tmp_path / "out.npy"
    np.save(source, x)
    done = subprocess.run([sys.executable, "-m", "fleet", "submit", str(source), "--model", "mlp", "-o", str(out),
                           "--format", "npy", "--url", f"http://{up.url}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed" in done.stdout
    np.testing.assert_allclose(np.load(out), mlp_direct(x), rtol=1e-5, atol=1e-5)


async def infer_slow(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, list[float]]:
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [i, -i]}]}
    r = await client.post(f"http://{url}/v2/models/{SLOW}/infer", json=body)
    return r.status_code, (r.json()["outputs"][0]["data"] if r.status_code == 200 else [])


async def until(check: Callable[[], bool], timeout_s: float, what: str,
                detail: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}. {detail()}")
        await asyncio.sleep(0.1)


def consumers_holding(s: Stack) -> dict[str, int]:
    """Messages each consumer of the slow model's group holds (read, not acknowledged), by consumer name
    (`<hostname>-<pid>-<id>`: a container's hostname is its short id). redis-cli without a terminal prints
    one element per line, fields and values alternating (Debian's 7.0 has no --json)."""
    lines = s.redis_cli("XINFO", "CONSUMERS", Keys().queue(SLOW, version=1), GROUP).split("\n")
    held, name = {}, ""
    for key, value in zip(lines, lines[1:], strict=False):
        if key == "name":
            name = value
        elif key == "pending" and name:
            held[name] = int(value)
    return held


def test_a_killed_worker_container_s_requests_are_answered_by_the_other_replica(up: Stack) -> None:
    workers = up.containers("worker-cpu")
    assert len(workers) == WORKERS
    victim, others = workers[0], workers[1:]
    n = 200

    async def main() -> tuple[list[tuple[int, list[float]]], int, float]:
        # Both frozen while every request queues in the stream; then the victim alone runs, so it is sure
        # to hold requests when it is killed (with both running, a slow CI host once polled 20 s without
        # catching the victim holding any). The other replica wakes only after the kill: whatever it
        # answers, it answers by claiming the victim's messages or reading what the victim left queued.
        up.docker("pause", *workers)
        paused = list(workers)
        try:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
                tasks = [asyncio.ensure_future(infer_slow(client, up.url, i)) for i in range(n)]
                stream = Keys().queue(SLOW, version=1)
                await until(lambda: int(up.redis_cli("XLEN", stream).strip() or 0) >= n, 60, f"{n} queued requests")
                up.docker("unpause", victim)
                paused.remove(victim)
                holds: dict[str, int] = {}

                def victim_holds() -> bool:
                    holds.clear()
                    holds.update(consumers_holding(up))
                    return sum(v for k, v in holds.items() if k.startswith(victim[:12])) > 0

                await until(victim_holds, 30, "the victim container to hold requests",
                            lambda: f"holding: {holds}; victim {victim[:12]}\n{worker_logs(up)}")
                held = sum(v for k, v in holds.items() if k.startswith(victim[:12]))
                up.docker("kill", victim)
                killed_at = time.monotonic()
                up.docker("unpause", *others)
                paused.clear()
                results = await asyncio.gather(*tasks)
                return results, held, time.monotonic() - killed_at
        finally:
            if paused:  # a failure above must not leave the later tests a frozen fleet
                up.docker("unpause", *paused, check=False)

    results, held, recovery_s = asyncio.run(main())
    assert [status for status, _ in results] == [200] * n, worker_logs(up)
    assert [data for _, data in results] == [[float(i), float(-i)] for i in range(n)]
    state = json.loads(up.docker("inspect", victim).stdout)[0]["State"]
    assert not state["Running"]  # answered by the other replica, not by the victim coming back
    stack.log(f"worker container killed holding {held} requests: all {n} answered {recovery_s:.1f} s after")
    up.compose("up", "-d", "--no-recreate", "--scale", f"worker-cpu={WORKERS}", *SERVICES)
    wait_healthy(up, 120)


def worker_logs(s: Stack) -> str:
    """The worker containers' last lines, for a failure's message (the module's teardown prints the
    services' logs only after `down` has removed them)."""
    return s.compose("logs", "--no-color", "--tail", "40", "worker-cpu", check=False).stdout[-8000:]


def test_restart_redis_keeps_the_queued_requests(up: Stack) -> None:
    workers = up.containers("worker-cpu")
    n = 100

    async def main() -> tuple[list[tuple[int, list[float]]], float]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
            up.docker("pause", *workers)
            try:
                tasks = [asyncio.ensure_future(infer_slow(client, up.url, i)) for i in range(n)]
                stream = Keys().queue(SLOW, version=1)
                await until(lambda: up.redis_cli("XLEN", stream).strip() == str(n), 30, f"{n} queued requests")
                t = time.monotonic()
                up.compose("restart", "redis")  # SIGTERM: Redis writes its AOF out; then it starts from it
                down_s = time.monotonic() - t
                assert up.redis_cli("XLEN", stream).strip() == str(n)
            finally:
                up.docker("unpause", *workers)
            return await asyncio.gather(*tasks), down_s

    results, down_s = asyncio.run(main())
    assert [status for status, _ in results] == [200] * n
    assert [data for _, data in results] == [[float(i), float(-i)] for i in range(n)]
    stack.log(f"redis restarted in {down_s:.1f} s with {n} requests queued: all answered after it")


def test_prometheus_scrapes_the_fleet(up: Stack) -> None:
    base = f"http://127.0.0.1:{up.prometheus_port}/api/v1"
    deadline = time.monotonic() + 60
    while True:
        query = urllib.parse.quote('nv_inference_request_success{model="mlp"}')
        with urllib.request.urlopen(f"{base}/query?query={query}", timeout=5) as r:
            result = json.loads(r.read())["data"]["result"]
        if result and float(result[0]["value"][1]) >= 2:  # the tritonclient infer and the job's batches
            break
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus has no nv_inference_request_success for mlp: {result}")
        time.sleep(2)
    with urllib.request.urlopen(f"{base}/targets", timeout=5) as r:
        targets = json.loads(r.read())["data"]["activeTargets"]
    assert {t["labels"]["job"]: t["health"] for t in targets} == {"fleet": "up", "redis": "up", "prometheus": "up"}
    # The test before this one restarts Redis: the exporter's last scrape may have found it down. A scrape
    # after it is back says up.
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(f"{base}/query?query=redis_up", timeout=5) as r:
            redis_up = json.loads(r.read())["data"]["result"]
        if (redis_up and float(redis_up[0]["value"][1]) == 1) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert redis_up and float(redis_up[0]["value"][1]) == 1
    with urllib.request.urlopen(f"{base}/query?query=fleet_workers", timeout=5) as r:
        workers = json.loads(r.read())["data"]["result"]
    assert workers and float(workers[0]["value"][1]) == WORKERS
    # Every query of the Grafana dashboard is one this Prometheus evaluates ($model: every model).
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$model", ".*")
            with urllib.request.urlopen(f"{base}/query?query={urllib.parse.quote(expr)}", timeout=5) as r:
                assert json.loads(r.read())["status"] == "success", (panel["title"], expr)


def test_down_removes_every_container_network_and_volume(up: Stack) -> None:
    up.compose("down", "-v", "-t", "20")
    label = f"label=com.docker.compose.project={PROJECT}"
    assert up.docker("ps", "-aq", "--filter", label).stdout.split() == []
    assert up.docker("network", "ls", "-q", "--filter", label).stdout.split() == []
    assert up.docker("volume", "ls", "-q", "--filter", label).stdout.split() == []
    stack.log("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in up.timings.items()))
