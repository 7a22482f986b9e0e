"""Client side of bulk jobs: `fleet submit | jobs | job | cancel` over the gateway's /v2/jobs API.

Three layers, so each can be tested alone:

    JobsClient         the HTTP calls (fleet/jobs_api.py); every failure becomes JobsClientError
    format_* / job_*   pure rendering of job records (dicts as the gateway sends them)
    run(args)          the CLI driver: rich progress, polling, exit codes

Exit codes of `fleet submit`: 0 the job completed and no item failed (or --no-wait: it was created),
3 the job completed but some items failed (their lines in the output say why; the summary lists the most
common errors), 1 the job failed or was cancelled, 2 usage or HTTP error, 130 Ctrl-C. The other commands:
0 done, 2 usage or HTTP error. A failed job's output (what it wrote before it stopped) is downloaded too.
These commands need no Settings: they only talk HTTP to a gateway (`--url`, env FLEET_URL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime, tzinfo
from enum import StrEnum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from fleet.client_args import DEFAULT_URL
from fleet.jobs_api import JobList, JobRecord, JobsClient, JobsClientError, OnChunk  # noqa: F401 (re-exported)

POLL_INTERVAL_S = 0.5
TABLE_COLUMNS = ("id", "model", "state", "done/total", "failed", "items/s", "created")
EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_ITEMS_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


# ---------------------------------------------------------------- pure rendering


def format_duration_s(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "--"
    total = round(seconds)
    return f"{total // 3600}:{total // 60 % 60:02d}:{total % 60:02d}"


def format_epoch(ts: float | None, tz: tzinfo | None = None) -> str:
    """Epoch seconds as `YYYY-MM-DD HH:MM:SS` in `tz` (local time when None); "-" when unset."""
    return "-" if ts is None else datetime.fromtimestamp(ts, tz).strftime("%Y-%m-%d %H:%M:%S")


def format_progress(record: Mapping[str, Any]) -> str:
    total = record.get("total")
    return f"{record.get('done', 0)}/{'?' if total is None else total}"


def job_row(record: Mapping[str, Any], tz: tzinfo | None = None) -> tuple[str, ...]:
    """One row of `fleet jobs`, in TABLE_COLUMNS order."""
    return (str(record.get("id", "")), str(record.get("model", "")), str(record.get("state", "")),
            format_progress(record), str(record.get("failed", 0)), f"{float(record.get('throughput') or 0):.1f}",
            format_epoch(record.get("created_at"), tz))


def format_record(record: Mapping[str, Any], tz: tzinfo | None = None) -> str:
    """`fleet job ID`: the record as aligned `label: value` lines, then the error samples."""
    version = record.get("version")
    model = str(record.get("model", "")) + (f" (version {version})" if version else "")
    lines = [
        ("id", str(record.get("id", ""))),
        ("model", model),
        ("state", str(record.get("state", ""))),
        ("priority", str(record.get("priority", 0))),
        ("progress", f"{format_progress(record)} done, {record.get('failed', 0)} failed, "
                     f"{record.get('written', 0)} written"),
        ("throughput", f"{float(record.get('throughput') or 0):.1f} items/s, ETA "
                       f"{format_duration_s(record.get('eta_s'))}"),
        ("output", str((record.get("output") or {}).get("format", ""))),
        ("created", format_epoch(record.get("created_at"), tz)),
        ("started", format_epoch(record.get("started_at"), tz)),
        ("finished", format_epoch(record.get("finished_at"), tz)),
    ]
    if record.get("error"):
        lines.append(("error", str(record["error"])))
    text = [f"{label + ':':<12}{value}" for label, value in lines]
    text.extend(common_error_lines(record))
    samples = record.get("errors") or []
    if samples:
        text.append(f"errors ({len(samples)} samples):")
        text.extend(f"  line {s.get('line', '?')}: {s.get('error', '')}" for s in samples)
    return "\n".join(text)


def progress_fields(record: Mapping[str, Any]) -> dict[str, str]:
    """The text columns of the live progress bar: rate, ETA and failed count."""
    return {"rate": f"{float(record.get('throughput') or 0):.1f} items/s",
            "eta": f"ETA {format_duration_s(record.get('eta_s'))}",
            "failed": f"{record.get('failed', 0)} failed"}


def summary_line(record: Mapping[str, Any], dest: Path | None = None) -> str:
    """The one line `fleet submit` ends with."""
    started, finished = record.get("started_at"), record.get("finished_at")
    took = f" in {format_duration_s(finished - started)}" if started is not None and finished is not None else ""
    line = (f"job {record.get('id')} {record.get('state')}: {record.get('done', 0)} done, "
            f"{record.get('failed', 0)} failed{took}, {float(record.get('throughput') or 0):.1f} items/s")
    if record.get("error"):
        line += f"; {record['error']}"
    return line + (f" -> {dest}" if dest is not None else "")


def common_error_lines(record: Mapping[str, Any]) -> list[str]:
    """The job's failed items counted by error message, most common first (the gateway's `common_errors`)."""
    common = record.get("common_errors") or []
    if not common:
        return []
    width = max(len(str(c.get("count", ""))) for c in common)
    return ["failed items by error, most common first:",
            *(f"  {str(c.get('count', '')):>{width}}  {c.get('error', '')}" for c in common)]


def default_output_path(input_path: str, fmt: str, *, server_path: bool = False) -> Path:
    """INPUT stem + `.out.<fmt>`: next to a local input, in the working directory for a server-side path."""
    src = Path(input_path)
    if src.suffix.lower() == ".gz":
        src = src.with_suffix("")  # x.jsonl.gz -> x.out.jsonl
    name = f"{src.stem}.out.{fmt}"
    return Path(name) if server_path else src.with_name(name)


def exit_code_for(state: str, failed: int = 0) -> int:
    """`fleet submit`'s exit code for a finished job (see the module docstring)."""
    if state != JobState.COMPLETED:
        return EXIT_JOB_FAILED
    return EXIT_ITEMS_FAILED if failed else EXIT_OK


def resolve_url(flag: str | None, environ: Mapping[str, str]) -> str:
    return flag or environ.get("FLEET_URL") or DEFAULT_URL


def job_spec(args: argparse.Namespace, job_input: str | dict[str, str]) -> dict[str, Any]:
    """The POST /v2/jobs body from `fleet submit` arguments; unset options are left to the gateway."""
    spec: dict[str, Any] = {"model": args.model, "input": job_input}
    optional = {"version": args.model_version, "priority": args.priority, "id": args.job_id,
                "max_failures": args.max_failures, "pack_batches": args.pack_batches}
    spec.update({k: v for k, v in optional.items() if v is not None})
    fmt = args.format
    if fmt is None and getattr(args, "output", None) is not None:
        # `-o out.npy` says the format as clearly as --format npy does
        fmt = {".jsonl": "jsonl", ".ndjson": "jsonl", ".npy": "npy", ".npz": "npz"}.get(Path(args.output).suffix)
    if fmt:
        spec["output"] = {"format": fmt}
    return spec


# ---------------------------------------------------------------- the driver


def wait_for_job(client: JobsClient, job_id: str, on_update: Callable[[JobRecord], None], *,
                 sleep: Callable[[float], None] = time.sleep, interval_s: float = POLL_INTERVAL_S,
                 max_transient_errors: int = 20) -> JobRecord:
    """Poll until the job is terminal; ride out up to `max_transient_errors` consecutive 5xx/unreachable polls."""
    errors = 0
    while True:
        try:
            record = client.get(job_id)
            errors = 0
        except JobsClientError as exc:
            errors += 1
            if (exc.status is not None and exc.status < 500) or errors > max_transient_errors:
                raise
            sleep(interval_s)
            continue
        on_update(record)
        if record.get("state") in TERMINAL_STATES:
            return record
        sleep(interval_s)


def _bytes_progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=console, transient=True)


def _submit(args: argparse.Namespace, client: JobsClient, out: Console, err: Console,
            sleep: Callable[[float], None]) -> int:
    if args.server_path:
        job_input: str | dict[str, str] = args.input
    else:
        path = Path(args.input)
        if not path.is_file():
            err.print(f"error: no such file: {path}")
            return EXIT_USAGE
        try:
            with _bytes_progress(err) as bar:
                task = bar.add_task(f"upload {path.name}", total=path.stat().st_size)
                job_input = {"upload": client.upload(path, lambda n: bar.advance(task, n))}
        except KeyboardInterrupt:
            err.print("\ninterrupted: upload stopped, no job was created")
            return EXIT_INTERRUPTED
    record = client.create(job_spec(args, job_input))
    job_id = str(record["id"])
    out.print(job_id)
    if args.no_wait:
        return EXIT_OK
    try:
        with Progress(TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"),
                      TextColumn("{task.fields[failed]}"), console=err) as bar:
            task = bar.add_task("", total=None, rate="", eta="", failed="")

            def show(r: JobRecord) -> None:
                f = progress_fields(r)
                bar.update(task, description=str(r.get("state", "")), total=r.get("total"),
                           completed=r.get("done", 0), rate=f["rate"], eta=f["eta"], failed=f["failed"])

            show(record)

            record = wait_for_job(client, job_id, show, sleep=sleep)
    except KeyboardInterrupt:
        url = "" if client.base_url == DEFAULT_URL else f" --url {client.base_url}"
        err.print(f"\ninterrupted: job {job_id} keeps running on the server; cancel it with: "
                  f"fleet cancel {job_id}{url}")
        return EXIT_INTERRUPTED
    dest = None
    state = str(record.get("state"))
    if state in (JobState.COMPLETED, JobState.FAILED):
        fmt = str((record.get("output") or {}).get("format") or args.format or "jsonl")
        dest = args.output or default_output_path(args.input, fmt, server_path=args.server_path)
        dest = _download(client, job_id, dest, err, required=state == JobState.COMPLETED)
        if dest is not None and fmt == "npy":  # its failed-row mask beside it, as the gateway keeps it
            client.download(job_id, Path(f"{dest}.failed.npy"), mask=True)
    out.print(summary_line(record, dest))
    for line in common_error_lines(record):
        out.print(line)
    return exit_code_for(state, int(record.get("failed") or 0))


def _download(client: JobsClient, job_id: str, dest: Path, err: Console, *, required: bool) -> Path | None:
    """Fetch the results to `dest`; a failed job may have none to fetch (None), a completed one must."""
    try:
        with _bytes_progress(err) as bar:
            task = bar.add_task(f"download {dest.name}", total=None)
            client.download(job_id, dest, lambda n: bar.advance(task, n))
    except JobsClientError as exc:
        if required or exc.status not in (404, 409):
            raise
        return None
    return dest


def _dispatch(args: argparse.Namespace, client: JobsClient, out: Console, err: Console,
              sleep: Callable[[float], None]) -> int:
    if args.command == "submit":
        return _submit(args, client, out, err, sleep)
    if args.command == "jobs":
        table = Table(*TABLE_COLUMNS)
        for record in client.list():
            table.add_row(*(Text(cell) for cell in job_row(record)))
        out.print(table)
    elif args.command == "job":
        record = client.get(args.job_id)
        out.print(json.dumps(record, indent=2) if args.json else format_record(record))
    else:
        record = client.cancel(args.job_id)
        out.print(f"job {record.get('id', args.job_id)} {record.get('state')}")
    return EXIT_OK


def run(args: argparse.Namespace, *, client: JobsClient | None = None, environ: Mapping[str, str] = os.environ,
        sleep: Callable[[float], None] = time.sleep) -> int:
    """Run submit, jobs, job or cancel (parsed by fleet.cli.build_parser()); returns the process exit code."""
    out = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=True)
    err = Console(file=sys.stderr, markup=False, highlight=False, soft_wrap=True)
    jobs = client if client is not None else JobsClient(resolve_url(args.url, environ),
                                                        api_key=args.api_key or environ.get("FLEET_API_KEY"))
    try:
        return _dispatch(args, jobs, out, err, sleep)
    except JobsClientError as exc:
        err.print(f"error: {exc}")
        return EXIT_USAGE
    except OSError as exc:
        err.print(f"error: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("\ninterrupted")
        return EXIT_INTERRUPTED
    finally:
        if client is None:
            jobs.close()
