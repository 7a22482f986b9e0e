"""Overload: offer 3x the load fleet can sustain for 30 s and watch what admission control does.

    .venv/bin/python bench/overload.py [--factor 3] [--seconds 30] [--port 18100] [--out bench/out/overload-TIME]

1. Starts `fleet up` (bench/served.py's Fleet: own session, stopped by PID) on a temporary repository
   holding `paced`: a Python-backend model that sleeps 10 ms per batch of up to 8 and answers OUT = IN,
   with a queue policy of max_queue_size 64 (admission past it: 503 + Retry-After); with --in-flight N, no
   queue limit and the gateway-wide FLEET_MAX_IN_FLIGHT=N admits instead.
2. Sustainable load: a closed loop of 32 connections for 5 s; its answered requests/s is S.
3. Overload: an open loop offering factor x S requests/s for --seconds over up to 512 keep-alive
   connections (a request that finds every connection busy is counted as not sent: the client, not
   fleet, was the limit). Every response is checked (200: its own value; 503: Retry-After present).
4. Samples the resident memory of the gateway, the worker and Redis once a second.
Prints one table: offered/admitted/rejected rates, latency percentiles of admitted and of rejected
requests, and each process's memory at the start, the end and its peak. All traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from procs import children
from rawhttp import Connection
from served import HOST, ROOT, Fleet
from summary import print_table

MODEL = "paced"
MODEL_PY = '''
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.010)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                             .as_numpy())]) for r in requests]
'''
CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 1000 default_queue_policy { max_queue_size: 64 } }
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


def repository(queue_limit: bool) -> Path:
    repo = Path(tempfile.mkdtemp(prefix="fleet-overload-"))
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "1" / "model.py").write_text(MODEL_PY)
    config = CONFIG if queue_limit else CONFIG.replace(" default_queue_policy { max_queue_size: 64 }", "")
    (repo / MODEL / "config.pbtxt").write_text(config)
    return repo


async def post(conn: Connection, value: float) -> tuple[int, bool]:
    """(status, the response is right: 200 with its own value, or 503 with Retry-After)."""
    doc = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}
    status, headers, payload = await conn.post(f"/v2/models/{MODEL}/infer", doc)
    if status == 200:
        return status, json.loads(payload)["outputs"][0]["data"] == [value]
    return status, status == 503 and "retry-after" in headers


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def processes(root_pid: int) -> dict[str, int]:
    """gateway / worker / redis among `fleet up`'s children."""
    found: dict[str, int] = {}
    for pid, argv in children(root_pid):
        for role in ("gateway", "worker"):
            if role.encode() in argv:
                found[role] = pid
        if any(b"valkey-server" in a or b"redis-server" in a for a in argv):
            found["redis"] = pid
    return found


async def closed_loop(port: int, conns: int, seconds: float) -> float:
    done = 0
    stop_at = time.monotonic() + seconds

    async def one(k: int) -> None:
        nonlocal done
        c = Connection(HOST, port)
        i = k
        while time.monotonic() < stop_at:
            status, ok = await post(c, float(i))
            assert status == 200 and ok, status
            done += 1
            i += conns

    start = time.monotonic()
    await asyncio.gather(*(one(k) for k in range(conns)))
    return done / (time.monotonic() - start)


async def open_loop(port: int, rate: float, seconds: float, max_conns: int,
                    pids: dict[str, int]) -> dict[str, object]:
    idle = [Connection(HOST, port) for _ in range(max_conns)]
    ok_lat: list[float] = []
    rej_lat: list[float] = []
    wrong = unsent = 0
    other: dict[str, int] = {}
    memory: dict[str, list[float]] = {role: [] for role in pids}
    tasks: set[asyncio.Task[None]] = set()

    async def send(value: float) -> None:
        nonlocal wrong
        conn = idle.pop()
        t0 = time.perf_counter()
        try:
            status, right = await post(conn, value)
        except (OSError, asyncio.IncompleteReadError) as exc:
            other[type(exc).__name__] = other.get(type(exc).__name__, 0) + 1
            conn.close()
            idle.append(Connection(HOST, port))
            return
        took = time.perf_counter() - t0
        idle.append(conn)
        wrong += not right
        if status == 200:
            ok_lat.append(took)
        elif status == 503:
            rej_lat.append(took)
        else:
            other[str(status)] = other.get(str(status), 0) + 1

    start = time.monotonic()
    next_sample = start
    sent = 0
    while (now := time.monotonic()) - start < seconds:
        if now >= next_sample:
            for role, pid in pids.items():
                memory[role].append(rss_mb(pid))
            next_sample += 1.0
        due = int((now - start) * rate) - sent - unsent
        for _ in range(due):
            if not idle:
                unsent += 1
                continue
            task = asyncio.create_task(send(float(sent)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent += 1
        await asyncio.sleep(0.001)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for role, pid in pids.items():
        memory[role].append(rss_mb(pid))
    elapsed = time.monotonic() - start
    return {"sent": sent, "unsent": unsent, "elapsed": elapsed, "ok": ok_lat, "rejected": rej_lat,
            "wrong": wrong, "other": other, "memory": memory}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--port", type=int, default=18100)
    p.add_argument("--max-conns", type=int, default=512)
    p.add_argument("--in-flight", type=int, default=0,
                   help="no max_queue_size: admission by the gateway's FLEET_MAX_IN_FLIGHT = this instead")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / f"overload-{time.strftime('%Y%m%d-%H%M%S')}")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    env = {"FLEET_MAX_IN_FLIGHT": str(a.in_flight)} if a.in_flight else {}
    fleet = Fleet(a.port, a.out, 180.0, [MODEL], env=env, repositories=[str(repository(not a.in_flight))])
    fleet.start()
    try:
        assert fleet.proc is not None
        pids = processes(fleet.proc.pid)
        sustainable = asyncio.run(closed_loop(a.port, 32, 5.0))
        print(f"sustainable: {sustainable:,.0f} req/s (closed loop, 32 connections, 5 s)", flush=True)
        rate = a.factor * sustainable
        r = asyncio.run(open_loop(a.port, rate, a.seconds, a.max_conns, pids))
    finally:
        fleet.stop(60)
    ok, rej = r["ok"], r["rejected"]
    assert isinstance(ok, list) and isinstance(rej, list)
    elapsed = float(r["elapsed"])  # type: ignore[arg-type]
    rows = [
        ["offered (req/s)", f"{rate:,.0f} ({a.factor:g}x)"],
        ["sent / not sent by the client", f"{r['sent']:,} / {r['unsent']:,}"],
        ["admitted (200, req/s)", f"{len(ok) / elapsed:,.0f} ({len(ok) / elapsed / sustainable:.2f}x S)"],
        ["rejected (503 + Retry-After, req/s)", f"{len(rej) / elapsed:,.0f}"],
        ["wrong answers / other outcomes", f"{r['wrong']} / {r['other'] or 0}"],
        ["admitted p50 / p99 / max (ms)",
         f"{percentile(ok, .5) * 1e3:.1f} / {percentile(ok, .99) * 1e3:.1f} / {max(ok, default=0) * 1e3:.1f}"],
        ["rejected p50 / p99 (ms)", f"{percentile(rej, .5) * 1e3:.1f} / {percentile(rej, .99) * 1e3:.1f}"],
    ]
    memory = r["memory"]
    assert isinstance(memory, dict)
    for role, samples in sorted(memory.items()):
        quarters = " / ".join(f"{samples[min(len(samples) - 1, q * (len(samples) - 1) // 4)]:.0f}" for q in range(5))
        rows.append([f"{role} RSS at 0, 1/4 .. 4/4 of the run (MB)", f"{quarters} (peak {max(samples):.0f})"])
    limit = f"FLEET_MAX_IN_FLIGHT={a.in_flight}" if a.in_flight else "max_queue_size 64"
    print_table(f"overload: {a.factor:g}x the sustainable {sustainable:,.0f} req/s for {a.seconds:g} s ({limit})",
                ["", ""], rows)
    return 1 if r["wrong"] or r["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
