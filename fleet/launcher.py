"""`fleet up`: one command that runs the whole system on one machine.

Starts an embedded Redis-compatible server (unless a Redis URL is given), one gateway, one worker per
device and the bulk-job workers as child processes, prefixes their logs with their names, and stops
everything on Ctrl-C/SIGTERM: children first (they drain and reply to what they hold), the server last.
A child that dies is restarted, as compose's restart policy does: a worker's pending messages are
claimed by the others meanwhile, a job worker's job resumes from its progress record. A child that keeps
dying (CRASH_LOOP_EXITS within CRASH_LOOP_WINDOW_S) stops everything instead: that needs a person.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO

from fleet.redis_server import LocalServer, start_server
from fleet.settings import Settings

log = logging.getLogger("fleet.up")


def count_devices() -> list[str]:
    """One entry per device a worker should own: each visible GPU, else the CPU."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
            gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
            if gpus:
                return [f"cuda:{i}" for i in range(len(gpus))]
        except (OSError, subprocess.SubprocessError):
            pass
    return ["cpu"]


def _pump(name: str, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{name:<9}| {line}\n")
            out.flush()


RESTART_DELAY_S = 1.0
CRASH_LOOP_EXITS = 5
CRASH_LOOP_WINDOW_S = 60.0


def _common_args(settings: Settings) -> list[str]:
    args = ["--key-prefix", settings.key_prefix,
            "--log-verbose", str(settings.log_verbose), "--jobs-dir", str(settings.jobs_dir)]
    for repo in settings.model_repositories:
        args += ["--model-repository", str(repo)]
    return args


def run_up(settings: Settings, *, workers: int | None, data_dir: Path) -> int:
    if settings.jobs_dir == Settings.model_fields["jobs_dir"].default:
        settings = settings.model_copy(update={"jobs_dir": data_dir / "jobs"})
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lock = threading.Lock()
    server: LocalServer | None = None
    redis_url = settings.redis_url
    if not redis_url:
        server = start_server(data_dir / "redis", appendonly=True, log_file=None, unix_socket=True)
        redis_url = server.local_url
        log.info("up       | embedded Redis-compatible server on %s (data in %s)", redis_url, data_dir / "redis")

    for repo in settings.model_repositories:
        subprocess.run([sys.executable, "-m", "workers.generate_models", str(repo)], check=False)

    devices = count_devices()
    if workers is not None:
        devices = [devices[i % len(devices)] for i in range(max(1, workers))]
    common = _common_args(settings)
    # The URL may hold a password: children get it in their environment, not on a visible command line.
    child_env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | {"FLEET_REDIS_URL": redis_url}
    specs: list[tuple[str, list[str]]] = [(
        "gateway",
        [sys.executable, "-m", "fleet", "gateway", *common, "--http-port", str(settings.http_port),
         "--metrics-port", str(settings.metrics_port), "--http-address", settings.http_host],
    )]
    for i, device in enumerate(devices):
        specs.append((f"worker-{i}", [sys.executable, "-m", "fleet", "worker", *common, "--device", device]))
    for i in range(settings.job_workers):
        specs.append((f"jobs-{i}", [sys.executable, "-m", "fleet", "jobs-worker", *common]))
    commands = dict(specs)

    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    stopping = threading.Event()
    exits: dict[str, list[float]] = {}

    def start(name: str) -> subprocess.Popen[bytes]:
        # Own session: a terminal's Ctrl-C reaches only this launcher, which stops children in order.
        proc = subprocess.Popen(commands[name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, env=child_env)
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(name, proc.stdout, sys.stdout, lock), daemon=True).start()
        return proc

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for name, _ in specs:
            children.append((name, start(name)))
        log.info("up       | serving %s on http://%s:%d (metrics :%d); Ctrl-C stops",
                 ", ".join(str(r) for r in settings.model_repositories), settings.http_host,
                 settings.http_port, settings.metrics_port)
        while not stopping.is_set():
            for i, (name, proc) in enumerate(children):
                if proc.poll() is None:
                    continue
                now = time.monotonic()
                recent = [t for t in exits.get(name, []) if now - t < CRASH_LOOP_WINDOW_S] + [now]
                exits[name] = recent
                if len(recent) >= CRASH_LOOP_EXITS:
                    log.error("up       | %s exited %d times within %.0f s (last status %s); stopping everything",
                              name, len(recent), CRASH_LOOP_WINDOW_S, proc.returncode)
                    stopping.set()
                    break
                if not stopping.wait(RESTART_DELAY_S):
                    log.warning("up       | %s exited with %s; restarting it", name, proc.returncode)
                    children[i] = (name, start(name))
            stopping.wait(0.5)
    finally:
        _stop_children(children)
        if server is not None:
            server.stop()
    return 0


def _stop_children(children: list[tuple[str, subprocess.Popen[bytes]]], timeout_s: float = 15.0) -> None:
    for _, proc in children:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for _, proc in children:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
