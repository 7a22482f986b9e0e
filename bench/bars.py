"""Issue 15's perf_analyzer bars with every system up at once, alternated cell by cell, so that this host's
drift falls on all of them alike.

    .venv/bin/python bench/bars.py [--systems "triton-native fleet"] [--base-root CHECKOUT]
                                   [--protocols "http grpc"] [--models "mlp double"] [--conc "1 32"]
                                   [--rounds 4] [--interval-ms 2000] [--pa-timeout 90] [--port 18000] [--out DIR]

bench/compare.sh runs one system after the other, each through every model and level (minutes apart), and on a
drifting host (one system's passes a few minutes apart differed by up to 1.5x in stop 58) its ratios are mostly
when each system ran. Here native Triton (the anchor kit's tritonserver, gRPC on when measured), fleet (`fleet up`
of this checkout), floor (bench/floor.py, the least this architecture does a request; HTTP only) and, with
--base-root, fleet-base (another checkout's) are all started first, each on its own
ports (PORT, PORT+100, PORT+200; gRPC on +1), and each cell (protocol, model, C) is measured on every system back to
back, the order reversed every round: perf_analyzer as bench/served.py runs it (batch 1, `--stability-percentage
20`, `--max-trials 12`, killed after --pa-timeout s, which is what a hang of native Triton costs). The systems not
measured sit idle meanwhile (fleet's idle processes: heartbeats and claims, ~1 % of a core).

Prints every round's cells, then per cell each system's median infer/s, p50 and p99, and the ratios of every other
system to the first, round by round: their median, range and count (a round whose run failed, as a hang of native
Triton, gives no ratio). Stopped early (Ctrl-C, SIGTERM), it stops the servers and prints what it measured. The
bars (issue 15), shown where the first system is native Triton: `mlp` C=32 infer/s ≥ 1.0x with p99 ≤ native's,
`double` C=32 ≥ 0.6x, p50 at C=1 ≤ 1.5x. Writes OUT/roundR/SYSTEM/PROTOCOL/MODEL_cC.{txt,csv,stats.json}
(bench/summary.py reads each folder). Only 127.0.0.1 is contacted; the servers are stopped by their PIDs (native:
its process group, as the anchor kit does).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from native import server  # bench/native.py
from served import DEFAULT_PA, ROOT, run_level  # bench/served.py
from summary import Level, print_table, read_level  # bench/summary.py

# (model, C) -> what issue 15 asks of fleet against native: (what, bound)
BARS = {("mlp", 32): "infer/s ≥ 1.0x, p99 ≤ 1.0x", ("double", 32): "infer/s ≥ 0.6x",
        ("mlp", 1): "p50 ≤ 1.5x", ("double", 1): "p50 ≤ 1.5x"}


def start_all(systems: list[str], port: int, out: Path, models: list[str], base_root: Path | None, grpc: bool,
              stops: list[Callable[[], None]]) -> dict[str, int]:
    """Starts each system on its own ports; returns system -> HTTP port. How to stop each is put in `stops`
    before it is started, so that one that fails to start is stopped with the others."""
    ports = {}
    for i, system in enumerate(systems):
        if system == "fleet-base" and base_root is None:
            raise SystemExit("fleet-base needs --base-root CHECKOUT")
        ports[system] = port + 100 * i
        (out / system).mkdir(parents=True, exist_ok=True)
        # (a checkout that serves no gRPC is refused up front when gRPC is measured)
        started, stop = server(system, ports[system], out / system, models,
                               root=base_root if system == "fleet-base" and base_root else ROOT, grpc=grpc)
        stops.append(stop)
        started.start()
    return ports


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
    stops: list[Callable[[], None]] = []
    # SIGTERM as Ctrl-C: the servers (each in its own session) are stopped and what was measured is printed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        ports = start_all(systems, a.port, out, models, a.base_root, "grpc" in a.protocols.split(), stops)
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
        report(results, systems, out)


def report(results: dict[tuple[str, str, int], dict[str, list[Level]]], systems: list[str], out: Path) -> None:
    """Each system's medians per cell, and every other system's ratios to the first, round by round (a round
    that lacks either run, as a hang, gives none: n says how many rounds a ratio rests on)."""
    ref, rest = systems[0], systems[1:]
    against_native = ref == "triton-native"

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
                # Round by round: the two runs of a ratio are seconds apart, not a pass apart.
                values = [v for mine, theirs in zip(by[s], by[ref], strict=False)
                          if (v := ratio(getattr(mine, key), getattr(theirs, key))) is not None]
                row.append(spread(values) + (f" n={len(values)}" if key == "infer_s" else ""))
        if against_native:
            row.append(BARS.get((model, conc), ""))
        rows.append(row)
    header = ["protocol", "model", "C", *[f"{s} infer/s (p50 / p99 ms)" for s in systems]]
    for s in rest:
        header += [f"{s}/{ref} infer/s", "p50", "p99"]
    if against_native:
        header.append("bar (fleet/native)")
    print_table(f"medians; ratios round by round: median (range), n rounds ({out})", header, rows)


if __name__ == "__main__":
    main()
