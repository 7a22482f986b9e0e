"""The bulk job runner: the RQ job function that streams a job's input through the model's lane.

One runner per job at a time (the job's lease). It reads the input lazily, packs compatible rows
into multi-row requests (one request per full batch, so per-item overhead is paid once per batch),
holds at most `window_rows` rows from submission until written (flow control: neither the input nor
the replies are ever all in memory or in Redis), collects replies from the job's own results stream,
sends a request again when its reply is lost, writes outputs strictly in input order and records
progress in Redis several times a second. The loop itself, and what is at-least-once and what
exactly-once, is in `fleet/jobs/feed.py`.

Resume: progress (`written`, `in_offset`, `out_offset`) is saved only after the output it describes
has been flushed, so a runner killed at any moment leaves a record that a later runner can trust: it
truncates the output to `out_offset`, reads the input from `in_offset` and resubmits what was in
flight. Request ids are derived from item positions (`<job>:<first index>+<count>`), so a reply to
the dead runner's request is accepted for the same group; each item is written once, and computed at
most once more than needed. A packed request that fails is retried item by item, so one bad row
fails alone.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from fleet.errors import InvalidInput, ServingError
from fleet.jobs.feed import STOP, Feed
from fleet.jobs.formats import open_input, open_output, remove_output
from fleet.jobs.jsonl_input import DEFAULT_MAX_LINE_BYTES
from fleet.jobs.records import CANCELLED, COMPLETED, FAILED, QUEUED, RUNNING, TERMINAL, JobStore
from fleet.keys import Keys
from fleet.model_spec import ModelSpec
from fleet.repository import scan
from fleet.settings import Settings

__all__ = ["STOP", "JobOptions", "JobRunner", "run_job"]

log = logging.getLogger(__name__)

DEFAULT_REPLY_TIMEOUT_S = 60.0  # for RQ jobs queued before the option existed

# KEYS[1] = lease; ARGV[1] = token, ARGV[2] = ttl ms. Refresh only our own lease.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class JobOptions:
    """The runner's settings, passed as the RQ job's JSON argument (the job worker may run elsewhere)."""

    key_prefix: str
    model_repositories: list[str]
    window_rows: int
    lease_ms: int
    reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES  # one JSONL line; a longer one is that line's error
    parse_processes: int | None = None  # JSONL parser processes; None: by the job worker's cores

    @classmethod
    def from_settings(cls, settings: Settings) -> JobOptions:
        return cls(key_prefix=settings.key_prefix,
                   model_repositories=[str(Path(r).resolve()) for r in settings.model_repositories],
                   window_rows=settings.job_window_rows, lease_ms=settings.job_lease_ms,
                   reply_timeout_s=settings.job_reply_timeout_s, max_line_bytes=settings.max_job_line_bytes,
                   parse_processes=settings.job_parse_processes)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> JobOptions:
        # .get(): RQ runs queued before an option existed carry no value for it
        return cls(key_prefix=str(doc["key_prefix"]), model_repositories=[str(r) for r in doc["model_repositories"]],
                   window_rows=int(doc["window_rows"]), lease_ms=int(doc["lease_ms"]),
                   reply_timeout_s=float(doc.get("reply_timeout_s", DEFAULT_REPLY_TIMEOUT_S)),
                   max_line_bytes=int(doc.get("max_line_bytes", DEFAULT_MAX_LINE_BYTES)),
                   parse_processes=None if doc.get("parse_processes") is None else int(doc["parse_processes"]))

    def to_json(self) -> dict[str, Any]:
        return {"key_prefix": self.key_prefix, "model_repositories": self.model_repositories,
                "window_rows": self.window_rows, "lease_ms": self.lease_ms,
                "reply_timeout_s": self.reply_timeout_s, "max_line_bytes": self.max_line_bytes,
                "parse_processes": self.parse_processes}


def run_job(job_id: str, options: dict[str, Any]) -> str:
    """RQ entry point (by name, JSON arguments only)."""
    from rq import get_current_job

    current = get_current_job()
    client = current.connection if current is not None else None
    if client is None:
        raise RuntimeError("run_job must run inside an RQ job")
    return JobRunner(client, job_id, JobOptions.from_json(options)).run()


class JobRunner:
    def __init__(self, client: redis.Redis, job_id: str, options: JobOptions) -> None:
        self.client = client
        self.job_id = job_id
        self.options = options
        self.keys = Keys(options.key_prefix)
        self.store = JobStore(client, self.keys)
        self.results = self.keys.job_results(job_id)
        self.lease = self.keys.job_lease(job_id)
        self.token = uuid.uuid4().hex

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> str:
        if not self.client.set(self.lease, self.token, nx=True, px=self.options.lease_ms):
            return "another runner holds this job"
        try:
            record = self.store.get(self.job_id)
            if record is None or record["state"] in TERMINAL:
                if record is not None and record["state"] == CANCELLED:
                    self._remove_output(record)  # cancelled while no runner held it: nobody else cleans up
                return "nothing to do"
            now = time.time()
            if not self.store.transition(self.job_id, RUNNING, (QUEUED, RUNNING), {
                    "started_at": record.get("started_at") or now, "run_started_at": now,
                    "run_done_start": record.get("done") or 0, "updated_at": now}):
                return "nothing to do"
            try:
                return self._run(record)
            except redis.RedisError:
                raise  # the record cannot be updated; the lease lapses and another runner resumes
            except Exception as exc:
                log.exception("job %s failed", self.job_id)
                # A ServingError says what is wrong with the job; anything else is a fault of ours, whose
                # Python details belong in the job worker's log, not in the job's record.
                message = (exc.message if isinstance(exc, ServingError)
                           else f"internal error in the job runner ({type(exc).__name__}); see the job worker's log")
                self.finish_state(FAILED, message)
                return f"failed: {message}"
        finally:
            self.client.eval(_RELEASE, 1, self.lease, self.token)

    def finish_state(self, state: str, error: str = "") -> bool:
        """Running -> `state`; False if the job is no longer running (cancelled meanwhile)."""
        return self.store.transition(self.job_id, state, (RUNNING,), {"finished_at": time.time(), "error": error})

    def _remove_output(self, record: dict[str, Any]) -> None:
        if record.get("output"):
            remove_output(Path(record["output"]))

    def _spec(self, model: str) -> ModelSpec:
        repository = scan([Path(r) for r in self.options.model_repositories])
        entry = repository.models.get(model)
        if entry is None:
            raise InvalidInput(f"model '{model}' is not in the model repository")
        return entry.spec

    # ------------------------------------------------------------------ the job

    def _run(self, record: dict[str, Any]) -> str:
        spec = self._spec(record["model"])
        source = open_input(Path(record["input"]), spec, self.options.max_line_bytes, self.options.parse_processes)
        total = record.get("total")
        if total is None:
            total = record["total"] = source.count()
            self.store.update(self.job_id, {"total": total})
        sink = open_output(Path(record["output"]), record["output_format"], spec, total,
                           resume_offset=record.get("out_offset") or 0)
        try:
            feed = Feed(self, record, spec, source, sink)
            outcome = feed.run()
        except (redis.RedisError, KeyboardInterrupt, SystemExit):
            sink.close()  # resumed by another runner: kept as it is
            raise
        except BaseException:
            try:
                sink.finish(partial=True)  # the job fails (run): its rows never written are flagged, as on FAILED
            except Exception:  # (a full disk, say) the fault that failed the job is the one to report
                log.exception("job %s: its output could not be finished", self.job_id)
                sink.close()
            raise
        finally:
            source.close()
        if outcome == COMPLETED:
            sink.finish()
            if not self.finish_state(COMPLETED):  # cancelled between the last item and here
                outcome = CANCELLED
        elif outcome == FAILED:
            # A failed job keeps what it wrote (its completed items are results), finished before the job says
            # it failed: a client that then downloads it finds it whole (an .npz takes seconds to assemble).
            sink.finish(partial=True)
            if not self.finish_state(FAILED, feed.failure):  # cancelled meanwhile
                outcome = CANCELLED
        else:
            sink.close()
        if outcome == CANCELLED:
            self._remove_output(record)  # nobody may download it: it only takes disk space
        self.client.delete(self.results)
        return outcome

    def renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.lease, self.token, self.options.lease_ms))
