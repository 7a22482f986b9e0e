"""The arguments of fleet's client commands: submit, jobs, job, cancel (fleet/job_client.py), analyze
(fleet/analyzer/run.py) and status (fleet/status_cli.py), each an HTTP client of a gateway.

They are defined apart from those commands' code because every `fleet` process builds the whole parser: the
server commands (up, gateway, worker, jobs-worker) then import neither rich, httpx nor the analyzer's numpy, which
stay resident for a process's life (18 MiB of `fleet up`'s supervisor: bench/RESULTS.md, stop 57). fleet/cli.py
imports a client command's module only to run it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
JOB_COMMANDS = frozenset({"submit", "jobs", "job", "cancel"})


def _url(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", default=None, help=f"gateway URL (env FLEET_URL; default {DEFAULT_URL})")
    return p


def _url_and_key(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _url(p).add_argument("--api-key", default=None, help="sent as Authorization: Bearer (env FLEET_API_KEY)")
    return p


def add_job_commands(sub: Any) -> None:
    """Add submit, jobs, job and cancel to the `fleet` subparsers (`sub` is argparse's _SubParsersAction)."""
    s = _url_and_key(sub.add_parser("submit", help="run a bulk job and fetch its results"))
    s.add_argument("input", help="JSONL or array file to upload (a server-side path with --server-path)")
    s.add_argument("--model", required=True)
    s.add_argument("--model-version", default=None)
    s.add_argument("-o", "--output", type=Path, default=None, help="results file (default INPUT stem + .out.FMT)")
    s.add_argument("--priority", type=int, default=None, help="scheduling lane (default 0 = bulk)")
    s.add_argument("--id", dest="job_id", default=None, help="job id; resubmitting an id returns that job")
    s.add_argument("--max-failures", type=int, default=None,
                   help="fail the job once more items failed; replaces the default rule (fail when the first "
                        "100 items all fail)")
    s.add_argument("--pack-batches", type=int, default=None,
                   help="batches of rows per request (1-16; default the gateway's FLEET_JOB_PACK_BATCHES, 4)")
    s.add_argument("--format", choices=("jsonl", "npy", "npz"), default=None, help="output format")
    s.add_argument("--no-wait", action="store_true", help="print the job id and return")
    s.add_argument("--server-path", action="store_true",
                   help="INPUT is a path on the gateway, in a directory it allows (FLEET_JOB_INPUT_DIRS); no upload")
    _url_and_key(sub.add_parser("jobs", help="list bulk jobs"))
    j = _url_and_key(sub.add_parser("job", help="show one bulk job"))
    j.add_argument("job_id", metavar="ID")
    j.add_argument("--json", action="store_true", help="print the raw JSON record")
    c = _url_and_key(sub.add_parser("cancel", help="cancel a bulk job"))
    c.add_argument("job_id", metavar="ID")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _preferred(text: str) -> list[tuple[int, ...]]:
    """'none,8,4/8' -> [(), (8,), (4, 8)]: each comma-separated choice a list of sizes joined by '/'."""
    out = []
    for choice in text.replace(" ", "").split(","):
        try:
            out.append(() if choice in ("", "none", "-") else tuple(int(x) for x in choice.split("/")))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like none,8,4/8, got {text!r}") from None
    return out


def _shape(text: str) -> tuple[str, list[int]]:
    name, _, dims = text.rpartition(":")
    try:
        return name, [int(d) for d in dims.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME:D1,D2,..., got {text!r}") from None


def add_analyze(sub: Any) -> None:
    """Add analyze (fleet/analyzer/run.py) to the `fleet` subparsers."""
    a = _url_and_key(sub.add_parser("analyze", help="sweep a model's instances and batching against a running fleet "
                                                    "(Model Analyzer): needs --model-control-mode explicit and the "
                                                    "control API"))
    a.add_argument("model")
    a.add_argument("--latency-budget-ms", type=float, default=None, help="the best config's p99 must stay within")
    a.add_argument("--min-gain", type=float, default=5.0,
                   help="percent another config must beat the current one by to be named best (default 5)")
    a.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="client concurrencies (default 1,8,32)")
    a.add_argument("--instances", type=_ints, default=[], help="instance counts to try, e.g. 1,2 (default: current)")
    a.add_argument("--delays", type=_ints, default=None,
                   help="max_queue_delay_microseconds values, e.g. 0,100,1000 (default 0,100,1000 for a model that "
                        "batches)")
    a.add_argument("--preferred", type=_preferred, default=[], help="preferred_batch_size choices, e.g. none,8,4/8")
    a.add_argument("--threads", type=_ints, default=[], help="intra-op threads per CPU instance (pytorch, onnx)")
    a.add_argument("--seconds", type=float, default=3.0, help="measurement window per concurrency (3)")
    a.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window (1)")
    a.add_argument("--shape", type=_shape, action="append", default=[], metavar="NAME:D1,D2",
                   help="dims of an input with variable dims (without the batch dim), as perf_analyzer's --shape")
    a.add_argument("--apply", action="store_true", help="load the best config (else the model's config is put back)")
    a.add_argument("--write-config", type=Path, default=None, help="write the best config as config.pbtxt text")
    a.add_argument("--json", type=Path, default=None, help="write every measurement as JSON")
    a.add_argument("--plot", type=Path, default=None, help="write throughput against p99 as an SVG plot")
    a.add_argument("--dry-run", action="store_true", help="print the plan and how long it would take, run nothing")


def add_status(sub: Any) -> None:
    """Add status (fleet/status_cli.py) to the `fleet` subparsers."""
    s = _url_and_key(sub.add_parser("status", help="a live view of workers, models, queues, throughput and jobs"))
    s.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1)")
    s.add_argument("--once", action="store_true", help="print one frame and exit")
