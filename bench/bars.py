"""Issue 15's perf_analyzer bars with every system up at once, alternated cell by cell, so that this host's
drift falls on all of them alike.

    .venv/bin/python bench/bars.py [--systems "triton-native fleet"] [--base-root CHECKOUT]
                                   [--protocols "http grpc"] [--models "mlp double"] [--conc "1 32"]
                                   [--rounds 4] [--interval-ms 2000] [--pa-timeout 90] [--port 18000] [--out DIR]

bench/compare.sh runs one system after the other, each through every model and level (minutes apart), and on a
drifting host (±25 % between passes a few minutes apart on a bad day) its ratios are mostly when each system
ran. Here native Triton (the anchor kit's tritonserver, gRPC on), fleet (`fleet up` of this checkout) and, with
--base-root, fleet-base (another checkout's) are all started first, each on its own ports (PORT, PORT+100,
PORT+200; gRPC on +1), and each cell (protocol, model, C) is measured on every system back to back, the order
reversed every round: perf_analyzer as bench/served.py runs it (batch 1, `--stability-percentage 20`,
`--max-trials 12`, killed after --pa-timeout s, which is what a hang of native Triton costs). The systems not
measured sit idle meanwhile (fleet's idle processes: heartbeats and claims, ~1 % of a core).

Prints every round's cells, then per cell each system's median infer/s, p50 and p99 and the ratios of the second
system (fleet) to the first (native) round by round: their median and their range. The bars (issue 15): `mlp`
C=32 infer/s ≥ 1.0x with p99 ≤ native's, `double` C=32 ≥ 0.6x, p50 at C=1 ≤ 1.5x. Writes
OUT/roundR/SYSTEM/PROTOCOL/MODEL_cC.{txt,csv,stats.json} (bench/summary.py reads each folder). Only 127.0.0.1
is contacted; the servers are stopped by their PIDs (native: its process group, as the anchor kit does).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from native import NativeTriton  # bench/native.py
from served import DEFAULT_PA, ROOT, Fleet, run_level  # bench/served.py
from summary import Level, print_table, read_level  # bench/summary.py

# (model, C) -> what issue 15 asks of fleet against native: (what, bound)
BARS = {("mlp", 32): "infer/s ≥ 1.0x, p99 ≤ 1.0x", ("double", 32): "infer/s ≥ 0.6x",
        ("mlp", 1): "p50 ≤ 1.5x", ("double", 1): "p50 ≤ 1.5x"}


def start_all(systems: list[str], port: int, out: Path, models: list[str],
              base_root: Path | None) -> tuple[dict[str, int], list[Callable[[], None]]]:
    """Starts each system on its own ports; returns system -> HTTP port, and how to stop each started."""
    ports, stops = {}, []
    for i, system in enumerate(systems):
        p = port + 100 * i
        (out / system).mkdir(parents=True, exist_ok=True)
        if system == "triton-native":
            triton = NativeTriton(p, out / system, grpc=True)
            triton.start()
            stops.append(triton.stop)
        elif system in ("fleet", "fleet-base"):
            if system == "fleet-base" and base_root is None:
                raise SystemExit("fleet-base needs --base-root CHECKOUT")
            fleet = Fleet(p, out / system, 180.0, models, root=base_root if system == "fleet-base" else ROOT,
                          protocol="grpc")
            fleet.start()
            stops.append(lambda fleet=fleet: fleet.stop(30.0))  # type: ignore[misc]
        else:
            raise SystemExit(f"unknown system {system} (triton-native, fleet, fleet-base)")
        ports[system] = p
    return ports, stops


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="triton-native fleet", help="the first is the reference of the ratios")
    p.add_argument("--base-root", type=Path, help='another checkout, measured as the system "fleet-base"')
    p.add_argument("--protocols", default="http grpc")
    p.add_argument("--models", default="mlp double")
    p.add_argument("--conc", default="1 32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--interval-ms", type=int, default=2000)
    p.add_argument("--pa-timeout", type=float, default=90.0)
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    out = (a.out or ROOT / "bench" / "out" / time.strftime("bars-%Y%m%d-%H%M%S")).resolve()
    systems, models = a.systems.split(), a.models.split()
    cells = [(proto, model, int(c)) for proto in a.protocols.split() for model in models for c in a.conc.split()]
    results: dict[tuple[str, str, int], dict[str, list[Level]]] = {cell: {s: [] for s in systems} for cell in cells}
    ports, stops = start_all(systems, a.port, out, models, a.base_root)
    try:
        for r in range(1, a.rounds + 1):
            order = systems if r % 2 else systems[::-1]
            print(f"\n== round {r}/{a.rounds} ({time.strftime('%T')}), order {' '.join(order)}", flush=True)
            for proto, model, conc in cells:
                for system in order:
                    d = out / f"round{r}" / system / proto
                    d.mkdir(parents=True, exist_ok=True)
                    print(f"   {system:14s} {proto:4s} ", end="", flush=True)
                    run_level(str(DEFAULT_PA), ports[system], model, conc, a.interval_ms, d, a.pa_timeout, proto)
                    results[(proto, model, conc)][system].append(read_level(d / f"{model}_c{conc}", model, conc))
    finally:
        for stop in reversed(stops):
            stop()
    report(results, systems, a.rounds, out)


def report(results: dict[tuple[str, str, int], dict[str, list[Level]]], systems: list[str], rounds: int,
           out: Path) -> None:
    ref, rest = systems[0], systems[1:]

    def med(levels: list[Level], key: str) -> str:
        values = [v for lv in levels if (v := getattr(lv, key)) is not None]
        return "-" if not values else f"{statistics.median(values):,.0f}" if key == "infer_s" else \
            f"{statistics.median(values):.2f}"

    rows = []
    for (proto, model, conc), by in results.items():
        row = [proto, model, str(conc)]
        for s in systems:
            failed = sum(1 for lv in by[s] if lv.infer_s is None)
            row.append(f"{med(by[s], 'infer_s')} ({med(by[s], 'p50_ms')} / {med(by[s], 'p99_ms')})"
                       + (f" [{failed} failed]" if failed else ""))
        for s in rest:
            for key in ("infer_s", "p50_ms", "p99_ms"):
                # Round by round: each ratio from two runs minutes apart at most.
                values = [v for i in range(rounds) if i < len(by[s]) and i < len(by[ref])
                          and (v := ratio(getattr(by[s][i], key), getattr(by[ref][i], key))) is not None]
                row.append(spread(values))
        row.append(BARS.get((model, conc), ""))
        rows.append(row)
    header = ["protocol", "model", "C", *[f"{s} infer/s (p50 / p99 ms)" for s in systems]]
    for s in rest:
        header += [f"{s}/{ref} infer/s", "p50", "p99"]
    header.append("bar (fleet/native)")
    print_table(f"medians over {rounds} rounds; ratios round by round: median (range) ({out})", header, rows)


if __name__ == "__main__":
    main()
