"""The served system under perf_analyzer, measured exactly as the Triton anchor's bench_pa.sh measures Triton.

    .venv/bin/python bench/served.py [--port 18000] [--conc "1 8 32"] [--interval-ms 3000]
                                     [--models "double mlp"] [--out bench/out/served-TIME] [--no-start]
                                     [--root CHECKOUT [--python PY]] [--protocol http|grpc]

1. Unless --no-start: starts `fleet up` itself from the repository root (or from --root CHECKOUT: another
   checkout's fleet, e.g. a `git worktree` of an older commit, measured by this script the same way),
       PY -m fleet up --model-repository <temp dir linking the measured models> --http-port P --metrics-port P+2
           [--grpc-port P+1] --data-dir <fresh temp dir>
   (PY: --python, else CHECKOUT/.venv/bin/python if there is one, else this checkout's; the models are always
   this checkout's, from model_repository and bench/model_repository, so both measure the same models), in its
   own session (PID and log in
   OUT/fleet.pid, OUT/fleet.log), and waits (at most --start-timeout s) until GET /v2/health/ready and
   GET /v2/models/M/ready answer 200 for every model measured.
   With --check N: the anchor kit's check_models.py PORT N first (N simultaneous 1-item requests per model, each
   answer compared with the locally computed reference; checks 'double' and 'mlp' both); stops on a wrong answer.
2. For each model, each concurrency C: GET /v2/models/M/stats, then
       perf_analyzer -m M -i http -u 127.0.0.1:P -b 1 --concurrency-range C --measurement-interval MS
   (--protocol grpc, or PA_PROTOCOL=grpc as the anchor's bench_pa.sh reads it: -i grpc -u 127.0.0.1:P+1, Triton's
   layout; fleet's gRPC port is P+1 whenever the checkout started has one)
           --stability-percentage 20 --max-trials 12 -f OUT/M_cC.csv --verbose-csv      (> OUT/M_cC.txt)
   (killed after --pa-timeout s), then /stats again; the difference goes to OUT/M_cC.stats.json.
   OUT/load.txt gets the load average and the busiest processes before each level, as bench_pa.sh writes.
3. Stops fleet: SIGTERM to the PID it started (fleet up then stops its gateway, workers and Redis); SIGKILL of
   that process group only if it is still there after --stop-timeout s. Removes the temp data dir.
4. Prints the table: model, C, infer/s, p50 ms, p99 ms (perf_analyzer, client side), mean batch the workers
   formed (Δinference_count / Δexecution_count over the level), server queue / compute infer ms (perf_analyzer's
   server-side averages). The same folder layout as bench_pa.sh: bench/summary.py reads both.

--no-start measures a server already running on 127.0.0.1:--port (nothing is started or stopped).
Only 127.0.0.1 is contacted. Every level is bounded by perf_analyzer's --max-trials and --pa-timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from summary import print_levels, read_dir  # bench/summary.py

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PA = ROOT / ".tools" / "perf_analyzer" / "perf_analyzer"
# The Triton anchor kit sits next to the checkout (env K overrides).
ANCHOR = Path(os.environ.get("K", str(ROOT.parent / "shared" / "anchors" / "triton")))
HOST = "127.0.0.1"


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def api(port: int, method: str, path: str, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON request to the served system (job and settings routes); its JSON answer."""
    data = None if doc is None else json.dumps(doc).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def counts(port: int, model: str) -> tuple[int, int] | None:
    """(inference_count, execution_count) summed over the model's versions, from Triton's statistics extension."""
    status, body = http_get(port, f"/v2/models/{model}/stats")
    if status != 200:
        return None
    try:
        stats = json.loads(body)["model_stats"]
        return (sum(int(s.get("inference_count", 0)) for s in stats),
                sum(int(s.get("execution_count", 0)) for s in stats))
    except (ValueError, KeyError, TypeError):
        return None


def log_load(out: Path, model: str, conc: int) -> None:
    """Like bench_pa.sh: load average and the busiest processes (second `top` sample, 1 s) before a level."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    lines = [f"== {model} c={conc} {time.strftime('%H:%M:%S')} loadavg {load}"]
    try:
        top = subprocess.run(["top", "-b", "-n", "2", "-d", "1", "-w", "160"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
        starts = [i for i, ln in enumerate(top) if ln.startswith("top -")]
        if len(starts) >= 2:
            lines += top[starts[1] + 6: starts[1] + 12]
    except (OSError, subprocess.SubprocessError):
        pass
    with (out / "load.txt").open("a") as f:
        f.write("\n".join(lines) + "\n")


def default_python(root: Path) -> str:
    """root's own venv Python if it has one, else this checkout's: either imports root's fleet, as `fleet up`
    runs in root with root first on PYTHONPATH (Fleet.start)."""
    own = root / ".venv" / "bin" / "python"
    return str(own if own.exists() else ROOT / ".venv" / "bin" / "python")


def measured_repository(models: list[str]) -> Path:
    """A temporary model repository linking just `models` from this checkout's repositories."""
    repo = Path(tempfile.mkdtemp(prefix="fleet-bench-repo-"))
    for name in models:
        source = next((d / name for d in (ROOT / "model_repository", ROOT / "bench" / "model_repository")
                       if (d / name / "config.pbtxt").exists()), None)
        if source is None:
            raise SystemExit(f"no model {name!r} in model_repository or bench/model_repository")
        (repo / name).symlink_to(source.resolve(), target_is_directory=True)
    return repo


class Fleet:
    """`fleet up` started by this script, stopped by its PID."""

    def __init__(self, port: int, out: Path, start_timeout: float, models: list[str],
                 env: dict[str, str] | None = None, repositories: list[str] | None = None,
                 root: Path = ROOT, python: str | None = None, protocol: str = "http") -> None:
        self.port, self.out, self.start_timeout, self.models = port, out, start_timeout, models
        self.env = env or {}
        # Absolute: `fleet up` runs in `root`, which may be another checkout. By default a repository of the
        # measured models alone (links to this checkout's model_repository and bench/model_repository): an
        # older checkout (--root) need not know every backend there, and nothing unmeasured loads beside them.
        self.repositories = repositories or [str(measured_repository(models))]
        self.root = root.resolve()
        self.python = python or default_python(self.root)
        # An older checkout (--root) may have no gRPC service: it is then measured over HTTP only.
        self.grpc = (self.root / "fleet" / "grpc_flags.py").exists()
        if protocol == "grpc" and not self.grpc:
            raise SystemExit(f"{self.root} serves no gRPC: measure it with --protocol http")
        self.proc: subprocess.Popen[bytes] | None = None
        self.data_dir: Path | None = None

    def start(self) -> None:
        for p in (self.port, self.port + 1, self.port + 2) if self.grpc else (self.port, self.port + 2):
            if port_in_use(p):
                raise SystemExit(f"127.0.0.1:{p} is already in use: pick another --port (or --no-start to measure it)")
        self.data_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
        cmd = [self.python, "-m", "fleet", "up",
               *[arg for repo in self.repositories for arg in ("--model-repository", repo)],
               "--http-port", str(self.port), "--metrics-port", str(self.port + 2),
               *(["--grpc-port", str(self.port + 1)] if self.grpc else []),
               "--data-dir", str(self.data_dir)]
        log = (self.out / "fleet.log").open("wb")
        env = os.environ | self.env
        if self.root != ROOT:  # that checkout's packages first in every process, whatever its working directory
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.root), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        (self.out / "fleet.pid").write_text(f"{self.proc.pid}\n")
        print(f"started fleet up in {self.root} (pid {self.proc.pid}, log {self.out / 'fleet.log'}): {' '.join(cmd)}",
              flush=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.start_timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"fleet up exited with {self.proc.returncode} before it was ready; "
                                 f"see {self.out / 'fleet.log'}")
            if http_get(self.port, "/v2/health/ready", 2)[0] == 200 and all(
                    http_get(self.port, f"/v2/models/{m}/ready", 2)[0] == 200 for m in self.models):
                print(f"fleet ready after {time.monotonic() - t0:.1f}s on {HOST}:{self.port}", flush=True)
                return
            time.sleep(0.5)
        raise SystemExit(f"fleet not ready within {self.start_timeout:.0f}s; see {self.out / 'fleet.log'}")

    def stop(self, timeout: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
                print(f"stopped fleet (pid {self.proc.pid}, rc {self.proc.returncode})", flush=True)
            except subprocess.TimeoutExpired:
                print(f"fleet (pid {self.proc.pid}) still running after {timeout:.0f}s: SIGKILL to its process group",
                      flush=True)
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group it leads: only what this script started
                self.proc.wait(10)
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None


def pa_url(port: int, protocol: str = "http") -> str:
    """perf_analyzer's -u for a server whose HTTP port is `port`: gRPC is served on the port after it (`Fleet`,
    the anchor kit's native Triton). The statistics extension stays on HTTP."""
    return f"{HOST}:{port + 1 if protocol == 'grpc' else port}"


def run_level(pa: str, port: int, model: str, conc: int, interval_ms: int, out: Path, timeout: float,
              protocol: str = "http") -> None:
    base = out / f"{model}_c{conc}"
    for suffix in (".txt", ".csv", ".stats.json"):
        base.with_suffix(suffix).unlink(missing_ok=True)
    log_load(out, model, conc)
    before = counts(port, model)
    cmd = [pa, "-m", model, "-i", protocol, "-u", pa_url(port, protocol), "-b", "1", "--concurrency-range", str(conc),
           "--measurement-interval", str(interval_ms), "--stability-percentage", "20", "--max-trials", "12",
           "-f", str(base.with_suffix(".csv")), "--verbose-csv"]
    with base.with_suffix(".txt").open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:  # subprocess.run kills perf_analyzer (the child it started)
            f.write(f"\nperf_analyzer killed after {timeout:.0f}s\n")
            rc = 124
    after = counts(port, model)
    if before and after:
        d = {"before": before, "after": after, "d_inference_count": after[0] - before[0],
             "d_execution_count": after[1] - before[1]}
        base.with_suffix(".stats.json").write_text(json.dumps(d) + "\n")
    txt = base.with_suffix(".txt").read_text(errors="replace")
    lines = txt.strip().splitlines()
    tp = next((ln.strip() for ln in lines if "throughput:" in ln), lines[-1] if lines else "no output")
    with open("/proc/loadavg") as fl:
        load1 = fl.read().split()[0]
    print(f"rc={rc} {model} c={conc} load1={load1}: {tp}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description="fleet under perf_analyzer, as the Triton anchor's bench_pa.sh")
    p.add_argument("--port", type=int, default=18000, help="HTTP port (metrics on port+2); default 18000")
    p.add_argument("--conc", default="1 8 32", help='concurrency levels, e.g. "1 8 32"')
    p.add_argument("--interval-ms", type=int, default=3000, help="perf_analyzer --measurement-interval (3000)")
    p.add_argument("--models", default="double mlp", help='models, e.g. "double mlp"')
    p.add_argument("--out", type=Path, help="output folder (default bench/out/served-YYYYmmdd-HHMMSS)")
    p.add_argument("--no-start", action="store_true", help="measure a server already running on --port")
    p.add_argument("--root", type=Path, default=ROOT,
                   help="the checkout whose fleet to start (default: this one), e.g. a git worktree of an older commit")
    p.add_argument("--python", help="the Python that runs it (default: ROOT/.venv/bin/python, else this one's)")
    p.add_argument("--perf-analyzer", default=os.environ.get("PERF_ANALYZER", str(DEFAULT_PA)))
    p.add_argument("--protocol", choices=["http", "grpc"], default=os.environ.get("PA_PROTOCOL", "http"),
                   help="perf_analyzer -i (default $PA_PROTOCOL, else http); grpc measures port+1")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="first run the anchor's check_models.py PORT N (answers right, also batched); 0 = skip")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--stop-timeout", type=float, default=30.0)
    p.add_argument("--pa-timeout", type=float, default=300.0, help="kill one perf_analyzer run after this (300)")
    a = p.parse_args()
    concs = [int(c) for c in a.conc.replace(",", " ").split()]
    models = a.models.replace(",", " ").split()
    out = (a.out or ROOT / "bench" / "out" / time.strftime("served-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    fleet = None if a.no_start else Fleet(a.port, out, a.start_timeout, models, root=a.root, python=a.python,
                                          protocol=a.protocol)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # so `finally` stops fleet when this script is stopped
    try:
        if fleet:
            fleet.start()
        elif http_get(a.port, "/v2/health/ready")[0] != 200:
            raise SystemExit(f"nothing ready on {HOST}:{a.port} (--no-start)")
        if a.check:
            # the anchor's correctness check: N simultaneous 1-item requests per model, compared with the reference
            cmd = [sys.executable, str(ANCHOR / "check_models.py"), str(a.port), str(a.check)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            (out / "check.txt").write_text(r.stdout + r.stderr)
            print((r.stdout + r.stderr).strip() or f"check_models.py rc={r.returncode}", flush=True)
            if r.returncode:
                raise SystemExit(f"check_models.py failed (rc {r.returncode}): see {out / 'check.txt'}")
        for model in models:
            for c in concs:
                run_level(a.perf_analyzer, a.port, model, c, a.interval_ms, out, a.pa_timeout, a.protocol)
    finally:
        if fleet:
            fleet.stop(a.stop_timeout)
    print_levels(f"fleet on {HOST}:{a.port}, {a.protocol} ({out})", read_dir(out, models))


if __name__ == "__main__":
    main()
