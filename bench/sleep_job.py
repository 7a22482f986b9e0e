"""A GPU-like model's bulk job: `.npy` jobs on the `sleep` backend, several configurations alternated.

    .venv/bin/python bench/sleep_job.py [--rows 300000] [--rounds 3] [--delay-us 200] [--per-item-us 2]
                                        [--max-batch 64] [--config NAME=ENV_JSON ...] [--root CHECKOUT ...]
                                        [--port 19100] [--out DIR]

The model is `backend: "sleep"` in `mlp`'s shape (FP32 [256] in and out): a batch of n rows takes
`delay + n * per_item` µs of `time.sleep`, so the instance's thread waits and uses no CPU, as it would on a
GPU. What the job's rate shows is then fleet's own cost a batch (the job worker, Valkey, the worker's loop
and the instance thread's Python), not a forward's. Its ideal: `max_batch` rows every `delay + max_batch *
per_item` µs plus the host's sleep overshoot (~90 µs a call on this project's VM).

Each configuration is a name, an environment for `fleet up` (JSON: `FLEET_READ_AHEAD_BATCHES` and the like)
and a checkout (`--root`, one per configuration or one for all; default this one): every round starts a
fresh `fleet up` per configuration, in alternating order, runs one job of `--rows` rows, and stops it.
Bounded: rounds x configurations jobs, each stopped after 600 s. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
from bulk import run_job  # bench/bulk.py
from served import ROOT, Fleet  # bench/served.py

CONFIG = """backend: "sleep"
max_batch_size: {max_batch}
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 256 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 256 ] }} ]
dynamic_batching {{ preferred_batch_size: [ {max_batch} ] max_queue_delay_microseconds: 100 }}
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay}" }} }}
parameters {{ key: "execute_delay_per_item_us" value {{ string_value: "{per_item}" }} }}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delay-us", type=int, default=200, help="a batch's fixed time")
    p.add_argument("--per-item-us", type=int, default=2, help="its time a row")
    p.add_argument("--max-batch", type=int, default=64, help="the model's max_batch_size (and preferred size)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=ENV_JSON",
                   help='a configuration, e.g. ra4=\'{"FLEET_READ_AHEAD_BATCHES": "4"}\' (default: one, "fleet")')
    p.add_argument("--root", type=Path, action="append", default=[],
                   help="the checkout to serve: one for all configurations, or one each, in order")
    p.add_argument("--port", type=int, default=19100)
    p.add_argument("--out", type=Path, help="where the jobs' data and logs go (default: a new temporary folder)")
    args = p.parse_args()

    configs: dict[str, dict[str, str]] = {}
    for spec in args.config or ["fleet={}"]:
        name, _, env = spec.partition("=")
        configs[name] = json.loads(env or "{}")
    roots = args.root or [ROOT]
    if len(roots) not in (1, len(configs)):
        raise SystemExit("--root: one for all configurations, or one per --config")
    root_of = {name: roots[i if len(roots) > 1 else 0] for i, name in enumerate(configs)}

    data = args.out or Path(tempfile.mkdtemp(prefix="sleep-job-"))
    repo = data / "repo"
    (repo / "gpu" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "gpu" / "config.pbtxt").write_text(CONFIG.format(max_batch=args.max_batch, delay=args.delay_us,
                                                             per_item=args.per_item_us))
    source = data / "in.npy"
    np.save(source, np.random.default_rng(0).standard_normal((args.rows, 256), dtype=np.float32))
    batch_us = args.delay_us + args.max_batch * args.per_item_us
    print(f"{args.rows:,} rows, batches of {args.max_batch} taking {batch_us} µs of sleep "
          f"(ideal {args.max_batch / batch_us * 1e6:,.0f} rows/s before the sleep's overshoot); {data}", flush=True)

    rates: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out = data / f"{name}-{r}"
            out.mkdir()
            env = {"FLEET_JOB_INPUT_DIRS": json.dumps([str(data)]), **configs[name]}
            fleet = Fleet(args.port, out, 180.0, [], repositories=[str(repo)], root=root_of[name], env=env)
            fleet.start()
            try:
                record = run_job(args.port, source, model="gpu")
            finally:
                fleet.stop(30.0)
            rate = args.rows / (record["finished_at"] - record["started_at"])
            rates[name].append(rate)
            print(f"round {r + 1} {name}: {rate:,.0f} rows/s", flush=True)
    first = statistics.median(rates[names[0]])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name}: {', '.join(f'{v:,.0f}' for v in values)} rows/s; median {median:,.0f} "
              f"({median / first:.2f}x {names[0]})")


if __name__ == "__main__":
    main()
