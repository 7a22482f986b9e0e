"""What the compose test needs on the machine, made and started here, and stopped by PID.

- Docker: Debian's docker.io and docker-compose (v1.29; the v2 plugin is not installable here) and
  debootstrap, installed with apt if missing. A Docker daemon of the test's own, on its own socket, data
  root and exec root, that leaves the machine's firewall and NAT rules alone (--iptables=false
  --ip-masq=false): containers reach each other on compose's network and the host reaches the ports
  they publish on 127.0.0.1, which is all the test needs.
- A base image: no registry is reachable here, so `python:3.11-slim` and friends cannot be pulled. It is
  made from Debian's packages with debootstrap and imported (~2 min, once: the rootfs tarball is cached).
- The packages fleet's image installs, downloaded by the host's pip and served on loopback
  (tests/compose/wheel_index.py), cached between runs.
The cache lives in $FLEET_COMPOSE_CACHE (default ~/.cache/fleet-compose), outside the checkout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fleet.redis_server import free_port
from tests.compose.wheel_index import download, write_index

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("FLEET_COMPOSE_CACHE", Path.home() / ".cache" / "fleet-compose"))
BASE_IMAGE = "fleet-test-base:bookworm"
PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
TORCH_SPEC = "torch==2.13.0+cpu"  # the Dockerfile's CPU torch; pip on this machine finds it on disk


class Unavailable(Exception):
    """Docker cannot run on this machine at all: the test skips, saying why."""


def log(message: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600, check: bool = True,
        quiet: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, timeout=timeout, text=True, capture_output=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    if not quiet and proc.returncode != 0:
        log(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-500:]}")
    return proc


def ensure_packages() -> None:
    missing = [pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} missing, and apt-get cannot install them here (not root or no apt)")
    log(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = run(["apt-get", "install", "-y", "-q", *missing], env=env, check=False)
    if proc.returncode != 0:
        run(["apt-get", "update", "-q"], env=env, check=False)
        if run(["apt-get", "install", "-y", "-q", *missing], env=env, check=False).returncode != 0:
            raise Unavailable(f"apt-get could not install {' '.join(missing)}")


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    socket: Path
    log: Path

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"


@contextmanager
def docker_daemon(work: Path) -> Iterator[Daemon]:
    """dockerd on its own socket; its data root is in the cache, so images outlive the run."""
    work.mkdir(parents=True, exist_ok=True)
    sock, logfile = work / "docker.sock", work / "dockerd.log"
    cmd = ["dockerd", "--iptables=false", "--ip-masq=false", "--host", f"unix://{sock}",
           "--data-root", str(CACHE / "docker"), "--exec-root", str(work / "exec"),
           "--pidfile", str(work / "dockerd.pid")]
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    daemon = Daemon(proc, sock, logfile)
    env = {**os.environ, "DOCKER_HOST": daemon.host}
    deadline = time.monotonic() + 60
    while run(["docker", "version"], env=env, check=False, quiet=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, 10)
            raise Unavailable(f"dockerd did not start: {logfile.read_text(errors='replace')[-1500:]}")
        time.sleep(0.5)
    # Can it run a container at all (cgroups, overlay, namespaces)? Checked on the base image below.
    try:
        yield daemon
    finally:
        stop(proc, 60)


def stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # dockerd stops its containerd and containers' shims itself
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ensure_base_image(env: dict[str, str]) -> None:
    if run(["docker", "image", "inspect", BASE_IMAGE], env=env, check=False, quiet=True).returncode == 0:
        return
    tarball = CACHE / "bookworm-minbase.tar"
    if not tarball.exists():
        rootfs = CACHE / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        log("making the base image with debootstrap (~2 min)")
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python3-pip,ca-certificates",
             "bookworm", str(rootfs)], timeout=1200)
        run(["tar", "-C", str(rootfs), "-cf", str(tarball) + ".part", "."], timeout=600)
        os.replace(str(tarball) + ".part", tarball)
        shutil.rmtree(rootfs, ignore_errors=True)
    run(["docker", "import", str(tarball), BASE_IMAGE], env=env, timeout=600)
    probe = run(["docker", "run", "--rm", BASE_IMAGE, "python3", "-c", "print('ok')"], env=env, check=False)
    if probe.returncode != 0:
        raise Unavailable(f"Docker cannot run a container here: {probe.stderr[-800:]}")


def wheelhouse() -> Path:
    """The packages for fleet's image, downloaded again when pyproject.toml or constraints.txt changes."""
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes()
                           ).hexdigest()[:16]
    wheels = CACHE / "wheels"
    marker = wheels / f".complete-{stamp}"
    if not marker.exists():
        log("downloading the image's packages with the host's pip")
        download(ROOT, wheels, TORCH_SPEC)
        marker.touch()
    write_index(wheels)
    return wheels


@contextmanager
def wheel_index(wheels: Path, work: Path) -> Iterator[str]:
    """The wheel folder served on loopback; yields its PEP 503 index URL."""
    port = free_port()
    with open(work / "wheel-index.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                                 "--directory", str(wheels)], stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}/simple"
    finally:
        proc.terminate()
        proc.wait(10)
