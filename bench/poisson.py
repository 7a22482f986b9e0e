"""MLPerf's server scenario: Poisson arrivals, the highest rate whose p99 stays under a bound, fleet against native
Triton, interleaved.

    .venv/bin/python bench/poisson.py [--model mlp] [--p99-ms 20] [--range 250:8000:250] [--passes 2]
                                      [--systems "fleet triton-native"] [--port 18000] [--out DIR]
                                      [--base-root CHECKOUT]  # system "fleet-base": that checkout's fleet

Per pass, per system (the order rotating per pass), one server at a time on one port: fleet as bench/served.py
starts it (`fleet up` serving the model), native Triton as the anchor kit's start_native.sh (bench/native.py). Then
    perf_analyzer -m MODEL -i http -u 127.0.0.1:PORT -b 1 --request-rate-range RANGE --async
        --request-distribution poisson --percentile 99 --latency-threshold P99 --measurement-interval 3000
        --stability-percentage 50 --max-trials 6 --max-threads 16 -f OUT/PASS/SYSTEM.csv
(an open loop: --async sends on schedule whatever is outstanding; the rates rise step by step and perf_analyzer
stops at the first whose p99, `--percentile 99`, passes the threshold; stability 50 % because a p99 over 3 s
of Poisson arrivals moves more than an average). A rate counts when its p99 is within the bound and the server
kept up: the achieved rate is at least 95 % of the offered one. The table: that highest rate per pass and system,
its p99, and fleet's median over native's.
Only 127.0.0.1 is contacted; each perf_analyzer run is killed after --pa-timeout s.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import subprocess
import time
from pathlib import Path

from native import server  # bench/native.py
from served import DEFAULT_PA, HOST, ROOT  # bench/served.py
from summary import print_table  # bench/summary.py

KEPT_UP = 0.95


def best_rate(path: Path, p99_ms: float) -> tuple[float, float, float] | None:
    """(offered rate, achieved infer/s, p99 ms) of the highest offered rate that met the bound and was kept up:
    from perf_analyzer's CSV, or, when it was killed before writing one (native Triton has hung at a high
    rate), from the rates its log reported until then."""
    ok = [(offered, achieved, p99) for offered, achieved, p99 in measured_rates(path)
          if p99 <= p99_ms and achieved >= KEPT_UP * offered]
    return max(ok, default=None)


def measured_rates(path: Path) -> list[tuple[float, float, float]]:
    """(offered rate, achieved infer/s, p99 ms) of each rate measured: the CSV's rows, else the log's."""
    rates = []
    if path.exists():
        with path.open() as f:
            for row in csv.DictReader(f):
                try:
                    offered = float(row.get("Request Rate") or next(iter(row.values())))
                    rates.append((offered, float(row["Inferences/Second"]), int(row["p99 latency"]) / 1000))
                except (KeyError, ValueError, StopIteration):
                    continue
        return rates
    log = path.with_suffix(".txt")
    if not log.exists():
        return rates
    # A block per rate: "Request Rate: R inference requests per seconds", then its client's Throughput and
    # p99 (none when it failed); the summary at the end ("Request Rate: R, throughput: ...") is not one.
    for block in re.split(r"^Request Rate: (?=\d+ inference)", log.read_text(), flags=re.M)[1:]:
        offered = re.match(r"(\d+)", block)
        achieved = re.search(r"Throughput: ([\d.]+) infer/sec", block)
        p99 = re.search(r"p99 latency: (\d+) usec", block)
        if offered and achieved and p99:
            rates.append((float(offered.group(1)), float(achieved.group(1)), int(p99.group(1)) / 1000))
    return rates


def measure(pa: str, model: str, port: int, rate_range: str, p99_ms: float, out: Path, timeout: float) -> None:
    cmd = [pa, "-m", model, "-i", "http", "-u", f"{HOST}:{port}", "-b", "1", "--request-rate-range", rate_range,
           "--async", "--request-distribution", "poisson", "--percentile", "99",
           "--latency-threshold", f"{p99_ms:g}", "--measurement-interval", "3000", "--stability-percentage", "50",
           "--max-trials", "6", "--max-threads", "16", "-f", str(out.with_suffix(".csv"))]
    with out.with_suffix(".txt").open("w") as f:
        try:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            f.write(f"\nperf_analyzer killed after {timeout:.0f}s\n")


def main() -> None:
    p = argparse.ArgumentParser(description="Poisson arrivals: the highest rate with p99 under a bound")
    p.add_argument("--model", default="mlp")
    p.add_argument("--p99-ms", type=float, default=20.0)
    p.add_argument("--range", default="250:8000:250", help="perf_analyzer --request-rate-range start:end:step")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--systems", default="fleet triton-native")
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--perf-analyzer", default=str(DEFAULT_PA))
    p.add_argument("--pa-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--base-root", type=Path, help="another checkout, measured as the system fleet-base")
    a = p.parse_args()
    out = (a.out or ROOT / "bench" / "out" / time.strftime("poisson-%Y%m%d-%H%M%S")).resolve()
    systems = a.systems.split()
    if "fleet-base" in systems and a.base_root is None:
        p.error("the system fleet-base needs --base-root")  # before any pass, not after the first system's
    found: dict[str, list[tuple[float, float, float] | None]] = {s: [] for s in systems}
    for n in range(a.passes):
        for system in systems[n % len(systems):] + systems[:n % len(systems)]:
            d = out / f"pass{n + 1}"
            d.mkdir(parents=True, exist_ok=True)
            if system == "fleet-base":
                (d / system).mkdir(exist_ok=True)
            started, stop = server(system, a.port, d if system == "fleet" else d / system, [a.model],
                                   root=a.base_root if system == "fleet-base" else ROOT)
            try:
                started.start()
                measure(a.perf_analyzer, a.model, a.port, a.range, a.p99_ms, d / system, a.pa_timeout)
            finally:
                stop()
            result = best_rate((d / system).with_suffix(".csv"), a.p99_ms)
            found[system].append(result)
            print(f"pass {n + 1} {system}: {result}", flush=True)
    rows = []
    for system in systems:
        cells = [f"{r[1]:,.0f} ({r[2]:.1f} ms)" if r else "-" for r in found[system]]
        rates = [r[1] for r in found[system] if r]
        rows.append([system, *cells, f"{statistics.median(rates):,.0f}" if rates else "-"])
    for other in ("triton-native", "fleet-base"):
        if "fleet" in found and other in found:
            f = [r[1] for r in found["fleet"] if r]
            t = [r[1] for r in found[other] if r]
            if f and t:
                ratio = statistics.median(f) / statistics.median(t)
                rows.append([f"fleet / {other}", *[""] * a.passes, f"{ratio:.2f}x"])
    print_table(f"{a.model}: the highest Poisson rate with p99 <= {a.p99_ms:g} ms, achieved infer/s (its p99) ({out})",
                ["system", *[f"pass {i + 1}" for i in range(a.passes)], "median"], rows)


if __name__ == "__main__":
    main()
