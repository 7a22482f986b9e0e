"""Direct in-process throughput, no server: the compute limit the served numbers are measured against.

    .venv/bin/python bench/direct.py [--seconds 2] [--batches 1 8 32 64] [--models mlp double]
                                     [--threads 1] [--repo model_repository] [--csv FILE]

- `mlp`: torch.jit.load of REPO/mlp/1/model.pt (the TorchScript file fleet serves; generate it with
  `python -m workers.generate_models model_repository`), torch.set_num_threads(1), torch.inference_mode().
- `double`: numpy `x * 2` on FP32 [batch, 16], as bench/model_repository/double/1/model.py computes it.

Each (model, batch) cell warms up, then calls the model back to back for --seconds (wall clock) and reports
items/s (= batch * calls / s) and ms per call. Bounded: len(models) * len(batches) * (seconds + warm-up).
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from summary import print_table  # bench/summary.py (bench/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent


def measure(fn: Callable[[], Any], seconds: float, warmup: int = 20) -> tuple[int, float]:
    """Calls fn back to back for `seconds`; returns (calls, elapsed seconds)."""
    for _ in range(warmup):
        fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el >= seconds:
            return n, el


def bench_mlp(repo: Path, batches: list[int], seconds: float, threads: int) -> list[tuple[int, int, float]]:
    import torch

    torch.set_num_threads(threads)
    path = repo / "mlp" / "1" / "model.pt"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `python -m workers.generate_models {repo}` first")
    with warnings.catch_warnings():  # torch 2.13 deprecates torch.jit.*; it is still the served format
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.load(str(path), map_location="cpu").eval()
    rows = []
    with torch.inference_mode():
        for bs in batches:
            x = torch.randn(bs, 256)
            n, el = measure(lambda x=x: model(x), seconds)
            rows.append((bs, n, el))
    return rows


def bench_double(batches: list[int], seconds: float) -> list[tuple[int, int, float]]:
    import numpy as np

    rng = np.random.default_rng(0)
    rows = []
    for bs in batches:
        x = rng.standard_normal((bs, 16), dtype=np.float32)
        n, el = measure(lambda x=x: x * 2, seconds, warmup=100)
        rows.append((bs, n, el))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="measured time per cell (default 2)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--models", nargs="+", default=["mlp", "double"], choices=["mlp", "double"])
    p.add_argument("--threads", type=int, default=1, help="torch threads for mlp (default 1, as served)")
    p.add_argument("--repo", type=Path, default=ROOT / "model_repository", help="repository holding mlp/1/model.pt")
    p.add_argument("--csv", type=Path, help="also write model,batch,items_per_s,ms_per_call here")
    a = p.parse_args()

    results: list[tuple[str, int, int, float]] = []
    for m in a.models:
        rows = bench_mlp(a.repo, a.batches, a.seconds, a.threads) if m == "mlp" else bench_double(a.batches, a.seconds)
        results += [(m, bs, n, el) for bs, n, el in rows]

    extra = f"torch threads={a.threads}, " if "mlp" in a.models else ""
    print_table(
        f"direct in-process throughput ({extra}{a.seconds:g} s per cell)",
        ["model", "batch", "items/s", "calls/s", "ms/call"],
        [[m, str(bs), f"{n * bs / el:,.0f}", f"{n / el:,.0f}", f"{1000 * el / n:.4f}"] for m, bs, n, el in results],
    )
    if a.csv:
        a.csv.parent.mkdir(parents=True, exist_ok=True)
        with a.csv.open("w") as f:
            f.write("model,batch,items_per_s,ms_per_call\n")
            for m, bs, n, el in results:
                f.write(f"{m},{bs},{n * bs / el:.0f},{1000 * el / n:.4f}\n")


if __name__ == "__main__":
    main()
