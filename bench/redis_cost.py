"""Valkey's time per request, by command, and (with --trace) where a request's time goes, hop by hop:
this checkout's fleet against another's (--base-root), alternated.

    .venv/bin/python bench/redis_cost.py [--model mlp] [--conc 1] [--seconds 4] [--port 18100]
                                         [--systems "fleet-base fleet fleet-base fleet"] [--base-root CHECKOUT]
                                         [--trace] [--protocol http|grpc] [--out DIR]
    .venv/bin/python bench/redis_cost.py --fold-only   (no fleet: a batch's statistics write and fold, alone)

For each system in turn (started by bench/served.py's Fleet, stopped by its PID): a warm-up perf_analyzer run,
`CONFIG RESETSTAT` on the embedded Valkey (its Unix socket in the data dir), perf_analyzer at --conc for
--seconds, then `INFO commandstats`: each command's calls and µs per request (the requests from the model's
statistics over the same run). Valkey's own time is a count of its CPU, not of the host's speed, so it
compares across runs far better than throughput does on this VM. With --trace, the same run is traced
(TIMESTAMPS, one request in 10) and the median of each hop between trace points is printed; the hops'
ratio to the compute hop is what to compare across runs on a noisy host. --fold-only: 1,000 one-row batches'
statistics into an embedded Valkey, as the worker logs them and as the script before the log added them, with
the fold's time (Valkey's own, per entry). Only 127.0.0.1 is contacted;
every perf_analyzer run is bounded (--max-trials, a timeout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import redis
from served import DEFAULT_PA, ROOT, Fleet, api, counts, pa_url  # bench/served.py

from fleet import trace_points as tp

# The trace points an HTTP request crosses, in order; compute as one hop (fleet/trace_points.py).
HOPS = (tp.HTTP_RECV_START, tp.REQUEST_START, tp.QUEUE_START, tp.WORKER_READ, tp.BATCH_FORMED, tp.COMPUTE_START,
        tp.COMPUTE_END, tp.REPLY_WRITE, tp.REPLY_RECEIVED, tp.REQUEST_END, tp.HTTP_SEND_END)


def perf_analyzer(port: int, model: str, conc: int, ms: int, protocol: str = "http") -> str:
    cmd = [str(DEFAULT_PA), "-m", model, "-i", protocol, "-u", pa_url(port, protocol), "-b", "1", "--concurrency-range",
           str(conc), "--measurement-interval", str(ms), "--max-trials", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return next((ln.strip() for ln in done.stdout.splitlines() if "throughput:" in ln), "no throughput line")


def hop_medians(trace_file: Path, hops_: tuple[str, ...] = HOPS) -> dict[str, float]:
    stamps: dict[object, dict[str, int]] = {}
    for line in filter(str.strip, trace_file.read_text().splitlines()):
        doc = json.loads(line)
        for t in doc if isinstance(doc, list) else [doc]:
            stamps.setdefault(t["id"], {}).update({x["name"]: x["ns"] for x in t.get("timestamps", [])})
    hops: dict[str, list[float]] = {}
    for ts in stamps.values():
        seen = [n for n in hops_ if n in ts]
        for a, b in zip(seen, seen[1:], strict=False):
            hops.setdefault(f"{a} -> {b}", []).append((ts[b] - ts[a]) / 1000)
        if hops_[0] in ts and hops_[-1] in ts:
            hops.setdefault("total", []).append((ts[hops_[-1]] - ts[hops_[0]]) / 1000)
    return {k: statistics.median(v) for k, v in hops.items()}


def measure(fleet: Fleet, model: str, conc: int, seconds: float, trace: bool, protocol: str = "http") -> None:
    assert fleet.data_dir is not None
    valkey = redis.Redis(unix_socket_path=str(fleet.data_dir / "redis" / "redis.sock"))
    perf_analyzer(fleet.port, model, conc, 2000, protocol)  # warm-up
    trace_file = fleet.root / ".fleet" / "trace.json"
    if trace:
        trace_file.unlink(missing_ok=True)
        api(fleet.port, "POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"], "trace_rate": "10",
                                                      "trace_count": "-1", "log_frequency": "0"})
    valkey.config_resetstat()
    before = counts(fleet.port, model)
    line = perf_analyzer(fleet.port, model, conc, int(seconds * 1000), protocol)
    after = counts(fleet.port, model)
    stats = valkey.info("commandstats")
    if trace:
        api(fleet.port, "POST", "/v2/trace/setting", {"trace_level": ["OFF"]})
    valkey.close()
    n = (after[0] - before[0]) if before and after else 0
    print(f"  {line}; {n} requests")
    if n <= 0:
        return
    rows = sorted(((k.removeprefix("cmdstat_"), v["calls"] / n, v["usec"] / n) for k, v in stats.items()),
                  key=lambda r: -r[2])
    for name, calls, usec in rows:
        if usec >= 0.5:
            print(f"  {name:16s} {calls:6.2f} calls {usec:8.1f} µs per request")
    print(f"  Valkey total {sum(r[2] for r in rows):8.1f} µs per request")
    if trace:
        time.sleep(1.0)  # the gateway writes its trace file in the background
        # gRPC's send stamps are taken as the handler returns, before its frames are flushed: only the
        # hops up to REQUEST_END tell there.
        hops = HOPS if protocol == "http" else (tp.GRPC_WAITREAD_START, *HOPS[1:-1])
        for hop, median in hop_medians(trace_file, hops).items():
            print(f"  {hop:45s} {median:8.1f} µs")


def fold_only() -> None:
    import tempfile

    from fleet.keys import Keys
    from fleet.redis_server import start_server
    from fleet.stats import LOG_FIELD, TOKEN_FIELD, BatchSample, fold_args, increments, logged_batches

    # The script a worker ran per batch before the statistics log (workers/consumer.py until bb819e3).
    before = """
if ARGV[1] ~= "" then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 0
"""
    server = start_server(Path(tempfile.mkdtemp(prefix="fold-cost-")), appendonly=False)
    client, keys = redis.Redis.from_url(server.url), Keys("fold")
    sample = BatchSample(version=1, batch_size=1, requests_ok=1, requests_failed=0, request_ns_ok=2_000_000,
                         request_ns_failed=0, queue_ns=300_000, compute_input_ns=10_000, compute_infer_ns=400_000,
                         compute_output_ns=10_000, finished_ms=int(time.time() * 1000), request_us=(2000,),
                         queue_us=(300,))
    old = ["EVAL", before, 1, keys.stats("m"), "1:last_inference", sample.finished_ms,
           *[x for kv in increments(sample).items() for x in kv]]
    try:
        for _ in range(3):
            client.config_resetstat()
            for logged in logged_batches([sample] * 1000):  # as a worker writes them: each with its token
                client.xadd(keys.stats_log("m"), {LOG_FIELD: logged.entry, TOKEN_FIELD: logged.token})
            client.eval(*fold_args(keys, "m"))
            now = client.info("commandstats")
            client.config_resetstat()
            for _ in range(1000):
                client.execute_command(*old)  # type: ignore[no-untyped-call]
            was = client.info("commandstats")
            print(f"log: XADD {now['cmdstat_xadd']['usec_per_call']:.1f} µs, fold "
                  f"{now['cmdstat_eval']['usec'] / 1000:.1f} µs an entry; before: the script "
                  f"{was['cmdstat_eval']['usec_per_call']:.1f} µs a batch")
    finally:
        client.close()
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp")
    p.add_argument("--conc", type=int, default=1)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--port", type=int, default=18100)
    p.add_argument("--systems", default="fleet-base fleet fleet-base fleet")
    p.add_argument("--base-root", type=Path)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http", help="perf_analyzer's protocol")
    p.add_argument("--fold-only", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / f"redis-cost-{time.strftime('%Y%m%d-%H%M%S')}")
    a = p.parse_args()
    if a.fold_only:
        fold_only()
        return
    for i, system in enumerate(a.systems.split()):
        root = ROOT if system == "fleet" else a.base_root
        if root is None:
            raise SystemExit(f"{system} needs --base-root")
        out = a.out / f"{i}-{system}"
        out.mkdir(parents=True, exist_ok=True)
        fleet = Fleet(a.port, out, 60, [a.model], root=root, protocol=a.protocol)
        print(f"== {system} ({root}), {a.model} C={a.conc} over {a.protocol}", flush=True)
        try:
            fleet.start()
            measure(fleet, a.model, a.conc, a.seconds, a.trace, a.protocol)
        finally:
            fleet.stop(30)


if __name__ == "__main__":
    main()
