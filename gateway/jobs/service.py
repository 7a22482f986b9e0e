"""Bulk job operations behind /v2/jobs, HTTP-free and synchronous (the routes run them in a thread):
create (idempotent by id) and queue the first run, cancel, read, uploads. The runner, the records and
the RQ setup they share with the job workers live in fleet/jobs/."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from fleet.errors import InvalidInput, NotFound, NotReadyYet
from fleet.jobs.formats import open_input, remove_output, request_batches
from fleet.jobs.records import CANCELLED, COMPLETED, FAILED, QUEUED, RUNNING, JobStore, check_id, view
from fleet.jobs.recovery import queue_run
from fleet.jobs.runner import JobOptions
from fleet.keys import Keys
from fleet.model_spec import ModelSpec
from fleet.paths import contained, inside_any
from fleet.settings import MAX_PACK_BATCHES, Settings

INPUT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".npy": "array", ".npz": "array"}
OUTPUT_FORMATS = {"jsonl": ".jsonl", "npy": ".npy", "npz": ".npz"}
GZIP_SUFFIX = ".gz"  # an upload named like this is decompressed as it arrives (gateway/jobs/uploads.py)
# Numeric job fields, like request parameters, travel as signed 64-bit integers (msgpack, Redis).
MAX_INT64 = 2**63 - 1


@dataclass(frozen=True, slots=True)
class JobsContext:
    client: redis.Redis
    keys: Keys
    jobs_dir: Path
    options: JobOptions
    # Server-side input paths must resolve inside one of these or the uploads dir (Settings.job_input_dirs).
    input_dirs: tuple[Path, ...] = ()
    pack_batches: int = 1  # for a job that does not say (Settings.job_pack_batches); its record keeps the K used

    @property
    def store(self) -> JobStore:
        return JobStore(self.client, self.keys)


def jobs_context(client: redis.Redis, settings: Settings) -> JobsContext:
    return JobsContext(client, Keys(settings.key_prefix), Path(settings.jobs_dir).resolve(),
                       JobOptions.from_settings(settings), tuple(Path(d).resolve() for d in settings.job_input_dirs),
                       settings.job_pack_batches)


def _input_path(ctx: JobsContext, spec_input: Any) -> Path:
    uploads = ctx.jobs_dir / "uploads"
    if isinstance(spec_input, dict) and set(spec_input) == {"upload"}:
        token = str(spec_input["upload"])
        if not (token.isascii() and token.isalnum()):
            raise InvalidInput(f"invalid upload token {token!r}")
        found = sorted(p for p in uploads.glob(f"{token}.*") if p.suffix.lower() in INPUT_SUFFIXES)
        if not found:
            raise InvalidInput(f"no upload {token!r} (uploads are POSTed to /v2/jobs/uploads first)")
        return contained(uploads, found[0].name)
    if isinstance(spec_input, str) and spec_input:
        # A path the job workers can read (a shared volume); it must exist here too, and lie (after
        # symlinks) in the uploads dir or a configured input dir: a client names no other server file.
        try:
            path = inside_any((uploads, *ctx.input_dirs), spec_input)
        except InvalidInput:
            raise InvalidInput(f"input path {spec_input!r} is outside the directories jobs may read: upload the "
                               "file (POST /v2/jobs/uploads) or have the operator list its directory in "
                               "FLEET_JOB_INPUT_DIRS") from None
        if not path.is_file():
            raise InvalidInput(f"input file {spec_input!r} does not exist on the gateway")
        if path.suffix.lower() == GZIP_SUFFIX:
            # A job reads its input from a byte offset when it resumes, which a gzip stream cannot seek to.
            raise InvalidInput(f"input file {spec_input!r} is compressed: jobs read uncompressed files; "
                               "decompress it, or upload it (an upload named .gz is decompressed on arrival)")
        return path
    raise InvalidInput("'input' must be a file path or {\"upload\": \"<token>\"}")


def _int_field(doc: dict[str, Any], name: str, default: int | None) -> int | None:
    value = doc.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT64:
        raise InvalidInput(f"'{name}' must be an integer from 0 to {MAX_INT64}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A client's value in an error message, cut short (a 4,000-digit number is not worth echoing)."""
    text = json.dumps(value) if isinstance(value, (bool, float, str, list, dict)) or value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def create_job(ctx: JobsContext, doc: dict[str, Any], spec: ModelSpec, version: int) -> tuple[dict[str, Any], bool]:
    """Create and queue a job; with an existing `id`, return that job instead (and False)."""
    job_id = check_id(str(doc["id"])) if doc.get("id") is not None else uuid.uuid4().hex[:16]
    existing = ctx.store.get(job_id)
    if existing is not None:
        return view(existing, ctx.store.errors(job_id)), False
    path = _input_path(ctx, doc.get("input"))
    kind = INPUT_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise InvalidInput(f"unsupported input file type {path.suffix!r}: use .jsonl, .npy or .npz")
    source = open_input(path, spec)  # fails fast on a wrong array shape/dtype or unreadable file
    source.close()
    output = doc.get("output") or {}
    if not isinstance(output, dict):
        raise InvalidInput("'output' must be an object like {\"format\": \"jsonl\"}")
    fmt = str(output.get("format") or ("jsonl" if kind == "jsonl" else "npz"))
    if fmt not in OUTPUT_FORMATS:
        raise InvalidInput(f"unsupported output format {fmt!r}: use jsonl, npy or npz")
    if fmt != "jsonl" and kind != "array":
        raise InvalidInput("array output (npy/npz) needs array input (.npy/.npz)")
    priority = _int_field(doc, "priority", 0)
    max_failures = _int_field(doc, "max_failures", None)
    pack = doc.get("pack_batches")
    pack = ctx.pack_batches if pack is None else pack
    if isinstance(pack, bool) or not isinstance(pack, int) or not 1 <= pack <= MAX_PACK_BATCHES:
        raise InvalidInput(f"'pack_batches' must be an integer from 1 to {MAX_PACK_BATCHES}, got {_shown(pack)}")
    job_dir = ctx.jobs_dir / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    fields = {"model": spec.name, "version": version, "priority": priority, "input": str(path), "input_kind": kind,
              "output": str(job_dir / f"output{OUTPUT_FORMATS[fmt]}"), "output_format": fmt,
              "max_failures": -1 if max_failures is None else max_failures,
              # as the job worker will send them (1 where the model or the lane does not allow more)
              "pack_batches": request_batches(spec, priority or 0, pack, ctx.options.window_rows)}
    if not ctx.store.create(job_id, fields):  # lost a race with the same id
        record = ctx.store.get(job_id)
        assert record is not None
        return view(record, ctx.store.errors(job_id)), False
    queue_run(ctx.client, ctx.keys, ctx.options, job_id, attempt=1)
    record = ctx.store.get(job_id)
    assert record is not None
    return view(record, []), True


def get_job(ctx: JobsContext, job_id: str) -> dict[str, Any]:
    record = ctx.store.get(job_id)
    if record is None:
        raise NotFound(f"unknown job '{job_id}'")
    return view(record, ctx.store.errors(job_id))


def list_jobs(ctx: JobsContext, limit: int = 100) -> list[dict[str, Any]]:
    return [view(record, []) for record in ctx.store.get_many(ctx.store.ids(limit))]


def cancel_job(ctx: JobsContext, job_id: str) -> dict[str, Any]:
    """Cancel a queued or running job. Its runner sees the state within a fraction of a second, stops
    feeding, deletes its requests still queued on the lane and its partial output; a queued run exits at
    once. With no runner holding the job (none started yet, or its job worker died), the output is
    deleted here: a runner that starts later reads `cancelled` first and writes nothing."""
    record = ctx.store.get(job_id)
    if record is None:
        raise NotFound(f"unknown job '{job_id}'")
    cancelled = ctx.store.transition(job_id, CANCELLED, (QUEUED, RUNNING), {"finished_at": time.time()})
    if cancelled and not ctx.client.exists(ctx.keys.job_lease(job_id)):
        output = _own_output(ctx, record)
        if output is not None:
            remove_output(output)
    return get_job(ctx, job_id)


def _own_output(ctx: JobsContext, record: dict[str, Any]) -> Path | None:
    """The job's output path if it lies in this gateway's jobs directory (where create_job put it)."""
    try:
        return contained(ctx.jobs_dir, record["output"])
    except (InvalidInput, KeyError):
        return None


def results_path(ctx: JobsContext, job_id: str) -> tuple[Path, str]:
    """The output of a completed job, or what a failed one wrote before it stopped (JSONL: its lines so
    far; arrays: every row, those never written flagged in `failed`)."""
    record = ctx.store.get(job_id)
    if record is None:
        raise NotFound(f"unknown job '{job_id}'")
    state = record["state"]
    if state == CANCELLED:
        raise NotReadyYet(f"job '{job_id}' was cancelled; its partial output was deleted")
    if state not in (COMPLETED, FAILED):
        raise NotReadyYet(f"job '{job_id}' is {state}; results are served once it has completed (or failed)")
    # the gateway wrote it there; a record pointing elsewhere (edited, or another jobs_dir) is not served
    output = _own_output(ctx, record)
    if output is None:
        raise NotFound(f"the results of job '{job_id}' are not in this gateway's jobs directory")
    if state == FAILED and not output.is_file():  # it failed before it could open one
        raise NotFound(f"job '{job_id}' failed without an output to serve")
    return output, str(record.get("output_format") or "jsonl")


def failed_mask_path(ctx: JobsContext, job_id: str) -> Path:
    """An .npy job's `failed` row mask (`<output>.failed.npy`, beside its results: an .npy holds one array).
    An .npz holds its mask inside, and JSONL says each line's error in it: 404 for those."""
    output, fmt = results_path(ctx, job_id)
    mask = Path(f"{output}.failed.npy")
    if fmt != "npy" or not mask.is_file():
        raise NotFound(f"job '{job_id}' has no separate failed-row mask (only an .npy output has one)")
    return mask


def upload_path(ctx: JobsContext, name: str) -> tuple[str, Path, bool]:
    """(token, where to store the upload, whether its name says it is gzip-compressed: `x.jsonl.gz` is
    stored decompressed as a .jsonl)."""
    inner = Path(name)
    gzipped = inner.suffix.lower() == GZIP_SUFFIX
    if gzipped:
        inner = inner.with_suffix("")
    suffix = inner.suffix.lower()
    if suffix not in INPUT_SUFFIXES:
        shown = Path(name).suffix or name
        raise InvalidInput(f"unsupported upload type {shown!r}: use .jsonl, .npy or .npz (each may end in .gz)")
    token = uuid.uuid4().hex  # the file's name is ours: only the (checked) suffix comes from the caller
    directory = ctx.jobs_dir / "uploads"
    directory.mkdir(parents=True, exist_ok=True)
    return token, directory / f"{token}{suffix}", gzipped
