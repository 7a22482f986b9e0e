"""Tables from perf_analyzer output folders (the layout the anchor's bench_pa.sh and bench/served.py write:
DIR/MODEL_cC.txt = perf_analyzer's output, DIR/MODEL_cC.csv = its -f --verbose-csv file, and, from served.py
only, DIR/MODEL_cC.stats.json = the server's /stats diffed over the level).

    .venv/bin/python bench/summary.py DIR [DIR ...]        one table per folder
    .venv/bin/python bench/summary.py --compare OUTDIR     compare.sh's folder: every pass of every system,
                                                           then one side-by-side table (median over passes)

"mean batch" = Δinference_count / Δexecution_count: from DIR/MODEL_cC.stats.json when served.py wrote one (the
whole level: warm-up and every measurement window), else perf_analyzer's own server-side "Inference count" /
"Execution count" (the measurement windows it kept), as the anchor's summarize.py does.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

# compare.sh's system folders, in the order they are printed
SYSTEMS = ("triton-native", "triton-pytriton", "fleet")
SHORT = {"triton-native": "native", "triton-pytriton": "pytriton", "fleet": "fleet"}


@dataclass
class Level:
    model: str
    conc: int
    infer_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    mean_batch: float | None = None
    queue_ms: float | None = None
    compute_ms: float | None = None
    error: str = ""


def _us_to_ms(row: dict[str, str], key: str) -> float | None:
    v = row.get(key, "").strip()
    return int(v) / 1000 if v.isdigit() else None


def read_level(base: Path, model: str, conc: int) -> Level:
    lv = Level(model, conc)
    txt_path, csv_path, stats_path = (base.with_suffix(s) for s in (".txt", ".csv", ".stats.json"))
    txt = txt_path.read_text(errors="replace") if txt_path.exists() else ""
    if csv_path.exists():
        with csv_path.open() as f:
            row = next(csv.DictReader(f), None)
        if row:
            lv.infer_s = float(row["Inferences/Second"])
            lv.p50_ms = _us_to_ms(row, "p50 latency")
            lv.p99_ms = _us_to_ms(row, "p99 latency")
            lv.queue_ms = _us_to_ms(row, "Server Queue")
            lv.compute_ms = _us_to_ms(row, "Server Compute Infer")
    if lv.infer_s is None:
        lines = [ln for ln in txt.strip().splitlines() if ln.strip()] or ["no output"]
        err = next((ln for ln in lines if "Failed" in ln or "error" in ln.lower()), lines[-1])
        lv.error = "FAILED: " + err.strip()[:100]
    if stats_path.exists():
        d = json.loads(stats_path.read_text())
        if d.get("d_execution_count"):
            lv.mean_batch = d["d_inference_count"] / d["d_execution_count"]
    if lv.mean_batch is None:
        inf = re.search(r"Inference count: (\d+)", txt)
        exe = re.search(r"Execution count: (\d+)", txt)
        if inf and exe and int(exe[1]):
            lv.mean_batch = int(inf[1]) / int(exe[1])
    return lv


def read_dir(d: Path, models: list[str] | None = None) -> list[Level]:
    out = []
    for txt in d.glob("*_c*.txt"):
        m = re.fullmatch(r"(.+)_c(\d+)\.txt", txt.name)
        if m and (not models or m[1] in models):
            out.append(read_level(txt.with_suffix(""), m[1], int(m[2])))
    order = {name: i for i, name in enumerate(models or [])}
    return sorted(out, key=lambda lv: (order.get(lv.model, len(order)), lv.model, lv.conc))


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """rich when installed, else a plain aligned table; the first column left-aligned."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
        for r in [header, *rows]:
            cells = enumerate(zip(r, widths, strict=False))
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in cells))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    Console(width=max(100, sum(w + 3 for w in widths) + 1)).print(table)


def print_levels(title: str, levels: list[Level]) -> None:
    header = ["model", "C", "infer/s", "p50 ms", "p99 ms", "mean batch", "queue ms", "compute ms"]
    rows = []
    for lv in levels:
        if lv.error:
            rows.append([lv.model, str(lv.conc), lv.error, "", "", _f(lv.mean_batch, ".1f"), "", ""])
        else:
            rows.append([lv.model, str(lv.conc), _f(lv.infer_s, ",.0f"), _f(lv.p50_ms, ".2f"), _f(lv.p99_ms, ".2f"),
                         _f(lv.mean_batch, ".1f"), _f(lv.queue_ms, ".2f"), _f(lv.compute_ms, ".2f")])
    print_table(title, header, rows)


def compare(outdir: Path) -> None:
    """OUTDIR/passN/SYSTEM/ from compare.sh: each folder's table, then medians side by side."""
    passes = sorted((p for p in outdir.glob("pass*") if p.is_dir()), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    # (system, model, conc) -> list of Level, one per pass
    cells: dict[tuple[str, str, int], list[Level]] = {}
    for p in passes:
        for system in SYSTEMS:
            d = p / system
            if not d.is_dir():
                continue
            levels = read_dir(d, ["double", "mlp"])
            print_levels(f"{p.name} / {system}", levels)
            for lv in levels:
                cells.setdefault((system, lv.model, lv.conc), []).append(lv)
    keys = sorted({(m, c) for _, m, c in cells}, key=lambda k: (k[0], k[1]))
    systems = [s for s in SYSTEMS if any(k[0] == s for k in cells)]
    header = ["model", "C"] + [f"{SHORT[s]} infer/s (p50 ms)" for s in systems]
    if "fleet" in systems:
        header += [f"fleet/{SHORT[s]}" for s in systems if s != "fleet"]
    rows = []
    for model, conc in keys:
        med: dict[str, float | None] = {}
        row = [model, str(conc)]
        for s in systems:
            ok = [lv for lv in cells.get((s, model, conc), []) if lv.infer_s is not None]
            n = len(cells.get((s, model, conc), []))
            if not ok:
                med[s] = None
                row.append(f"failed {n}/{n}" if n else "-")
                continue
            med[s] = statistics.median(lv.infer_s for lv in ok if lv.infer_s is not None)
            p50 = statistics.median(lv.p50_ms for lv in ok if lv.p50_ms is not None) if ok[0].p50_ms else None
            fails = f" [{n - len(ok)} failed]" if len(ok) < n else ""
            row.append(f"{med[s]:,.0f} ({_f(p50, '.2f')}){fails}")
        if "fleet" in systems:
            for s in systems:
                if s != "fleet":
                    a, b = med.get("fleet"), med.get(s)
                    row.append(f"{a / b:.2f}x" if a and b else "-")
        rows.append(row)
    print_table(f"median over {len(passes)} pass(es), {outdir}", header, rows)


def main() -> None:
    p = argparse.ArgumentParser(description="tables from perf_analyzer output folders")
    p.add_argument("dirs", nargs="*", type=Path)
    p.add_argument("--compare", type=Path, help="compare.sh OUTDIR: all passes, then medians side by side")
    p.add_argument("--models", nargs="+")
    a = p.parse_args()
    if a.compare:
        compare(a.compare)
    for d in a.dirs:
        print_levels(str(d), read_dir(d, a.models))
    if not a.compare and not a.dirs:
        p.error("give DIR ... or --compare OUTDIR")


if __name__ == "__main__":
    main()
