"""fleet on a CUDA host: `fleet up` serving `mlp` on KIND_GPU, its outputs against the same model on the
CPU, and perf_analyzer against it with G gateway processes sharing the ports (`--gateways G`), W worker
processes on the one GPU (`--workers W`) and I instances of the model in each (`count: I`).

    python bench/gpu_check.py [--gateways "1 4"] [--workers "1 2"] [--instances "1 2"] [--conc "1 32"]
                              [--kind KIND_GPU] [--port 19300] [--out DIR]

For each G, W and I: a repository in a temporary directory holding `mlp` (model_repository/mlp's config
with its instance group's kind set to --kind and its count to I; the TorchScript file written by
workers.generate_models with the torch at hand), `fleet up --workers W --job-workers 0 --gateways G` on it
(every worker on the first GPU when the host has one: fleet/launcher.py hands devices out in turn), ready
once every gateway listens and 20 fresh connections in a row say so; then 64 rows of seeded random input
through HTTP (JSON), compared with the eager model (seed 0) on the CPU; then perf_analyzer (`-i http
-b 1 --concurrency-range C`, 2 s windows, at most 6 trials) at each C, with the model's statistics
before and after for the mean batch, and the GPU's readings on the metrics port. Stops `fleet up` with
SIGINT (its children and server with it) and prints one JSON line per G and C, and a table. --kind
KIND_CPU runs the same on a machine without a GPU (the check of this script itself). Only 127.0.0.1 is
contacted; every wait is bounded.
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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.mlp_config import write_mlp_config  # noqa: E402
from bench.procs import TCP_LISTEN, fleet_children, stop, tcp_ports  # noqa: E402
from bench.summary import read_level  # noqa: E402
from workers.generate_models import build_mlp, ensure_models  # noqa: E402

DEFAULT_PA = ROOT / ".tools" / "perf_analyzer" / "perf_analyzer"
HOST = "127.0.0.1"


def http(port: int, path: str, body: bytes | None = None, timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=body, method="POST" if body else "GET",
                                 headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def repository(root: Path, kind: str, instances: int) -> Path:
    repo = root / "repo"
    write_mlp_config(repo / "mlp", instances, kind)
    ensure_models(repo)
    return repo


def gateways_listening(up_pid: int, port: int) -> int:
    """How many of `fleet up`'s gateway processes listen on `port`."""
    return sum(port in tcp_ports(pid, TCP_LISTEN) for pid in fleet_children(up_pid, "gateway"))


def loaded_by(metrics_port: int) -> int:
    """How many live workers serve `mlp` (its `fleet_model_workers` gauge; 0 if it cannot be read)."""
    status, body = http(metrics_port, "/metrics")
    for line in body.decode(errors="replace").splitlines() if status == 200 else []:
        if line.startswith('fleet_model_workers{model="mlp",version="1"}'):
            return int(float(line.split()[-1]))
    return 0


def gpu_readings(metrics_port: int) -> list[str]:
    """The workers' NVML readings, as the gateway serves them (none on a host without a GPU)."""
    lines = http(metrics_port, "/metrics")[1].decode(errors="replace").splitlines()
    return [line for line in lines if line.startswith(("nv_gpu_utilization", "nv_gpu_memory_used_bytes"))]


def counts(port: int) -> tuple[int, int]:
    status, body = http(port, "/v2/models/mlp/stats")
    stats = json.loads(body)["model_stats"][0] if status == 200 else {}
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def check_outputs(port: int) -> float:
    """Largest |served - CPU eager| over 64 seeded rows."""
    import torch

    rows = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [64, 256],
                                   "data": rows.ravel().tolist()}]}).encode()
    status, reply = http(port, "/v2/models/mlp/infer", body, timeout=60)
    if status != 200:
        raise SystemExit(f"infer answered {status}: {reply[:500]!r}")
    served = np.array(json.loads(reply)["outputs"][0]["data"], dtype=np.float32).reshape(64, 256)
    with torch.inference_mode():
        expected = build_mlp()(torch.from_numpy(rows)).numpy()
    return float(np.abs(served - expected).max())


def run_one(gateways: int, workers: int, instances: int, concs: list[int], kind: str, port: int, pa: str,
            out: Path, ready_s: float) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="fleet-gpu-check-"))
    repo = repository(work, kind, instances)
    name = f"g{gateways}_w{workers}_i{instances}"
    log = out / f"fleet-up-{name}.log"
    cmd = [sys.executable, "-m", "fleet", "up", "--model-repository", str(repo), "--data-dir", str(work / "data"),
           "--http-port", str(port), "--metrics-port", str(port + 2), "--grpc-port", str(port + 1),
           "--workers", str(workers), "--job-workers", "0", "--gateways", str(gateways)]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FLEET_REDIS_URL")}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    rows: list[dict[str, Any]] = []
    try:
        # Every gateway listening first: connections made while some still start go to the others, and
        # perf_analyzer's stay there for the whole run.
        deadline, in_a_row = time.monotonic() + ready_s, 0
        while in_a_row < 20:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"fleet up not ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            listening = gateways_listening(proc.pid, port) == gateways
            ready = (listening and loaded_by(port + 2) == workers
                     and http(port, "/v2/models/mlp/ready", timeout=5)[0] == 200)
            in_a_row = in_a_row + 1 if ready else 0
            time.sleep(0.02 if in_a_row else 0.5)
        text = log.read_text(errors="replace")
        device = "cuda" if "on cuda:" in text else "cpu"
        max_diff = check_outputs(port)
        for conc in concs:
            base = out / f"mlp_{name}_c{conc}"
            before = counts(port)
            pa_cmd = [pa, "-m", "mlp", "-i", "http", "-u", f"{HOST}:{port}", "-b", "1", "--concurrency-range",
                      str(conc), "--measurement-interval", "2000", "--stability-percentage", "20",
                      "--max-trials", "6", "-f", str(base.with_suffix(".csv")), "--verbose-csv"]
            with base.with_suffix(".txt").open("w") as f:
                pa_proc = subprocess.Popen(pa_cmd, stdout=f, stderr=subprocess.STDOUT)
                try:
                    time.sleep(3)  # into its first window: the workers' NVML readings under load
                    gpu = gpu_readings(port + 2)
                    pa_proc.wait(120)
                except subprocess.TimeoutExpired:
                    stop(pa_proc, signal.SIGKILL, 10)
            after = counts(port)
            level = read_level(base, "mlp", conc)
            batches = after[1] - before[1]
            rows.append({"gateways": gateways, "workers": workers, "instances": instances, "conc": conc,
                         "worker_device": device, "max_abs_diff": max_diff,
                         "infer_s": level.infer_s, "p50_ms": level.p50_ms, "p99_ms": level.p99_ms,
                         "compute_ms": level.compute_ms, "queue_ms": level.queue_ms,
                         "mean_batch": (after[0] - before[0]) / batches if batches else None, "gpu_metrics": gpu})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(proc, signal.SIGINT)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description="fleet on a CUDA host: mlp on the GPU, checked and measured")
    p.add_argument("--gateways", default="1 4")
    p.add_argument("--workers", default="1", help="worker processes (fleet up hands the host's GPUs out in turn: "
                   "all on the one GPU of a one-GPU host)")
    p.add_argument("--instances", default="1", help="instances of mlp in each worker")
    p.add_argument("--conc", default="1 32")
    p.add_argument("--kind", default="KIND_GPU", choices=["KIND_GPU", "KIND_CPU"])
    p.add_argument("--port", type=int, default=19300)
    p.add_argument("--ready-timeout", type=float, default=180.0, help="seconds for fleet up to serve (default 180)")
    p.add_argument("--perf-analyzer", default=os.environ.get("PERF_ANALYZER", str(DEFAULT_PA)))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / time.strftime("gpu-%Y%m%d-%H%M%S"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for g in (int(x) for x in a.gateways.split()):
        for w in (int(x) for x in a.workers.split()):
            for i in (int(x) for x in a.instances.split()):
                rows += run_one(g, w, i, [int(c) for c in a.conc.split()], a.kind, a.port, a.perf_analyzer, a.out,
                                a.ready_timeout)
                (a.out / "gpu_check.json").write_text(json.dumps(rows, indent=1))  # kept if a timeout cuts the rest
    print(f"{'G':>2} {'W':>2} {'I':>2} {'C':>3} {'device':>6} {'max|diff|':>9} {'infer/s':>9} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'compute':>7} {'batch':>6} {'GPU util':>8}")
    for r in rows:
        def f(v: Any, spec: str) -> str:
            return format(v, spec) if isinstance(v, (int, float)) else "-"
        util = [float(line.split()[-1]) for line in r["gpu_metrics"] if line.startswith("nv_gpu_utilization")]
        print(f"{r['gateways']:>2} {r['workers']:>2} {r['instances']:>2} {r['conc']:>3} {r['worker_device']:>6} "
              f"{f(r['max_abs_diff'], '9.2e')} {f(r['infer_s'], '9,.0f')} {f(r['p50_ms'], '7.2f')} "
              f"{f(r['p99_ms'], '7.2f')} {f(r['compute_ms'], '7.3f')} {f(r['mean_batch'], '6.2f')} "
              f"{f(max(util) if util else None, '8.2f')}")


if __name__ == "__main__":
    main()
