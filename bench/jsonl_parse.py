"""A JSONL job with its lines parsed in the job worker or by forked helpers (FLEET_JOB_PARSE_PROCESSES,
fleet/jobs/parse_pool.py), alternated, on `mlp` (a CPU model: its forward takes a core) and on `gpu`, a `sleep`
model of mlp's shape (a batch of n takes --delay-us + n x --per-item-us without the CPU, like a GPU seen from
the host).

    .venv/bin/python bench/jsonl_parse.py [--lines 150000] [--rounds 3] [--processes "0 2"]
                                          [--models "gpu mlp"] [--delay-us 500] [--per-item-us 10]
                                          [--port 19000] [--out DIR]

Each round starts `fleet up` once per setting (bench/served.py's Fleet; the order reversed every other round),
runs one job of --lines 256-float lines (`.jsonl` in, `.jsonl` out) and takes lines/s from the job record
(items / (finished_at - started_at)). Prints every job, then per model and setting the median and its ratio to
the first setting's. Only 127.0.0.1 is contacted; each job is capped at 600 s (then cancelled).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
from bulk import run_job  # bench/bulk.py
from served import ROOT, Fleet  # bench/served.py
from summary import print_table  # bench/summary.py

GPU_CONFIG = """backend: "sleep"
max_batch_size: 64
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] }} ]
dynamic_batching {{ preferred_batch_size: [ 64 ] max_queue_delay_microseconds: 100 }}
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay}" }} }}
parameters {{ key: "execute_delay_per_item_us" value {{ string_value: "{per_item}" }} }}
"""


def write_lines(path: Path, lines: int) -> None:
    x = np.random.default_rng(0).standard_normal((lines, 256), dtype=np.float32)
    with path.open("wb") as f:
        for row in x:
            f.write(orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": row}]},
                                 option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE))


def lines_per_s(port: int, model: str, source: Path, lines: int) -> float:
    record = run_job(port, source, fmt="jsonl", model=model)
    if record["failed"]:
        raise SystemExit(f"job {record['id']}: {record['failed']} lines failed: {record['errors'][:3]}")
    return lines / (record["finished_at"] - record["started_at"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=150_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--processes", default="0 2", help="FLEET_JOB_PARSE_PROCESSES values; the first is the base")
    p.add_argument("--models", default="gpu mlp")
    p.add_argument("--delay-us", type=int, default=500)
    p.add_argument("--per-item-us", type=int, default=10)
    p.add_argument("--port", type=int, default=19000)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    out = a.out or ROOT / "bench" / "out" / time.strftime("jsonl-parse-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="jsonl-parse-"))
    repo = data / "repo"
    (repo / "gpu" / "1").mkdir(parents=True)
    (repo / "gpu" / "config.pbtxt").write_text(GPU_CONFIG.format(delay=a.delay_us, per_item=a.per_item_us))
    (repo / "mlp" / "1").mkdir(parents=True)
    (repo / "mlp" / "config.pbtxt").write_text((ROOT / "model_repository" / "mlp" / "config.pbtxt").read_text())
    (repo / "mlp" / "1" / "model.pt").symlink_to((ROOT / "model_repository" / "mlp" / "1" / "model.pt").resolve())
    source = data / "in.jsonl"
    write_lines(source, a.lines)
    settings = a.processes.split()
    models = a.models.split()
    rates: dict[tuple[str, str], list[float]] = {(m, s): [] for m in models for s in settings}
    try:
        for r in range(a.rounds):
            for setting in settings if r % 2 == 0 else settings[::-1]:
                run_out = out / f"round{r}" / f"p{setting}"
                run_out.mkdir(parents=True)
                fleet = Fleet(a.port, run_out, 180.0, [], repositories=[str(repo)],
                              env={"FLEET_JOB_INPUT_DIRS": json.dumps([str(data)]),
                                   "FLEET_JOB_PARSE_PROCESSES": setting})
                fleet.start()
                try:
                    for model in models:
                        rate = lines_per_s(a.port, model, source, a.lines)
                        rates[(model, setting)].append(rate)
                        print(f"round {r} {model} FLEET_JOB_PARSE_PROCESSES={setting}: {rate:,.0f} lines/s", flush=True)
                finally:
                    fleet.stop(30.0)
    finally:
        for f in data.glob("*.jsonl*"):
            f.unlink()
    rows = []
    for model in models:
        base = statistics.median(rates[(model, settings[0])]) if rates[(model, settings[0])] else 0.0
        for setting in settings:
            got = rates[(model, setting)]
            if not got:
                continue
            med = statistics.median(got)
            rows.append([model, setting, ", ".join(f"{v:,.0f}" for v in got), f"{med:,.0f}",
                         f"{med / base:.2f}x" if base else "-"])
    print_table(f"JSONL job, {a.lines:,} lines, lines/s ({out})",
                ["model", "FLEET_JOB_PARSE_PROCESSES", "rounds", "median", f"vs {settings[0]}"], rows)


if __name__ == "__main__":
    main()
