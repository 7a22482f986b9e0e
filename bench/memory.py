"""Memory: the resident set of every process of fleet and of native Triton, idle and under load.

    .venv/bin/python bench/memory.py [--port 18000] [--conc 32] [--interval-ms 2000] [--out DIR]
                                     [--systems "fleet triton-native"]

For each system, one at a time on the same port, serving `double` (Python backend) and `mlp`:
  fleet: bench/served.py's Fleet (`fleet up` serving the two models), its processes = the descendants of
         `fleet up` and its descendants (gateway, worker, Valkey, the Python backend's stub, the bulk-job worker);
  triton-native: the anchor kit's start_native.sh (tritonserver 2.51.0 with the same two models as Python-backend
         models), its processes = tritonserver's process group (tritonserver, one stub per model instance);
RSS (VmRSS from /proc) of each process 3 s after ready (idle), then the peak of each while perf_analyzer runs
`mlp` then `double` at C (bench_pa.sh's command, sampled every 0.25 s), then the server is stopped by its PID.
RSS counts shared pages (libraries, torch) in every process that maps them, as `top` does. Only 127.0.0.1 is
contacted; each level is bounded by perf_analyzer's --max-trials and a 300 s kill.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from native import server  # bench/native.py
from procs import descendants, rss_mib  # bench/procs.py
from served import DEFAULT_PA, ROOT, Fleet, run_level  # bench/served.py
from summary import print_table  # bench/summary.py

MODELS = ["double", "mlp"]
Find = Callable[[], list[tuple[int, list[bytes]]]]


def group_members(pgid: int) -> list[tuple[int, list[bytes]]]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out.append((int(stat.parent.name), (stat.parent / "cmdline").read_bytes().split(b"\0")))
        except (OSError, IndexError, ValueError):
            continue
    return out


def role(argv: list[bytes]) -> str:
    text = b" ".join(argv).decode(errors="replace")
    for needle, name in (("fleet gateway", "gateway"), ("fleet worker", "worker"), ("python_stub", "python stub"),
                         ("valkey", "valkey"), ("redis-server", "valkey"),
                         ("triton_python_backend_stub", "python stub"), ("tritonserver", "tritonserver"),
                         ("fleet jobs-worker", "jobs worker (RQ)"), ("fleet up", "fleet up")):
        if needle in text:
            return name
    return Path(argv[0].decode(errors="replace")).name or "?"


class Sampler(threading.Thread):
    """The peak RSS of each process found by `find`, sampled until stopped."""

    def __init__(self, find: Callable[[], list[tuple[int, list[bytes]]]]) -> None:
        super().__init__(daemon=True)
        self.find = find
        self.peak: dict[int, tuple[str, float]] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for pid, argv in self.find():
                old = self.peak.get(pid, ("", 0.0))[1]
                self.peak[pid] = (role(argv), max(old, rss_mib(pid)))
            self.stopping.wait(0.25)


def by_role(samples: dict[int, tuple[str, float]]) -> dict[str, tuple[int, float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for name, mib in samples.values():
        if mib > 0:
            out[name].append(mib)
    return {name: (len(v), sum(v)) for name, v in out.items()}


def start(system: str, port: int, out: Path, models: list[str], root: Path = ROOT,
          grpc: bool = False) -> tuple[Find, Callable[[], None]]:
    """Start `system` serving `models` on `port` (a fleet: the checkout at `root`; with `grpc` also over gRPC on
    port+1, bench/native.py's `server`): how to find its processes, and how to stop it."""
    started, stop = server(system, port, out, models, root=root, grpc=grpc)
    try:
        started.start()
    except BaseException:
        stop()
        raise
    if isinstance(started, Fleet):
        assert started.proc is not None
        root_pid = started.proc.pid

        def find_fleet() -> list[tuple[int, list[bytes]]]:
            return [(root_pid, Path(f"/proc/{root_pid}/cmdline").read_bytes().split(b"\0")), *descendants(root_pid)]

        return find_fleet, stop
    pgid = started.pgid
    assert pgid is not None
    return lambda: group_members(pgid), stop


def measure(system: str, port: int, conc: int, interval_ms: int, out: Path) -> tuple[dict[str, tuple[int, float]],
                                                                                     dict[str, tuple[int, float]]]:
    out.mkdir(parents=True, exist_ok=True)
    find, stop = start(system, port, out, MODELS)
    try:
        time.sleep(3)
        idle = {pid: (role(argv), rss_mib(pid)) for pid, argv in find()}
        sampler = Sampler(find)
        sampler.start()
        for model in ("mlp", "double"):
            run_level(str(DEFAULT_PA), port, model, conc, interval_ms, out, 300.0)
        sampler.stopping.set()
        sampler.join()
        return by_role(idle), by_role(sampler.peak)
    finally:
        stop()


def main() -> None:
    p = argparse.ArgumentParser(description="RSS of fleet's and native Triton's processes, idle and under load")
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--conc", type=int, default=32)
    p.add_argument("--interval-ms", type=int, default=2000)
    p.add_argument("--systems", default="fleet triton-native")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    out = (a.out or ROOT / "bench" / "out" / time.strftime("memory-%Y%m%d-%H%M%S")).resolve()
    rows = []
    for system in a.systems.split():
        idle, peak = measure(system, a.port, a.conc, a.interval_ms, out / system)
        for name in sorted(set(idle) | set(peak)):
            n, mib = idle.get(name, (0, 0.0))
            pn, pmib = peak.get(name, (0, 0.0))
            rows.append([system, name, str(max(n, pn)), f"{mib:,.0f}", f"{pmib:,.0f}"])
        rows.append([system, "total", "", f"{sum(v for _, v in idle.values()):,.0f}",
                     f"{sum(v for _, v in peak.values()):,.0f}"])
    print_table(f"RSS (MiB), idle and peak under perf_analyzer C={a.conc} on mlp then double ({out})",
                ["system", "process", "count", "idle MiB", "peak under load MiB"], rows)


if __name__ == "__main__":
    main()
