"""Two checkouts' fleets running the same bulk job at the same time: the CPU each process spends a line.

    .venv/bin/python bench/job_pair.py --base-root DIR [--root .] [--lines 150000] [--rounds 4]
                                       [--format jsonl|npy] [--window-s 10] [--port 18700] [--out DIR]

On a noisy shared host one job after another reads the host's drift as much as the change (direct `mlp` moved
by 1.3x within minutes in stop 70). Here both fleets (`fleet up` in each checkout, bench/served.py's Fleet,
`mlp` only) run one job each, of the same --lines 256-float rows (JSONL lines as json.dumps writes them, or one
.npy), at once: whatever the host does, it does to both. From when both have done an eighth of their rows, over
--window-s, each fleet's processes' CPU (/proc, utime + stime, by role: jobs-worker, worker, gateway, valkey) is
divided by the rows that fleet finished in the window. The jobs then run to their end, and the next round
starts them again, in the other order. Prints each round, then per role the median µs a row and new/base.
Only 127.0.0.1 is contacted; each job is capped at 600 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bulk import run_job, wait_job, write_jsonl  # bench/bulk.py
from procs import cpu_ticks, descendants  # bench/procs.py
from served import ROOT, Fleet, api  # bench/served.py
from summary import print_table  # bench/summary.py

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def role(argv: list[bytes]) -> str:
    if argv[1:3] == [b"-m", b"fleet"] and len(argv) > 3:
        return argv[3].decode()
    return "valkey" if b"valkey" in argv[0] else Path(argv[0].decode(errors="replace")).name


def cpu_by_role(fleet: Fleet) -> dict[str, int]:
    """CPU ticks so far of `fleet up` and every process below it, by role (the processes alive now)."""
    if fleet.proc is None:
        raise SystemExit("the fleet is not running")
    ticks: dict[str, int] = {"up": cpu_ticks(fleet.proc.pid)}
    for pid, argv in descendants(fleet.proc.pid):
        name = role(argv)
        ticks[name] = ticks.get(name, 0) + cpu_ticks(pid)
    return ticks


def record(port: int, job: str) -> dict[str, Any]:
    return api(port, "GET", f"/v2/jobs/{job}")





def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-root", type=Path, required=True, help="the checkout before the change")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout with it (default: this one)")
    p.add_argument("--lines", type=int, default=150_000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--format", choices=("jsonl", "npy"), default="jsonl", help="the job's input and output")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--port", type=int, default=18700, help="base's; the new fleet's is 100 above")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    out = a.out or ROOT / "bench" / "out" / time.strftime("job-pair-%Y%m%d-%H%M%S")
    data = Path(tempfile.mkdtemp(prefix="job-pair-"))
    x = np.random.default_rng(0).standard_normal((a.lines, 256), dtype=np.float32)
    source = data / f"x.{a.format}"
    if a.format == "jsonl":
        write_jsonl(source, x)
    else:
        np.save(source, x)
    fleets: dict[str, tuple[int, Fleet]] = {}
    per_row: dict[tuple[str, str], list[float]] = {}
    rates: dict[str, list[float]] = {"base": [], "new": []}
    try:
        for i, (name, root) in enumerate((("base", a.base_root), ("new", a.root))):
            (out / name).mkdir(parents=True, exist_ok=True)
            port = a.port + 100 * i
            fleet = Fleet(port, out / name, 120.0, ["mlp"], root=root,
                          env={"FLEET_JOB_INPUT_DIRS": json.dumps([str(data)])})
            fleets[name] = (port, fleet)
            fleet.start()
        for r in range(a.rounds):
            names = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            jobs = {n: str(run_job(fleets[n][0], source, wait=False, fmt=a.format)["id"]) for n in names}
            deadline = time.monotonic() + 600
            while min(int(record(fleets[n][0], jobs[n])["done"]) for n in names) < a.lines // 8:
                if time.monotonic() > deadline:
                    raise SystemExit("the jobs did not start")
                time.sleep(0.05)
            before = {n: (cpu_by_role(fleets[n][1]), int(record(fleets[n][0], jobs[n])["done"])) for n in names}
            t0 = time.monotonic()
            time.sleep(a.window_s)
            after = {n: (cpu_by_role(fleets[n][1]), int(record(fleets[n][0], jobs[n])["done"])) for n in names}
            elapsed = time.monotonic() - t0
            roles = sorted({k for n in names for k in after[n][0]})
            for n in names:
                rows = after[n][1] - before[n][1]
                rates[n].append(rows / elapsed)
                spent = {k: (after[n][0].get(k, 0) - before[n][0].get(k, after[n][0].get(k, 0))) * TICK_S * 1e6
                         / max(rows, 1) for k in roles}
                for k in roles:  # every role every round, so that the lists line up round by round
                    per_row.setdefault((n, k), [0.0] * r).append(spent[k])
                cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v > 0)
                print(f"round {r + 1} {n}: {rows / elapsed:,.0f} rows/s; CPU µs a row: {cpu}", flush=True)
            for n in names:
                doc = wait_job(fleets[n][0], record(fleets[n][0], jobs[n]), max(1.0, deadline - time.monotonic()))
                if doc["failed"]:
                    raise SystemExit(f"{n}'s job {jobs[n]}: {doc['failed']} rows failed")
    finally:
        for _, fleet in fleets.values():
            fleet.stop(30.0)
        for f in data.iterdir():
            f.unlink()
    rows_out = [["rows/s", f"{statistics.median(rates['base']):,.0f}", f"{statistics.median(rates['new']):,.0f}",
                 f"{statistics.median(n / b for b, n in zip(rates['base'], rates['new'], strict=True)):.3f}x"]]
    for k in sorted({k for _, k in per_row}, key=lambda k: -statistics.median(per_row.get(("base", k), [0.0]))):
        base, new = per_row.get(("base", k)), per_row.get(("new", k))
        if base and new and statistics.median(base) > 0.5:
            rows_out.append([f"{k} µs a row", f"{statistics.median(base):.1f}", f"{statistics.median(new):.1f}",
                             f"{statistics.median(n / b for b, n in zip(base, new, strict=True)):.3f}x"])
    print_table(f"{a.format} job of {a.lines:,} rows, both fleets at once, {a.rounds} rounds, medians ({out})",
                ["", "base", "new", "new/base (round by round)"], rows_out)


if __name__ == "__main__":
    main()
