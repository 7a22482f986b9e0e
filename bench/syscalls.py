"""Syscalls, context switches and CPU time per request, per process: fleet against native Triton.

    .venv/bin/python bench/syscalls.py [--port 18000] [--conc "1 32"] [--models "mlp double"]
                                       [--seconds 5] [--systems "fleet triton-native"] [--out DIR]
                                       [--base-root CHECKOUT]   (then "fleet-base" is a system: before/after)
                                       [--threads]   (each process's CPU also as its main thread's and the rest's)
                                       [--protocol http|grpc]   (perf_analyzer -i; gRPC on port+1)

For each system, one at a time on the same port (as bench/memory.py starts and finds them: fleet's processes
are `fleet up`'s descendants, native Triton's are tritonserver's process group), for each model and
concurrency: perf_analyzer runs (bench_pa.sh's command, batch 1) and, after a warm-up, for `--seconds`
`perf stat -e raw_syscalls:sys_enter,context-switches` counts each process's syscalls and context switches
(voluntary and involuntary) while /proc gives its CPU time, in user mode and in the kernel (with `--threads`
also its main thread's and its other threads': a worker's event loop and its instances' threads, bench/RESULTS.md
stop 51); the requests served in that window come from
the model's statistics extension (inference_count; batch 1, so one per request). Printed per request and
process role. perf_analyzer itself is not counted (it is the same client for both). perf (linux-perf) must
be installed and allowed to trace (root, or kernel.perf_event_paranoid <= 1 for other users' processes).
Only 127.0.0.1 is contacted; every load is bounded (perf_analyzer's --max-trials, then it is stopped by PID).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

from memory import Find, role, start  # bench/memory.py
from procs import cpu_split  # bench/procs.py
from served import DEFAULT_PA, ROOT, counts, pa_url  # bench/served.py
from summary import print_table  # bench/summary.py

WARMUP_S = 4.0
EVENTS = "raw_syscalls:sys_enter,context-switches"

def inferences(port: int, model: str) -> int:
    found = counts(port, model)
    if found is None:
        raise SystemExit(f"no statistics for '{model}' on port {port}")
    return found[0]


def perf_counts(pids: list[int], seconds: float) -> dict[int, tuple[int, int]]:
    """(syscalls, context switches) of each pid over `seconds`, one `perf stat` per process, all at once."""
    runs = {pid: subprocess.Popen(["perf", "stat", "-x", ",", "-e", EVENTS, "-p", str(pid), "sleep", f"{seconds}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for pid in pids}
    out = {}
    for pid, run in runs.items():
        _, err = run.communicate(timeout=seconds + 30)
        counts = {}
        for line in err.splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[0].strip().isdigit():
                counts[fields[2]] = int(fields[0])
        out[pid] = (counts.get("raw_syscalls:sys_enter", 0), counts.get("context-switches", 0))
    return out


def measure_level(find: Find, port: int, model: str, conc: int, seconds: float, out: Path,
                  threads: bool = False, protocol: str = "http") -> tuple[float, dict[str, list[float]]]:
    """(requests/s, role -> [syscalls, context switches, CPU µs, user µs, kernel µs] per request) at one
    level; with `threads`, also "ROLE: main thread" and "ROLE: other threads" (CPU µs only)."""
    pa = subprocess.Popen([str(DEFAULT_PA), "-m", model, "-i", protocol, "-u", pa_url(port, protocol), "-b", "1",
                           "--concurrency-range", str(conc), "--measurement-interval", "3000",
                           "--stability-percentage", "50", "--max-trials", "8"],
                          stdout=(out / f"{model}_c{conc}.pa.txt").open("w"), stderr=subprocess.STDOUT)
    try:
        time.sleep(WARMUP_S)
        procs = {pid: role(argv) for pid, argv in find()}
        def cpu() -> dict[int, tuple[tuple[int, int], tuple[int, int]]]:  # pid -> (process, main thread)
            return {pid: (cpu_split(pid), cpu_split(pid, pid)) for pid in procs}

        before_n, before_cpu, t0 = inferences(port, model), cpu(), time.monotonic()
        counts = perf_counts(list(procs), seconds)
        after_n, after_cpu, t1 = inferences(port, model), cpu(), time.monotonic()
    finally:
        pa.terminate()
        try:
            pa.wait(30)
        except subprocess.TimeoutExpired:
            pa.kill()
            pa.wait()
    requests = max(1, after_n - before_n)
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    per_role: dict[str, list[float]] = defaultdict(lambda: [0.0] * 5)
    for pid, name in procs.items():
        if after_cpu[pid][0] == (0, 0):
            print(f"   {name} (pid {pid}) ended during the window: left out")
            continue
        syscalls, switches = counts.get(pid, (0, 0))
        (user0, kernel0), main0 = before_cpu[pid]
        (user1, kernel1), main1 = after_cpu[pid]
        user, kernel = (user1 - user0) * tick_us / requests, (kernel1 - kernel0) * tick_us / requests
        row = per_role[name]
        row[0] += syscalls / requests
        row[1] += switches / requests
        row[2] += user + kernel
        row[3] += user
        row[4] += kernel
        if threads:
            main = (sum(main1) - sum(main0)) * tick_us / requests
            per_role[f"{name}: main thread"][2] += main
            per_role[f"{name}: other threads"][2] += max(0.0, user + kernel - main)  # (read apart: a tick's skew)
    return requests / (t1 - t0), dict(per_role)


def main() -> None:
    p = argparse.ArgumentParser(description="syscalls, context switches and CPU per request, fleet vs native Triton")
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--conc", default="1 32")
    p.add_argument("--models", default="mlp double")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--systems", default="fleet triton-native")
    p.add_argument("--out", type=Path)
    p.add_argument("--base-root", type=Path, help='another checkout, measured as the system "fleet-base"')
    p.add_argument("--threads", action="store_true",
                   help="each process's CPU also split into its main thread's and its other threads'")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http",
                   help="perf_analyzer's protocol (gRPC on port+1; native Triton then serves gRPC)")
    a = p.parse_args()
    out = (a.out or ROOT / "bench" / "out" / time.strftime("syscalls-%Y%m%d-%H%M%S")).resolve()
    models = a.models.split()
    rows = []
    for system in a.systems.split():
        (out / system).mkdir(parents=True, exist_ok=True)
        if system == "fleet-base" and a.base_root is None:
            raise SystemExit("--systems fleet-base needs --base-root CHECKOUT")
        # fleet serves the models measured (any of this checkout's); native Triton's repository is the anchor's
        served = models if system.startswith("fleet") else ["double", "mlp"]
        find, stop = start("fleet" if system == "fleet-base" else system, a.port, out / system, served,
                           root=a.base_root if system == "fleet-base" else ROOT, grpc=a.protocol == "grpc")
        try:
            for model in models:
                for conc in (int(c) for c in a.conc.split()):
                    rate, per_role = measure_level(find, a.port, model, conc, a.seconds, out / system, a.threads,
                                                   a.protocol)
                    total = [sum(v[i] for k, v in per_role.items() if ": " not in k) for i in range(5)]
                    for name, (sc, cs, cpu, user, kernel) in sorted(per_role.items()) + [("all", total)]:
                        if name != "all" and sc == 0 and round(cpu) == 0:
                            continue  # idle during the load (fleet up, the job worker, the other model's stub)
                        split = ": " in name  # a thread row: CPU only
                        rows.append([system, model, str(conc), f"{rate:,.0f}", name,
                                     "" if split else f"{sc:.1f}", "" if split else f"{cs:.1f}", f"{cpu:,.0f}",
                                     "" if split else f"{user:,.0f}", "" if split else f"{kernel:,.0f}"])
        finally:
            stop()
    print_table(f"Per request, per process role, during {a.seconds:g} s of perf_analyzer load ({out})",
                ["system", "model", "C", "infer/s", "process", "syscalls", "ctx switches", "CPU µs", "user µs",
                 "kernel µs"], rows)


if __name__ == "__main__":
    main()
