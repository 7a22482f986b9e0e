"""Bulk jobs: the offline scenario against direct in-process compute, and the mixed scenario (a bulk job
saturating the workers while online requests come in) against online alone.

    .venv/bin/python bench/bulk.py [--items 200000] [--mixed-items 400000] [--mixed-format npy|jsonl]
                                   [--conc 4] [--port 18000]
                                   [--interval-ms 3000] [--out bench/out/bulk-TIME] [--skip-mixed]
                                   [--instances 1] [--direct-threads "1"] [--offline-passes 1]
                                   [--pack-batches K]   (a job's requests of K batches' rows: FLEET_JOB_PACK_BATCHES)

1. direct: `mlp` in this process (bench/direct.py: TorchScript, torch.set_num_threads(T) for each T of
   --direct-threads, 1 by default as the served config's INTRA_OP_THREAD_COUNT, inference_mode) at batch
   64 = mlp's max_batch_size, the size a bulk job packs its rows into: items/s, the ceiling (the best T's).
2. Starts `fleet up` (bench/served.py's Fleet: own session, stopped by PID; one worker, one job worker),
   serving `mlp` with --instances instances (model_repository/mlp's config with that count, in a
   temporary repository).
3. offline: --offline-passes jobs of --items random FP32 [256] rows (.npy in, .npy out, input read by the job
   worker from disk), each between two direct measurements (fleet idle): items/s = items / (finished_at -
   started_at) from the job record, against the mean of the direct rates before and after that job; the
   first job's every output row is compared with direct computation.
4. online idle: perf_analyzer -m mlp --concurrency-range C (3 windows of --interval-ms): p50/p99.
5. mixed: the same perf_analyzer run while a --mixed-items job runs on the bulk lane (rows as .npy, or with
   --mixed-format jsonl as JSONL lines, parsed and written by the job worker beside the online requests); the
   bulk job's items/s over the perf_analyzer run comes from its progress record sampled before and after.
Prints one table. All traffic goes to 127.0.0.1; every load is bounded (perf_analyzer --max-trials 3,
jobs by their item counts, a 600 s cap per job).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from direct import bench_mlp
from mlp_config import write_mlp_config
from served import DEFAULT_PA, HOST, ROOT, Fleet, api
from summary import print_table, read_level


def run_job(port: int, source: Path, *, wait: bool = True, fmt: str = "npy", model: str = "mlp") -> dict[str, Any]:
    record = api(port, "POST", "/v2/jobs", {"model": model, "input": str(source), "output": {"format": fmt}})
    return wait_job(port, record) if wait else record


def wait_job(port: int, record: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """The job's record once it completed; SystemExit if it ended otherwise or ran past `timeout_s` (then
    cancelled)."""
    deadline = time.monotonic() + timeout_s
    while record["state"] not in ("completed", "failed", "cancelled"):
        if time.monotonic() > deadline:
            api(port, "DELETE", f"/v2/jobs/{record['id']}")
            raise SystemExit(f"job {record['id']} still running after {timeout_s:.0f} s: cancelled")
        time.sleep(0.2)
        record = api(port, "GET", f"/v2/jobs/{record['id']}")
    if record["state"] != "completed":
        raise SystemExit(f"job {record['id']} ended {record['state']}: {record['error']}")
    return record


def best_direct(thread_counts: str, seconds: float) -> tuple[float, int]:
    """(items/s, torch threads) of the fastest direct compute of mlp at batch 64 over `thread_counts`."""
    best = (0.0, 1)
    for threads in (int(t) for t in thread_counts.split()):
        (batch, calls, elapsed), = bench_mlp(ROOT / "model_repository", [64], seconds, threads)
        print(f"direct mlp, batch 64, {threads} thread(s): {batch * calls / elapsed:,.0f} items/s", flush=True)
        best = max(best, (batch * calls / elapsed, threads))
    return best


def mlp_with_instances(root: Path, count: int) -> Path:
    """A repository holding model_repository/mlp with `count` instances (its model file linked)."""
    repo = root / "repo"
    write_mlp_config(repo / "mlp", count)
    (repo / "mlp" / "1").mkdir()
    (repo / "mlp" / "1" / "model.pt").symlink_to((ROOT / "model_repository" / "mlp" / "1" / "model.pt").resolve())
    return repo


def perf_analyzer(pa: str, port: int, conc: int, interval_ms: int, out: Path, tag: str) -> tuple[float, float, float]:
    """(infer/s, p50 ms, p99 ms) of one bounded perf_analyzer level on mlp."""
    base = out / tag
    base.mkdir(parents=True, exist_ok=True)
    cmd = [pa, "-m", "mlp", "-i", "http", "-u", f"{HOST}:{port}", "-b", "1", "--concurrency-range", str(conc),
           "--measurement-interval", str(interval_ms), "--stability-percentage", "100", "--max-trials", "3",
           "-f", str(base / f"mlp_c{conc}.csv"), "--verbose-csv"]
    with (base / f"mlp_c{conc}.txt").open("w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=300, check=True)
    level = read_level(base / f"mlp_c{conc}", "mlp", conc)
    return level.infer_s or 0.0, level.p50_ms or 0.0, level.p99_ms or 0.0


def main() -> None:
    p = argparse.ArgumentParser(description="bulk jobs: offline vs direct, mixed vs online alone")
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--mixed-items", type=int, default=400_000)
    p.add_argument("--mixed-format", choices=["npy", "jsonl"], default="npy",
                   help="the mixed scenario's job input: .npy rows, or JSONL lines (parsed and written by the job "
                        "worker, with its parsing helpers if any, beside the online requests)")
    p.add_argument("--conc", type=int, default=4)
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--interval-ms", type=int, default=3000)
    p.add_argument("--direct-seconds", type=float, default=5.0)
    p.add_argument("--direct-threads", default="1", help="torch thread counts for direct compute; the best is "
                   "the ceiling (default 1, as served)")
    p.add_argument("--instances", type=int, default=1, help="instances of mlp served (default 1, its config's)")
    p.add_argument("--out", type=Path)
    p.add_argument("--skip-mixed", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--jsonl-items", type=int, default=0,
                   help="also JSONL jobs of this many mlp lines (JSON in, JSON out), each pass between two direct "
                        "measurements")
    p.add_argument("--passes", type=int, default=1, help="JSONL passes (default 1)")
    p.add_argument("--offline-passes", type=int, default=1,
                   help="offline jobs, each between two direct measurements (default 1)")
    p.add_argument("--root", type=Path, default=ROOT, help="the fleet checkout to serve (before/after a change)")
    p.add_argument("--pack-batches", type=int, default=None,
                   help="batches of rows per job request (FLEET_JOB_PACK_BATCHES of the fleet served; default 4)")
    p.add_argument("--perf-analyzer", default=os.environ.get("PERF_ANALYZER", str(DEFAULT_PA)))
    a = p.parse_args()
    out = (a.out or ROOT / "bench" / "out" / time.strftime("bulk-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    direct_ips, threads = best_direct(a.direct_threads, a.direct_seconds)

    data = Path(tempfile.mkdtemp(prefix="fleet-bulk-"))
    rng = np.random.default_rng(0)
    offline_in = data / "offline.npy"
    np.save(offline_in, rng.standard_normal((a.items, 256), dtype=np.float32))
    # The job inputs are server-side files in `data`: a directory jobs may read.
    env = {"FLEET_JOB_INPUT_DIRS": json.dumps([str(data)])}
    if a.pack_batches is not None:
        env["FLEET_JOB_PACK_BATCHES"] = str(a.pack_batches)
    fleet = Fleet(a.port, out, 180.0, ["mlp"], env=env, root=a.root,
                  repositories=None if a.instances == 1 else [str(mlp_with_instances(data, a.instances))])

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    rows: list[list[str]] = []
    try:
        fleet.start()
        if not a.skip_offline:
            rows += offline_passes(a, fleet, offline_in, threads)
        if a.jsonl_items:
            rows += jsonl_passes(a, fleet, data, rng, threads)
        if not a.skip_mixed:
            ips, p50, p99 = perf_analyzer(a.perf_analyzer, a.port, a.conc, a.interval_ms, out, "idle")
            rows.append([f"online alone, C={a.conc}", "", "", "", f"{ips:,.0f}", f"{p50:.2f}", f"{p99:.2f}"])
            mixed_in = data / f"mixed.{a.mixed_format}"
            mixed = rng.standard_normal((a.mixed_items, 256), dtype=np.float32)
            if a.mixed_format == "jsonl":
                write_jsonl(mixed_in, mixed)
            else:
                np.save(mixed_in, mixed)
            del mixed
            job = run_job(a.port, mixed_in, wait=False, fmt=a.mixed_format)
            while api(a.port, "GET", f"/v2/jobs/{job['id']}")["done"] < 5_000:  # the bulk lane is saturated
                time.sleep(0.1)
            before, t0 = api(a.port, "GET", f"/v2/jobs/{job['id']}"), time.monotonic()
            ips, p50, p99 = perf_analyzer(a.perf_analyzer, a.port, a.conc, a.interval_ms, out, "mixed")
            after, t1 = api(a.port, "GET", f"/v2/jobs/{job['id']}"), time.monotonic()
            if after["state"] != "running":
                print(f"warning: the mixed job ended ({after['state']}) before perf_analyzer did; raise --mixed-items")
            bulk_ips = (after["done"] - before["done"]) / (t1 - t0)
            api(a.port, "DELETE", f"/v2/jobs/{job['id']}")
            rows.append([f"bulk ({a.mixed_format}) + online C={a.conc}", f"{a.mixed_items:,}", f"{bulk_ips:,.0f}",
                         f"{bulk_ips / direct_ips:.2f}x", f"{ips:,.0f}", f"{p50:.2f}", f"{p99:.2f}"])
    finally:
        fleet.stop(30.0)
        shutil.rmtree(data, ignore_errors=True)
    rows.insert(0, [f"direct in-process, batch 64, {threads} thread(s)", "", f"{direct_ips:,.0f}", "1.00x", "", "", ""])
    print_table(f"bulk jobs on mlp ({out})",
                ["scenario", "items", "bulk items/s", "vs direct", "online infer/s", "p50 ms", "p99 ms"], rows)


def offline_passes(a: argparse.Namespace, fleet: Fleet, source: Path, threads: int) -> list[list[str]]:
    """--offline-passes jobs of the .npy input (.npy out), each between two direct measurements."""
    return passes_between_direct(a, threads, "offline", a.offline_passes, a.items, lambda: run_job(a.port, source),
                                 lambda record: check_output(source, fleet, record))


def jsonl_passes(a: argparse.Namespace, fleet: Fleet, data: Path, rng: np.random.Generator,
                 threads: int) -> list[list[str]]:
    """JSONL jobs (a KServe /infer body per line, 256 floats as json.dumps writes them; a JSON line out),
    each between two direct measurements."""
    source = data / "offline.jsonl"
    x = rng.standard_normal((a.jsonl_items, 256), dtype=np.float32)
    write_jsonl(source, x)
    return passes_between_direct(a, threads, "JSONL", a.passes, a.jsonl_items,
                                 lambda: run_job(a.port, source, fmt="jsonl"),
                                 lambda record: check_jsonl(x, fleet, record))


def write_jsonl(path: Path, x: np.ndarray) -> None:
    """One /infer body a row of `x`, its 256 floats as json.dumps writes them (17 digits: what users have)."""
    with path.open("w") as f:
        for row in x:
            f.write(json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 256],
                                            "data": row.tolist()}]}) + "\n")


def passes_between_direct(a: argparse.Namespace, threads: int, name: str, passes: int, items: int,
                          job: Callable[[], dict[str, Any]], check: Callable[[dict[str, Any]], None]
                          ) -> list[list[str]]:
    """`passes` runs of `job`, each between two direct measurements in this process while fleet idles (the
    one after a job is the next one's before): each job's ratio is against the mean of the direct rates
    around that very job. The first job's output is checked against direct computation."""
    def direct() -> float:
        (batch, calls, seconds), = bench_mlp(ROOT / "model_repository", [64], a.direct_seconds, threads)
        return batch * calls / seconds

    rows = []
    before = direct()
    for n in range(passes):
        record = job()
        ips = record["done"] / (record["finished_at"] - record["started_at"])
        after = direct()
        ratio = ips / ((before + after) / 2)
        if n == 0:
            check(record)
        print(f"{name} pass {n + 1}: {ips:,.0f} items/s, direct {before:,.0f} / {after:,.0f}: {ratio:.2f}x", flush=True)
        rows.append([f"{name} job, pass {n + 1}", f"{items:,}", f"{ips:,.0f}",
                     f"{ratio:.2f}x (direct {before:,.0f}/{after:,.0f})", "", "", ""])
        before = after
    return rows


def check_jsonl(x: np.ndarray, fleet: Fleet, record: dict[str, Any], rows: int = 2000) -> None:
    """The first `rows` output lines equal direct computation (float32 read back from the JSON text)."""
    import warnings

    import torch

    assert fleet.data_dir is not None
    output = fleet.data_dir / "jobs" / record["id"] / "output.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.load(str(ROOT / "model_repository" / "mlp" / "1" / "model.pt")).eval()
    with output.open() as f:
        got = [json.loads(next(f)) for _ in range(min(rows, len(x)))]
    y = np.array([g["outputs"][0]["data"] for g in got], dtype=np.float32)
    with torch.inference_mode():
        ref = model(torch.from_numpy(x[:len(y)])).numpy()
    if not np.allclose(y, ref, rtol=1e-5, atol=1e-5):
        raise SystemExit("JSONL job output differs from direct computation")
    print(f"JSONL output checked: {len(y):,} lines equal direct computation", flush=True)


def check_output(source: Path, fleet: Fleet, record: dict[str, Any]) -> None:
    """Every output row equals direct computation (the job's output file, on this machine's disk)."""
    import warnings

    import torch

    assert fleet.data_dir is not None
    output = fleet.data_dir / "jobs" / record["id"] / "output.npy"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.load(str(ROOT / "model_repository" / "mlp" / "1" / "model.pt")).eval()
    x, y = np.load(source, mmap_mode="r"), np.load(output, mmap_mode="r")
    with torch.inference_mode():
        for start in range(0, len(x), 8192):
            ref = model(torch.from_numpy(np.array(x[start:start + 8192]))).numpy()
            if not np.allclose(y[start:start + 8192], ref, rtol=1e-5, atol=1e-5):
                raise SystemExit(f"job output differs from direct computation near row {start}")
    print(f"output checked: {len(x):,} rows equal direct computation", flush=True)


if __name__ == "__main__":
    sys.exit(main())
