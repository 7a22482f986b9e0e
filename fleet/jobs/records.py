"""Bulk job records in Redis: one hash per job (state and progress), a capped list of failed-item
samples, and an index sorted by creation time. Synchronous (redis-py): the runner is a plain RQ job
function and the gateway calls these through a thread; none of it is on the inference hot path.

States: queued -> running -> completed | failed | cancelled. A running job whose runner died goes back
to being run by another job worker (fleet/jobs/recovery.py); its progress fields say where it stopped.
Failed items are kept two ways: the first ERROR_SAMPLES as samples (line and message), and all of them
counted by message in the record's `error_counts` (ErrorCounts), which the summary's `common_errors` shows.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from fleet.errors import InvalidInput
from fleet.keys import Keys

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "running", "completed", "failed", "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})
ERROR_SAMPLES = 20
# Distinct messages counted per job (a file of garbage has as many messages as lines); past it, the rest
# are counted under OTHER_ERRORS. Messages are cut at MAX_ERROR_CHARS (a model's error may be long).
MAX_ERROR_KINDS = 50
MAX_ERROR_CHARS = 500
OTHER_ERRORS = "(other errors)"
COMMON_ERRORS = 5  # shown in a job's summary
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

# KEYS = job hash, index, unfinished set, state counts; ARGV[1] = score, ARGV[2] = id, then field/value
# pairs. Jobs are counted per state as they move (jobs are never deleted), so /metrics reads one hash.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[4], 'queued', 1)
return 1
"""

# KEYS = job hash, unfinished set, state counts; ARGV[1] = new state, ARGV[2] = ",allowed,from,states,",
# ARGV[3] = 1 if the new state is terminal, ARGV[4] = id, then field/value pairs.
_TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if not string.find(ARGV[2], ',' .. state .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
if state ~= ARGV[1] then
  redis.call('HINCRBY', KEYS[3], state, -1)
  redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
end
if #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[4]) end
return 1
"""

# Integer fields of the record (everything else is a string).
_INTS = ("version", "priority", "total", "done", "failed", "written", "in_offset", "out_offset", "max_failures",
         "pack_batches", "attempts", "run_done_start")
_FLOATS = ("created_at", "started_at", "finished_at", "updated_at", "run_started_at")


def check_id(job_id: str) -> str:
    """Job ids name files, keys and RQ jobs: letters, digits, "_" and "-", at most 64."""
    if not _ID.fullmatch(job_id):
        raise InvalidInput(f"invalid job id {job_id!r}: use 1-64 letters, digits, '_' or '-'")
    return job_id


def _flat(fields: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in fields.items():
        out += [key, "" if value is None else str(value)]
    return out


class JobStore:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self.keys = keys

    def create(self, job_id: str, fields: Mapping[str, Any]) -> bool:
        """Store a new record; False (and nothing changed) if the id exists: resubmission is idempotent."""
        now = time.time()
        record = {"id": job_id, "state": QUEUED, "created_at": now, "done": 0, "failed": 0, "written": 0,
                  "in_offset": 0, "out_offset": 0, "attempts": 0, **fields}
        created = self._client.eval(_CREATE, 4, self.keys.job(job_id), self.keys.jobs(),
                                    self.keys.jobs_unfinished(), self.keys.job_states(), now, job_id,
                                    *_flat(record))
        return bool(created)

    def get(self, job_id: str) -> dict[str, Any] | None:
        raw: Any = self._client.hgetall(self.keys.job(job_id))
        return decode_record(raw) if raw else None

    def get_many(self, job_ids: list[str]) -> list[dict[str, Any]]:
        """The records of `job_ids` that exist, in order, in one round trip."""
        pipe = self._client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
        return [decode_record(raw) for raw in pipe.execute() if raw]

    def ids(self, limit: int = 100) -> list[str]:
        """The newest `limit` job ids, newest first."""
        raw: Any = self._client.zrevrange(self.keys.jobs(), 0, limit - 1)
        return [r.decode() if isinstance(r, bytes) else str(r) for r in raw]

    def unfinished_ids(self) -> list[str]:
        raw: Any = self._client.smembers(self.keys.jobs_unfinished())
        return sorted(r.decode() if isinstance(r, bytes) else str(r) for r in raw)

    def update(self, job_id: str, fields: Mapping[str, Any], errors: Iterable[tuple[int, str]] = ()) -> None:
        """Progress and error samples in one transaction, so a resumed runner never sees half of it."""
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self.keys.job(job_id), mapping={k: "" if v is None else str(v) for k, v in fields.items()})
        samples = [json.dumps({"line": line, "error": message}) for line, message in errors]
        if samples:
            pipe.rpush(self.keys.job_errors(job_id), *samples)
            pipe.ltrim(self.keys.job_errors(job_id), 0, ERROR_SAMPLES - 1)
        pipe.execute()

    def transition(self, job_id: str, to: str, allowed_from: Iterable[str],
                   fields: Mapping[str, Any] | None = None) -> bool:
        """Compare-and-set the state; False if the job is gone or not in one of `allowed_from`."""
        result = self._client.eval(_TRANSITION, 3, self.keys.job(job_id), self.keys.jobs_unfinished(),
                                   self.keys.job_states(), to,
                                   f",{','.join(allowed_from)},", "1" if to in TERMINAL else "0", job_id,
                                   *_flat(fields or {}))
        return bool(result == 1)

    def errors(self, job_id: str) -> list[dict[str, Any]]:
        raw: Any = self._client.lrange(self.keys.job_errors(job_id), 0, ERROR_SAMPLES - 1)
        return [json.loads(r) for r in raw]


class ErrorCounts:
    """A job's failed items counted by error message: bounded, saved in its record as JSON."""

    __slots__ = ("counts",)

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts: dict[str, int] = counts or {}

    @classmethod
    def from_json(cls, raw: str | None) -> ErrorCounts:
        if not raw:
            return cls()
        try:
            doc = json.loads(raw)
        except ValueError:
            return cls()  # a damaged field costs the summary, never the job
        if not isinstance(doc, dict):
            return cls()
        return cls({str(k): int(v) for k, v in doc.items() if isinstance(v, int)})

    def to_json(self) -> str:
        return json.dumps(self.counts, separators=(",", ":"))

    def add(self, message: str, n: int = 1) -> None:
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + "..."
        counts = self.counts
        if message not in counts and len(counts) >= MAX_ERROR_KINDS:
            message = OTHER_ERRORS
        counts[message] = counts.get(message, 0) + n

    def most_common(self, k: int = COMMON_ERRORS) -> list[tuple[str, int]]:
        """The `k` most frequent messages with their counts, most frequent first (ties: by message)."""
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]

    def most_common_text(self, unit: str) -> str:
        top = self.most_common(1)
        if not top:
            return "no error recorded"
        message, count = top[0]
        return f"most common error ({count} {unit}): {message}"


def decode_record(raw: Mapping[Any, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for key, value in raw.items():
        k = key.decode() if isinstance(key, bytes) else str(key)
        v = value.decode() if isinstance(value, bytes) else str(value)
        if k in _INTS:
            record[k] = int(v) if v else None
        elif k in _FLOATS:
            record[k] = float(v) if v else None
        else:
            record[k] = v
    return record


def view(record: Mapping[str, Any], errors: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """The API's JSON for a job: the record plus throughput (items/s of the current run) and ETA."""
    now = time.time() if now is None else now
    state = record.get("state", "")
    done, total = int(record.get("done") or 0), record.get("total")
    run_start = record.get("run_started_at")
    end = record.get("finished_at") if state in TERMINAL and record.get("finished_at") else now
    throughput = 0.0
    if run_start and end and end > run_start:
        throughput = (done - int(record.get("run_done_start") or 0)) / (end - run_start)
    eta = None
    if state == RUNNING and total is not None and throughput > 0:
        eta = max(0.0, (total - done) / throughput)
    return {
        "id": record.get("id"), "model": record.get("model"), "version": str(record.get("version") or ""),
        "state": state, "priority": record.get("priority") or 0, "total": total, "done": done,
        "failed": int(record.get("failed") or 0), "written": int(record.get("written") or 0),
        "throughput": round(throughput, 1), "eta_s": None if eta is None else round(eta, 1),
        "errors": errors, "error": record.get("error") or "",
        "common_errors": [{"error": message, "count": count}
                          for message, count in ErrorCounts.from_json(record.get("error_counts")).most_common()],
        "created_at": record.get("created_at"), "started_at": record.get("started_at"),
        "finished_at": record.get("finished_at"), "attempts": int(record.get("attempts") or 0),
        "max_failures": record.get("max_failures"), "pack_batches": record.get("pack_batches") or 1,
        "input": {"kind": record.get("input_kind") or ""},
        "output": {"format": record.get("output_format") or ""},
    }
