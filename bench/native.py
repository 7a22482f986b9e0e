"""Native Triton from the anchor kit (../shared/anchors/triton/start_native.sh: tritonserver 2.51.0 serving `double`
and `mlp` as Python-backend models), started and stopped by this script's callers (bench/memory.py,
bench/poisson.py), one at a time, by the PID in its run folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from served import ANCHOR, ROOT  # bench/served.py


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
