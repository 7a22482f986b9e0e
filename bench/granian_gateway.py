"""fleet's gateway behind granian's RSGI server, against the same gateway behind its own HTTP protocol.

    pip install --target /tmp/granian-lib granian==2.8.9         # not a fleet dependency: this experiment only
    .venv/bin/python bench/granian_gateway.py --granian-lib /tmp/granian-lib --port 18000 [--passes 2]
                                              [--conc "32 1"] [--models mlp] [--out bench/out/granian-TIME]

1. Starts `fleet up` on --port (bench/served.py's Fleet: its own session, stopped by PID at the end), then a
   second gateway process on the same Valkey and workers: the app `create_app` builds from the running
   gateway's own command line (read from /proc, ports moved to --port + 100 and + 102, gRPC off), served by
   `granian --interface rsgi --loop uvloop --workers 1 --runtime-threads 1`. Infer requests go to the app's
   InferHandler, the same handler fleet's own protocol calls (gateway/infer_protocol.py); every other route
   through a small RSGI-to-ASGI bridge (perf_analyzer only reads the model's metadata and config there).
2. Alternates the two gateways, --passes times, at each --conc for each model: perf_analyzer as bench_pa.sh
   runs it (`-i http -b 1 --measurement-interval 3000 --stability-percentage 20 --max-trials 12`), and the
   gateway process's CPU (/proc utime + stime, every thread) over the run divided by the requests its
   statistics counted over the same run (warm-up trials included, the same for both).
3. Prints one row per run: infer/s, p50, p99 (ms), mean batch, gateway CPU per request (µs).

Only 127.0.0.1 is contacted; every run is bounded by perf_analyzer's --max-trials and a 300 s kill.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from procs import children, cpu_ticks  # bench/procs.py
from served import DEFAULT_PA, HOST, ROOT, Fleet, counts  # bench/served.py

CLK_TCK = os.sysconf("SC_CLK_TCK")
_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]*))?/infer$")


# ---------------------------------------------------------------------------------------------- the app
def build_rsgi_app() -> Any:
    """The RSGI application granian imports (`granian_gateway:rsgi_app` with FLEET_GW_ARGS set)."""
    sys.path.insert(0, str(ROOT))
    from fleet.cli import build_parser, settings_from_args
    from fleet.parts import joined
    from gateway.app import create_app
    from gateway.fastpath import answer_headers

    app = create_app(settings_from_args(build_parser().parse_args(shlex.split(os.environ["FLEET_GW_ARGS"]))))

    class Rsgi:
        ready: Any = None

        def __rsgi_init__(self, loop: Any) -> None:
            async def start() -> None:
                self.lifespan = app.router.lifespan_context(app)
                await self.lifespan.__aenter__()  # the broker, the catalog: what the app's lifespan starts

            self.ready = loop.create_task(start())

        def __rsgi_del__(self, loop: Any) -> None:
            pass  # (the process ends here: the broker's reply stream expires by its TTL)

        async def __rsgi__(self, scope: Any, proto: Any) -> None:
            await self.ready
            headers = [(k.lower().encode(), v.encode()) for k, v in scope.headers.items()]
            body = await proto()

            async def disconnected() -> dict[str, Any]:
                await proto.client_disconnect()
                return {"type": "http.disconnect"}

            match = _INFER.match(scope.path) if scope.method == "POST" else None
            if match is not None:
                answer = await app.infer_handler.answer(app.state.fleet, headers, body, disconnected,
                                                        match.group(1), match.group(2))
                if answer is not None:
                    proto.response_bytes(answer.status, [(k.decode(), v.decode()) for k, v in answer_headers(answer)],
                                         joined(answer.body))
                return
            sent = False

            async def receive() -> dict[str, Any]:
                nonlocal sent
                if sent:
                    return await disconnected()
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}

            out: dict[str, Any] = {}

            async def send(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    out.update(status=message["status"], body=[],
                               headers=[(k.decode(), v.decode()) for k, v in message.get("headers", [])])
                elif message["type"] == "http.response.body":
                    out["body"].append(message.get("body", b""))
                    if not message.get("more_body"):
                        proto.response_bytes(out["status"], out["headers"], b"".join(out["body"]))

            await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": scope.method,
                       "scheme": "http", "path": scope.path, "raw_path": scope.path.encode(),
                       "query_string": scope.query_string.encode(), "root_path": "", "headers": headers,
                       "client": (HOST, 0), "server": (HOST, 0), "state": {}}, receive, send)

    return Rsgi()


if os.environ.get("FLEET_GW_ARGS"):  # imported by granian
    rsgi_app = build_rsgi_app()


# ---------------------------------------------------------------------------------------------- the runs
def gateway_pid(fleet_pid: int) -> int:
    return next(pid for pid, argv in children(fleet_pid) if b"gateway" in argv[3:4])  # python -m fleet gateway


def start_granian(gw_pid: int, port: int, lib: Path, out: Path) -> subprocess.Popen[bytes]:
    args = Path(f"/proc/{gw_pid}/cmdline").read_bytes().split(b"\0")[3:-1]  # after `python -m fleet`
    argv = [a.decode() for a in args]
    for flag, value in (("--http-port", port), ("--metrics-port", port + 2), ("--allow-grpc", "false")):
        argv[argv.index(flag) + 1] = str(value)
    env = dict(os.environ)
    for item in Path(f"/proc/{gw_pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"FLEET_"):
            key, _, value = item.decode().partition("=")
            env[key] = value
    env["FLEET_GW_ARGS"] = shlex.join(argv)
    env["PYTHONPATH"] = f"{lib}{os.pathsep}{Path(__file__).parent}"
    with (out / "granian.log").open("wb") as log:  # (the child keeps its own copy of the descriptor)
        return subprocess.Popen([sys.executable, "-m", "granian", "--interface", "rsgi", "--loop", "uvloop",
                                 "--workers", "1", "--runtime-threads", "1", "--host", HOST, "--port", str(port),
                                 "--no-ws", "granian_gateway:rsgi_app"], cwd=ROOT, env=env, stdout=log, stderr=log,
                                start_new_session=True)


def cpu_us(pid: int) -> float:
    return cpu_ticks(pid) * 1e6 / CLK_TCK


def stats(port: int, model: str) -> tuple[int, int]:
    got = counts(port, model)
    if got is None:
        raise SystemExit(f"no statistics of '{model}' on 127.0.0.1:{port}")
    return got


def run(label: str, port: int, pid: int, model: str, conc: int, out: Path) -> str:
    (n0, b0), c0 = stats(port, model), cpu_us(pid)
    text = subprocess.run([str(DEFAULT_PA), "-m", model, "-i", "http", "-u", f"{HOST}:{port}", "-b", "1",
                           "--concurrency-range", str(conc), "--measurement-interval", "3000",
                           "--stability-percentage", "20", "--max-trials", "12"],
                          capture_output=True, text=True, timeout=300).stdout
    c1, (n1, b1) = cpu_us(pid), stats(port, model)
    (out / f"{label}_{model}_c{conc}_{int(time.time())}.txt").write_text(text)

    def grab(pattern: str) -> str:
        m = re.search(pattern, text)
        return m.group(1) if m else "-"

    p50, p99 = grab(r"p50 latency: (\d+) usec"), grab(r"p99 latency: (\d+) usec")
    return (f"| {label} | {model} | {conc} | {grab(r'Throughput: ([0-9.]+)')} | "
            f"{'-' if p50 == '-' else f'{int(p50) / 1000:.2f}'} | {'-' if p99 == '-' else f'{int(p99) / 1000:.2f}'} | "
            f"{(n1 - n0) / max(1, b1 - b0):.1f} | {(c1 - c0) / max(1, n1 - n0):.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--granian-lib", type=Path, required=True, help="a `pip install --target` of granian")
    parser.add_argument("--port", type=int, default=18000)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--conc", default="32 1")
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / f"granian-{time.strftime('%H%M%S')}")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = args.models.split()
    fleet = Fleet(args.port, args.out, 180.0, models)
    fleet.start()
    granian: subprocess.Popen[bytes] | None = None
    try:
        if fleet.proc is None:
            return 1
        own = gateway_pid(fleet.proc.pid)
        granian = start_granian(own, args.port + 100, args.granian_lib, args.out)
        deadline = time.monotonic() + 60
        while counts(args.port + 100, models[0]) is None:
            if time.monotonic() > deadline or granian.poll() is not None:
                print(f"granian did not start: see {args.out / 'granian.log'}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        rsgi = children(granian.pid)[0][0]  # granian's worker: the process that runs Python's event loop
        rows = ["| gateway | model | C | infer/s | p50 ms | p99 ms | mean batch | gateway CPU µs/request |",
                "|---|---|---|---|---|---|---|---|"]
        for n in range(args.passes):
            for model in models:
                for conc in (int(c) for c in args.conc.split()):
                    order = [("own", args.port, own), ("granian", args.port + 100, rsgi)]
                    for label, port, pid in order if n % 2 == 0 else order[::-1]:
                        rows.append(run(label, port, pid, model, conc, args.out))
                        print(rows[-1], flush=True)
        print("\n".join(rows))
    finally:
        if granian is not None and granian.poll() is None:
            os.killpg(granian.pid, signal.SIGTERM)  # the session it leads: only what this script started
            try:
                granian.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(granian.pid, signal.SIGKILL)
        fleet.stop(30.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
