"""Scale-out: throughput against the number of workers (and gateways), with a model whose execution is time,
not CPU (the `sleep` backend: a batch of n takes a + b*n, like a GPU), so that N workers fit on this machine.

    .venv/bin/python bench/scale.py [--workers "1 2 4 8"] [--gateways "1"] [--delay-us 40000] [--per-item-us 2000]
                                    [--conc-per-worker 24] [--interval-ms 3000] [--port 19000] [--shared-port]
                                    [--out DIR]

For each (G gateways, N workers): starts its own embedded Redis (fleet.redis_server, unix socket, no AOF),
G `fleet gateway` processes on ports P, P+10, ... (gRPC off) and N `fleet worker` processes, all serving a
temporary repository with one model `sleepy` (INPUT0 FP32 [16] -> OUTPUT0, max_batch_size 8, dynamic
batching with a 2 ms queue delay, one instance per worker); waits until every worker logs the model ready
and every gateway answers ready; then runs G perf_analyzers at once (one per gateway, C = N x
--conc-per-worker split over them: `-i http -b 1 --concurrency-range C --measurement-interval MS
--stability-percentage 20 --max-trials 8`), reading the CPU time of every process from /proc around them.
With --shared-port the G gateways share port P (`--reuse-port`, as `fleet up --gateways G` runs them) and one
perf_analyzer drives them all: the kernel spreads its connections.
Stops what it started by PID (SIGTERM, then SIGKILL after 20 s). One table: infer/s (summed over the
gateways), its ratio to N x the one-worker rate of the same run, p50/p99, mean batch, and the CPU of the
gateways, workers, Redis and perf_analyzer as % of one core (so which saturates first shows).
Only 127.0.0.1 is contacted; every level is bounded by --max-trials and a 300 s kill.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from procs import TCP_LISTEN, cpu_ticks, rss_mib, tcp_ports  # bench/procs.py
from served import DEFAULT_PA, HOST, counts, http_get, port_in_use  # bench/served.py
from summary import print_table, read_level  # bench/summary.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fleet.redis_server import LocalServer, start_server  # noqa: E402

MODEL = "sleepy"
TICK = os.sysconf("SC_CLK_TCK")


def write_repository(root: Path, delay_us: int, per_item_us: int, queue_delay_us: int) -> Path:
    model = root / MODEL
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(f"""backend: "sleep"
max_batch_size: 8
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 16 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay_us}" }} }}
parameters {{ key: "execute_delay_per_item_us" value {{ string_value: "{per_item_us}" }} }}
""")
    return root


@dataclass
class Stack:
    """Redis, G gateways and N workers, started by this script and stopped by their PIDs."""

    repo: Path
    gateways: int
    workers: int
    port: int
    out: Path
    shared_port: bool = False
    data: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fleet-scale-")))
    redis: LocalServer | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def gateway_ports(self) -> list[int]:
        return [self.port] if self.shared_port else [self.port + 10 * g for g in range(self.gateways)]

    def start(self, timeout: float = 120.0) -> None:
        for p in self.gateway_ports():
            if port_in_use(p) or port_in_use(p + 2):
                raise SystemExit(f"127.0.0.1:{p} or :{p + 2} is in use: pick another --port")
        self.redis = start_server(self.data / "redis", appendonly=False, unix_socket=True)
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | {"FLEET_REDIS_URL": self.redis.local_url}
        common = [sys.executable, "-m", "fleet"]
        repo = ["--model-repository", str(self.repo)]
        for g in range(self.gateways):
            p = self.gateway_ports()[0 if self.shared_port else g]
            shared = ["--reuse-port", "--trace-file", str(self.data / f"trace-{g}.json")] if self.shared_port else []
            self._spawn(f"gateway-{g}", [*common, "gateway", *repo, "--http-port", str(p), "--metrics-port",
                                         str(p + 2), "--allow-grpc", "false", "--processes", "1", *shared], env)
        for w in range(self.workers):
            self._spawn(f"worker-{w}", [*common, "worker", *repo, "--device", "cpu"], env)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited with {proc.returncode}; see {self.out / (name + '.log')}")
            ready = f"model '{MODEL}' version 1 ready"
            logs = [(self.out / f"worker-{w}.log").read_text(errors="replace") for w in range(self.workers)]
            loaded = sum(ready in text for text in logs)
            # A shared port answers from either process: every gateway listening (a shared socket listens
            # once its process has started; connections made before go to those already listening, and
            # perf_analyzer's stay there), then ready 10 times over fresh connections.
            asks = 10 if self.shared_port and self.gateways > 1 else 1
            if (loaded == self.workers and self._gateways_listening()
                    and all(http_get(p, f"/v2/models/{MODEL}/ready", 2)[0] == 200
                            for p in self.gateway_ports() for _ in range(asks))):
                return
            time.sleep(0.5)
        raise SystemExit(f"not ready within {timeout:.0f}s; see the logs in {self.out}")

    def _gateways_listening(self) -> bool:
        ports = set(self.gateway_ports())
        return all(ports & set(tcp_ports(proc.pid, TCP_LISTEN))
                   for name, proc in self.procs.items() if name.startswith("gateway"))

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = (self.out / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def pids(self) -> dict[str, int]:
        out = {name: p.pid for name, p in self.procs.items()}
        if self.redis is not None:
            out["redis"] = self.redis.process.pid
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the session it leads: only what this script started
                proc.wait(10)
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.data, ignore_errors=True)


def measure(stack: Stack, conc: int, interval_ms: int, pa: str, out: Path) -> dict[str, Any]:
    """G perf_analyzers at once, one per gateway; the summed rate and the CPU of each role."""
    ports = stack.gateway_ports()
    shares = [conc // len(ports) + (1 if i < conc % len(ports) else 0) for i in range(len(ports))]
    pids = stack.pids()
    before_cpu = {name: cpu_ticks(pid) for name, pid in pids.items()}
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    before_counts = counts(ports[0], MODEL)
    t0 = time.monotonic()
    runs = []
    for i, (p, c) in enumerate(zip(ports, shares, strict=True)):
        base = out / f"{MODEL}_g{i}_c{c}"
        cmd = [pa, "-m", MODEL, "-i", "http", "-u", f"{HOST}:{p}", "-b", "1", "--concurrency-range", str(c),
               "--measurement-interval", str(interval_ms), "--stability-percentage", "20", "--max-trials", "8",
               "-f", str(base.with_suffix(".csv")), "--verbose-csv"]
        runs.append((base, subprocess.Popen(cmd, stdout=base.with_suffix(".txt").open("w"), stderr=subprocess.STDOUT)))
    for _, proc in runs:
        try:
            proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - t0
    rss = {name: rss_mib(pid) for name, pid in pids.items()}  # right after the load (bench/memory.py: peaks)
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    after_counts = counts(ports[0], MODEL)
    cpu = {name: (cpu_ticks(pid) - before_cpu[name]) / TICK / wall * 100 for name, pid in pids.items()}
    pa_cpu = ((after_children.ru_utime + after_children.ru_stime)
              - (before_children.ru_utime + before_children.ru_stime)) / wall * 100
    levels = [read_level(base, MODEL, c) for (base, _), c in zip(runs, shares, strict=True)]
    if any(lv.infer_s is None for lv in levels):
        raise SystemExit(f"a perf_analyzer run failed: see {out}")
    batch = None
    if before_counts and after_counts and after_counts[1] > before_counts[1]:
        batch = (after_counts[0] - before_counts[0]) / (after_counts[1] - before_counts[1])
    return {
        "infer_s": sum(lv.infer_s or 0 for lv in levels),
        "p50_ms": max(lv.p50_ms or 0 for lv in levels),
        "p99_ms": max(lv.p99_ms or 0 for lv in levels),
        "mean_batch": batch or 0.0,
        "gateway_cpu": sum(v for k, v in cpu.items() if k.startswith("gateway")),
        # Each gateway's share: with --shared-port, how evenly the kernel spread the connections.
        "gateway_cpu_each": [round(v) for k, v in sorted(cpu.items()) if k.startswith("gateway")],
        "worker_cpu": sum(v for k, v in cpu.items() if k.startswith("worker")),
        "redis_cpu": cpu.get("redis", 0.0),
        "pa_cpu": pa_cpu,
        "gateway_rss": sum(v for k, v in rss.items() if k.startswith("gateway")) / len(ports),
        "worker_rss": sum(v for k, v in rss.items() if k.startswith("worker")) / max(1, stack.workers),
    }


def main() -> None:
    p = argparse.ArgumentParser(description="throughput against workers and gateways (sleep backend)")
    p.add_argument("--workers", default="1 2 4 8")
    p.add_argument("--gateways", default="1")
    p.add_argument("--delay-us", type=int, default=40000, help="a: execution time of any batch (40 ms)")
    p.add_argument("--per-item-us", type=int, default=2000, help="b: execution time per item (2 ms)")
    p.add_argument("--queue-delay-us", type=int, default=2000, help="max_queue_delay_microseconds (2000)")
    p.add_argument("--conc-per-worker", type=int, default=24, help="perf_analyzer concurrency per worker (24)")
    p.add_argument("--interval-ms", type=int, default=3000)
    p.add_argument("--port", type=int, default=19000)
    p.add_argument("--shared-port", action="store_true", help="the gateways share one port (SO_REUSEPORT)")
    p.add_argument("--perf-analyzer", default=os.environ.get("PERF_ANALYZER", str(DEFAULT_PA)))
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    out = (a.out or ROOT / "bench" / "out" / time.strftime("scale-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    repo = write_repository(Path(tempfile.mkdtemp(prefix="fleet-scale-repo-")), a.delay_us, a.per_item_us,
                            a.queue_delay_us)
    ceiling = 8 / ((a.delay_us + 8 * a.per_item_us) / 1e6)
    print(f"sleepy: a batch of n takes {a.delay_us} + n x {a.per_item_us} us; one worker's ceiling "
          f"(full batches of 8) {ceiling:,.0f} infer/s", flush=True)
    results: list[tuple[int, int, int, dict[str, float]]] = []

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        for g in (int(x) for x in a.gateways.split()):
            for n in (int(x) for x in a.workers.split()):
                level_out = out / f"g{g}_n{n}"
                level_out.mkdir(exist_ok=True)
                stack = Stack(repo, g, n, a.port, level_out, shared_port=a.shared_port)
                try:
                    stack.start()
                    conc = n * a.conc_per_worker
                    r = measure(stack, conc, a.interval_ms, a.perf_analyzer, level_out)
                finally:
                    stack.stop()
                results.append((g, n, conc, r))
                (level_out / "result.json").write_text(json.dumps(r) + "\n")
                print(f"G={g} N={n} C={conc}: {r['infer_s']:,.0f} infer/s, p99 {r['p99_ms']:.1f} ms, batch "
                      f"{r['mean_batch']:.2f}, CPU gw {r['gateway_cpu']:.0f}% wk {r['worker_cpu']:.0f}% "
                      f"redis {r['redis_cpu']:.0f}% pa {r['pa_cpu']:.0f}% (gateways {r['gateway_cpu_each']})",
                      flush=True)
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    rows = []
    for g, n, conc, r in results:
        one = next((r1["infer_s"] for g1, n1, _, r1 in results if g1 == g and n1 == 1), None)
        ratio = f"{r['infer_s'] / (n * one):.2f}" if one else ""
        rows.append([str(g), str(n), str(conc), f"{r['infer_s']:,.0f}", ratio, f"{r['p50_ms']:.1f}",
                     f"{r['p99_ms']:.1f}", f"{r['mean_batch']:.2f}", f"{r['gateway_cpu']:.0f}",
                     f"{r['worker_cpu']:.0f}", f"{r['redis_cpu']:.0f}", f"{r['pa_cpu']:.0f}",
                     f"{r['gateway_rss']:.0f}", f"{r['worker_rss']:.0f}"])
    print_table(f"scale-out, sleepy a={a.delay_us} us b={a.per_item_us} us ({out})",
                ["G", "N", "C", "infer/s", "/ (N x one)", "p50 ms", "p99 ms", "batch", "gw CPU%", "workers CPU%",
                 "redis CPU%", "pa CPU%", "gw RSS MiB", "worker RSS MiB"], rows)


if __name__ == "__main__":
    main()
