"""Native Triton from the anchor kit (../shared/anchors/triton/start_native.sh: tritonserver 2.51.0 serving `double`
and `mlp` as Python-backend models), started and stopped by this script's callers (bench/memory.py,
bench/poisson.py, bench/bars.py) by the PID in its run folder; and `server`, the server a bench's system name
stands for."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from procs import stop as stop_process  # bench/procs.py
from served import ANCHOR, ROOT, Fleet, port_in_use  # bench/served.py

SYSTEMS = ("triton-native", "fleet", "fleet-base", "floor")


class NativeTriton:
    def __init__(self, port: int, out: Path, grpc: bool = False) -> None:
        self.port, self.run = port, out / "run"
        # The anchor kit's venv (bench/compare.sh makes it with the kit's setup.sh); the caller's env wins.
        self.env = ({"ANCHOR_VENV": str(ROOT / "bench" / ".anchor-triton")} | dict(os.environ)
                    | {"ANCHOR_RUN": str(self.run), "GRPC": "1" if grpc else "0"})
        self.pgid: int | None = None

    def start(self) -> None:
        self.run.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(ANCHOR / "start_native.sh"), str(self.port)], check=True, env=self.env, timeout=300)
        self.pgid = int((self.run / "server.pid").read_text())  # setsid: tritonserver leads its process group

    def stop(self) -> None:
        if self.pgid is not None:
            subprocess.run([str(ANCHOR / "stop_server.sh")], env=self.env, timeout=120, check=False)
            self.pgid = None


class Floor:
    """bench/floor.py (the least this architecture does a request: HTTP only, `double` and `mlp`), as compare.sh's
    system `floor`, here in the interleaved runners. Stopped by its PID (SIGTERM stops its Valkey and children)."""

    def __init__(self, port: int, out: Path) -> None:
        self.port, self.log = port, out / "floor.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "floor.py"), "serve", "--port",
                                          str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            if port_in_use(self.port):
                return
            time.sleep(0.2)
        raise SystemExit(f"floor did not start on port {self.port} (see {self.log})")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s=30)
        self.proc = None


def server(system: str, port: int, out: Path, models: list[str], root: Path = ROOT,
           grpc: bool = False) -> tuple[Fleet | NativeTriton | Floor, Callable[[], None]]:
    """The server `system` names (fleet-base: the fleet of the checkout at `root`), not started yet, and how to
    stop it (after a failed start too). With `grpc` native Triton serves gRPC (port+1), and a fleet whose
    checkout serves none is refused."""
    if system == "triton-native":
        triton = NativeTriton(port, out, grpc=grpc)
        return triton, triton.stop
    if system in ("fleet", "fleet-base"):
        fleet = Fleet(port, out, 180.0, models, root=root, protocol="grpc" if grpc else "http")
        return fleet, functools.partial(fleet.stop, 30.0)
    if system == "floor":
        if grpc:
            raise SystemExit("floor serves HTTP only: measure it with --protocols http")
        floor = Floor(port, out)
        return floor, floor.stop
    raise SystemExit(f"unknown system {system} ({', '.join(SYSTEMS)})")
