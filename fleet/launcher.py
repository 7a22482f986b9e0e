"""`fleet up`: one command that runs the whole system on one machine; and `fleet gateway --processes N`,
which runs and supervises N gateway processes the same way.

Starts an embedded Redis-compatible server (unless a Redis URL is given), one gateway (or --gateways N
sharing its ports), one worker per device and the bulk-job workers as child processes, prefixes their logs
with their names, and stops everything on Ctrl-C/SIGTERM: children first (they drain and reply to what
they hold), the server last.

Supervision, as compose's restart policy does it:
- A child that dies is restarted: a worker's pending messages are claimed by the others meanwhile, a
  job worker's job resumes from its progress record. A child that keeps dying (CRASH_LOOP_EXITS within
  CRASH_LOOP_WINDOW_S) stops everything instead, and the command exits 1: that needs a person (or an
  orchestrator's restart). Exits while Redis is unreachable,
  or within REDIS_GRACE_S of the embedded one coming back, are not counted: a missing Redis is not the
  child's fault, and the fleet heals once it is back.
- The embedded server is restarted too, on the same port and Unix socket with the same data directory,
  so it replays its AOF and what was queued before it died is answered after.
- Every child dies with this process, whatever kills it (the OOM killer's SIGKILL included): the kernel
  sends the Python children SIGKILL (what they held stays pending in Redis) and the server SIGTERM (it
  writes its AOF out and exits). Children are started from the main thread only, because the kernel
  ties that signal to the thread that forked them.
- The data directory is locked (fleet/lifetime.py): a second `fleet up` on it fails at once, naming this
  one's PID, instead of taking over its Redis socket and AOF. The server inherits the lock, so a new
  `fleet up` also waits for the old server to finish writing its AOF.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import redis

from fleet import grpc_flags
from fleet.lifetime import DataDirInUse, dies_with_this_process, lock_data_dir
from fleet.listen import equal_ports, gateway_ports, taken
from fleet.log_format import as_json_line
from fleet.logs import configure_logging
from fleet.redis_server import LocalServer, start_server
from fleet.settings import Settings

log = logging.getLogger("fleet.up")

RESTART_DELAY_S = 1.0
CRASH_LOOP_EXITS = 5
CRASH_LOOP_WINDOW_S = 60.0
# After the embedded server is back, children may still exit of the outage (a reconnect that gave up).
REDIS_GRACE_S = 30.0
# A server replaying a large AOF answers LOADING until done: wait that long before calling it failed.
REDIS_RESTART_TIMEOUT_S = 300.0
REDIS_RETRY_MAX_S = 10.0
# Python children: SIGKILL, nothing to lose (what they hold stays pending in Redis) and ports freed at once.
CHILD_DEATH_SIGNAL = signal.SIGKILL
SERVER_DEATH_SIGNAL = signal.SIGTERM
# How long `fleet gateway --processes N` waits for its gateways to stop: their graceful stop
# (gateway/server.py's GRACEFUL_STOP_S, 30 s) and a little more.
GATEWAY_STOP_S = 32.0


def count_devices() -> list[str]:
    """One entry per device a worker should own: each visible GPU, else the CPU."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10,
                                 preexec_fn=dies_with_this_process(signal.SIGKILL)).stdout
            gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
            if gpus:
                return [f"cuda:{i}" for i in range(len(gpus))]
        except (OSError, subprocess.SubprocessError):
            pass
    return ["cpu"]


def _pump(name: str, pid: int, json_lines: bool, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    with stream:  # closed at the child's end: a restarted child gets a pipe of its own
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            # JSON lines name their process themselves (role, pid); text ones get the name in front.
            text = as_json_line(line, name, pid, time.time()) if json_lines else f"{name:<9}| {line}"
            with lock:
                out.write(text + "\n")
                out.flush()


def _generate_models(repo: Path, json_lines: bool) -> None:
    """The repository's generated models (workers/generate_models.py); its lines made JSON in JSON mode."""
    piped = subprocess.PIPE if json_lines else None
    proc = subprocess.Popen([sys.executable, "-m", "workers.generate_models", str(repo)], stdout=piped,
                            stderr=subprocess.STDOUT if json_lines else None,
                            preexec_fn=dies_with_this_process(CHILD_DEATH_SIGNAL))
    out, _ = proc.communicate()
    for line in (out or b"").decode(errors="replace").splitlines():
        sys.stderr.write(as_json_line(line, "generate", proc.pid, time.time()) + "\n")


def _common_args(settings: Settings) -> list[str]:
    args = ["--key-prefix", settings.key_prefix,
            "--log-verbose", str(settings.log_verbose), "--log-format", settings.log_format,
            "--jobs-dir", str(settings.jobs_dir)]
    for repo in settings.model_repositories:
        args += ["--model-repository", str(repo)]
    args += ["--model-control-mode", settings.model_control_mode,
             "--repository-poll-secs", str(settings.repository_poll_secs)]
    for name in settings.load_models:
        args += ["--load-model", name]
    if not settings.auto_complete_config:
        args.append("--disable-auto-complete-config")
    args += ["--rate-limit", settings.rate_limit]
    for resource in settings.rate_limit_resources:
        args += ["--rate-limit-resource", resource]
    if settings.cache_config:
        args += ["--cache-config", settings.cache_config]
    return args


def _gateway_commands(settings: Settings, shm_dir: Path) -> dict[str, list[str]]:
    """One gateway, or `settings.gateways` of them on the same ports. Each is told `--processes 1`, so that
    FLEET_GATEWAYS in the environment it inherits does not make it a group of its own."""
    gateway = [sys.executable, "-m", "fleet", "gateway", *_common_args(settings), "--http-port",
               str(settings.http_port), "--metrics-port", str(settings.metrics_port), "--http-address",
               settings.http_host, *grpc_flags.argv(settings), "--processes", "1"]
    if settings.gateways == 1:
        return {"gateway": gateway}
    commands: dict[str, list[str]] = {}
    for i in range(settings.gateways):
        # The same ports (SO_REUSEPORT); a trace file each, as two processes cannot append to one; an
        # id each (a reply stream each) if one was set.
        stem, suffix = settings.trace_file.stem, settings.trace_file.suffix
        trace = settings.trace_file.with_name(f"{stem}-gateway-{i}{suffix}")
        own_id = ["--gateway-id", f"{settings.gateway_id}-{i}"] if settings.gateway_id else []
        commands[f"gateway-{i}"] = [*gateway, "--reuse-port", "--trace-file", str(trace),
                                    "--shared-memory-dir", str(shm_dir), *own_id]
    return commands


def _child_commands(settings: Settings, workers: int | None, shm_dir: Path) -> dict[str, list[str]]:
    devices = count_devices()
    if workers is not None:
        devices = [devices[i % len(devices)] for i in range(max(1, workers))]
    common = _common_args(settings)
    commands = _gateway_commands(settings, shm_dir)
    for i, device in enumerate(devices):
        commands[f"worker-{i}"] = [sys.executable, "-m", "fleet", "worker", *common, "--device", device]
    for i in range(settings.job_workers):
        commands[f"jobs-{i}"] = [sys.executable, "-m", "fleet", "jobs-worker", *common]
    return commands


@dataclass
class _EmbeddedRedis:
    """The embedded server under supervision: restarted when it dies, with a growing delay while it
    fails to start (its port taken meanwhile, say)."""

    server: LocalServer
    down_since: float | None = None
    back_at: float = float("-inf")
    next_try: float = 0.0
    failures: int = 0

    def tend(self, stopping: threading.Event) -> None:
        if self.server.process.poll() is None:
            return
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            log.warning("embedded Redis (pid %d) exited with %s; restarting it on the same port "
                        "and socket, replaying its AOF", self.server.process.pid, self.server.process.returncode)
        if now < self.next_try:
            return
        started = time.monotonic()
        try:
            self.server.restart(startup_timeout_s=REDIS_RESTART_TIMEOUT_S, abort=stopping)
        except RuntimeError as exc:
            self.failures += 1
            delay = min(REDIS_RETRY_MAX_S, RESTART_DELAY_S * 2 ** (self.failures - 1))
            self.next_try = time.monotonic() + delay
            log.error("embedded Redis did not restart (%s); trying again in %.0f s", exc, delay)
            return
        self.back_at = time.monotonic()
        log.warning("embedded Redis is back (pid %d, answering %.2f s after its start)",
                    self.server.process.pid, self.back_at - started)
        self.down_since, self.failures, self.next_try = None, 0, 0.0

    def excuses_exits(self) -> bool:
        """Whether a child exiting now may be the outage's doing: down, or back only a moment ago."""
        return self.down_since is not None or time.monotonic() - self.back_at < REDIS_GRACE_S


def _redis_reachable(url: str) -> bool:
    client = redis.Redis.from_url(url, protocol=2, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@dataclass
class _Children:
    commands: dict[str, list[str]]
    env: dict[str, str]
    json_lines: bool = False
    out_lock: threading.Lock = field(default_factory=threading.Lock)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    exits: dict[str, list[float]] = field(default_factory=dict)

    def start(self, name: str) -> None:
        """From the main thread only (the parent-death signal follows the forking thread)."""
        # Own session: a terminal's Ctrl-C reaches only this launcher, which stops children in order.
        proc = subprocess.Popen(self.commands[name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, env=self.env,
                                preexec_fn=dies_with_this_process(CHILD_DEATH_SIGNAL))
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(name, proc.pid, self.json_lines, proc.stdout, sys.stdout, self.out_lock),
                         daemon=True).start()
        self.procs[name] = proc

    def crash_looping(self, name: str, excused: bool) -> bool:
        """Records an exit of `name` (unless `excused`); True once it exited too often."""
        now = time.monotonic()
        recent = [t for t in self.exits.get(name, []) if now - t < CRASH_LOOP_WINDOW_S]
        self.exits[name] = recent if excused else [*recent, now]
        return len(self.exits[name]) >= CRASH_LOOP_EXITS

    def stop(self, timeout_s: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _supervise(children: _Children, embedded: _EmbeddedRedis | None, redis_url: str,
               stopping: threading.Event) -> bool:
    """Until `stopping`; True if it stopped everything itself, for a child that kept dying."""
    while not stopping.is_set():
        if embedded is not None:
            embedded.tend(stopping)
        for name, proc in list(children.procs.items()):
            if proc.poll() is None or stopping.is_set():
                continue
            excused = (embedded is not None and embedded.excuses_exits()) or not _redis_reachable(redis_url)
            if children.crash_looping(name, excused):
                log.error("%s exited %d times within %.0f s (last status %s); stopping everything",
                          name, CRASH_LOOP_EXITS, CRASH_LOOP_WINDOW_S, proc.returncode)
                stopping.set()
                return True
            if not stopping.wait(RESTART_DELAY_S):
                log.warning("%s exited with %s%s; restarting it", name, proc.returncode,
                            " (Redis unavailable: not counted as a crash)" if excused else "")
                children.start(name)
        stopping.wait(0.5)
    return False


def _shared_ports_problem(settings: Settings) -> str | None:
    """Why N gateways cannot share the configured ports: equal ports, or one with a listener already
    (they would join whoever holds it)."""
    if (numbers := equal_ports(settings)) is not None:
        return f"{settings.gateways} gateways need distinct HTTP, metrics and gRPC ports, not {numbers}"
    for host, port, every_address in gateway_ports(settings):
        if (why := taken(host, port, every_address=every_address)) is not None:
            return f"{why} (another server, or another fleet's gateways?)"
    return None


def _log_as(settings: Settings, role: str) -> None:
    if settings.log_format == "json":
        configure_logging(settings, role)
    else:
        logging.basicConfig(level=logging.INFO, format=f"{role:<9}| %(message)s")


def _stop_on_signals() -> threading.Event:
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stopping


def _child_env(redis_url: str) -> dict[str, str]:
    """This process's environment for its children, with the Redis URL in it: it may hold a password, so
    it goes in their environment, not on a visible command line."""
    return {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | {"FLEET_REDIS_URL": redis_url}


def _start_all(children: _Children, stopping: threading.Event) -> None:
    for name in children.commands:
        if not stopping.is_set():  # (a signal while the others started, or while models were generated)
            children.start(name)


def run_gateways(settings: Settings) -> int:
    """`fleet gateway --processes N`: N gateway processes on the same ports, supervised as `fleet up`
    supervises its children. One container's front end on N cores (compose.yaml's FLEET_GATEWAYS), where
    replicas of it could not publish the same host port."""
    _log_as(settings, "gateways")
    if (why := _shared_ports_problem(settings)) is not None:
        log.error("%s", why)
        return 1
    stopping = _stop_on_signals()
    # Their shared-memory registrations, forgotten at each start as tritonserver forgets its own: a fresh
    # directory (in --shared-memory-dir if one was given), removed when they stop.
    if settings.shared_memory_dir is not None:
        settings.shared_memory_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    shm_dir = Path(tempfile.mkdtemp(prefix="fleet-shm-regions-", dir=settings.shared_memory_dir))
    redis_url = settings.redis_url_or_default
    children = _Children(_gateway_commands(settings, shm_dir), _child_env(redis_url),
                         json_lines=settings.log_format == "json")
    try:
        _start_all(children, stopping)
        log.info("%d gateway processes share http://%s:%d (metrics :%d%s); SIGTERM stops them", settings.gateways,
                 settings.http_host, settings.http_port, settings.metrics_port,
                 f", gRPC {settings.grpc_host}:{settings.grpc_port}" if settings.allow_grpc else "")
        crashed = _supervise(children, None, redis_url, stopping)
    finally:
        # As long as each gateway gives the calls in flight (compose.yaml's stop_grace_period allows it).
        children.stop(timeout_s=GATEWAY_STOP_S)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return 1 if crashed else 0


def run_up(settings: Settings, *, workers: int | None, data_dir: Path) -> int:
    _log_as(settings, "up")
    try:
        data_lock = lock_data_dir(data_dir)
    except DataDirInUse as exc:
        log.error("%s", exc)
        return 1
    if settings.gateways > 1 and (why := _shared_ports_problem(settings)) is not None:
        log.error("%s", why)
        data_lock.release()
        return 1
    if settings.jobs_dir == Settings.model_fields["jobs_dir"].default:
        settings = settings.model_copy(update={"jobs_dir": data_dir / "jobs"})
    stopping = _stop_on_signals()
    embedded: _EmbeddedRedis | None = None
    redis_url = settings.redis_url
    if not redis_url:
        # Batch-scheduled: woken by a client, the server does not preempt a worker mid-batch; it waits for the
        # worker to yield the CPU, the next tick or an idle CPU (start_server).
        server = start_server(data_dir / "redis", appendonly=True, log_file=None, unix_socket=True,
                              parent_death_signal=SERVER_DEATH_SIGNAL, pass_fds=(data_lock.fd,),
                              batch_scheduled=True)
        embedded = _EmbeddedRedis(server)
        redis_url = server.local_url
        log.info("embedded Redis-compatible server on %s (data in %s)", redis_url, data_dir / "redis")
    for repo in settings.model_repositories:
        _generate_models(repo, json_lines=settings.log_format == "json")
    # Gateways sharing the ports share their shared-memory registrations, forgotten at each start as
    # tritonserver forgets its own.
    shm_dir = data_dir / "shm-regions"
    if settings.gateways > 1:
        shutil.rmtree(shm_dir, ignore_errors=True)
    children = _Children(_child_commands(settings, workers, shm_dir), _child_env(redis_url),
                         json_lines=settings.log_format == "json")
    try:
        _start_all(children, stopping)
        grpc = f", gRPC {settings.grpc_host}:{settings.grpc_port}" if settings.allow_grpc else ""
        shared = f"; {settings.gateways} gateway processes share these ports" if settings.gateways > 1 else ""
        log.info("serving %s on http://%s:%d (metrics :%d%s%s); Ctrl-C stops",
                 ", ".join(str(r) for r in settings.model_repositories), settings.http_host,
                 settings.http_port, settings.metrics_port, grpc, shared)
        crashed = _supervise(children, embedded, redis_url, stopping)
    finally:
        children.stop()
        if embedded is not None:
            embedded.server.stop()
        data_lock.release()
    return 1 if crashed else 0
