"""The bulk job runner: the RQ job function that streams a job's input through the model's lane.

One runner per job at a time (the job's lease). It reads the input lazily, packs compatible rows
into multi-row requests (one request per full batch, so per-item overhead is paid once per batch),
keeps at most `window_rows` rows in flight on the lane (flow control: the input is never all in memory
or in Redis), collects replies from the job's own results stream, writes outputs strictly in input
order and records progress in Redis several times a second.

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
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from fleet.admission import bulk_lane, level_lane
from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, decode_reply, encode_request
from fleet.errors import InvalidInput, ServingError
from fleet.keys import Keys
from fleet.model_config import ModelSpec
from fleet.repository import scan
from gateway.jobs.formats import (
    InputItem,
    JobInput,
    JobOutput,
    explode,
    group_items,
    open_input,
    open_output,
    pack,
    unpack,
)
from gateway.jobs.records import CANCELLED, COMPLETED, FAILED, QUEUED, RUNNING, TERMINAL, JobStore

log = logging.getLogger(__name__)

SAVE_INTERVAL_S = 0.25
READ_BLOCK_MS = 50
RESULTS_TTL_S = 3600  # refreshed while the job runs; a dead job's results stream disappears
INTERRUPTED = "interrupted"

# Set when this job worker is asked to stop (SIGTERM): the runner saves its progress and returns, the
# job stays `running` with its lease released, and the next job worker resumes it.
STOP = threading.Event()

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

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> JobOptions:
        return cls(key_prefix=str(doc["key_prefix"]), model_repositories=[str(r) for r in doc["model_repositories"]],
                   window_rows=int(doc["window_rows"]), lease_ms=int(doc["lease_ms"]))

    def to_json(self) -> dict[str, Any]:
        return {"key_prefix": self.key_prefix, "model_repositories": self.model_repositories,
                "window_rows": self.window_rows, "lease_ms": self.lease_ms}


@dataclass(slots=True)
class _Group:
    """Items sent as one request, in input order; replaced by one group per item if it fails packed."""

    items: list[InputItem]
    request_id: str
    entry: tuple[str, bytes] | None = None  # (lane stream, entry id) while queued, for cancel
    outputs: list[list[WireTensor]] | None = None  # per item, once answered
    errors: list[str | None] = field(default_factory=list)  # per item, once answered
    split: list[_Group] | None = None

    @property
    def rows(self) -> int:
        return sum(i.rows for i in self.items)

    @property
    def resolved(self) -> bool:
        if self.split is not None:
            return all(g.resolved for g in self.split)
        return bool(self.errors)


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
                message = exc.message if isinstance(exc, ServingError) else f"{type(exc).__name__}: {exc}"
                self.finish_state(FAILED, message)
                return f"failed: {message}"
        finally:
            self.client.eval(_RELEASE, 1, self.lease, self.token)

    def finish_state(self, state: str, error: str = "") -> None:
        self.store.transition(self.job_id, state, (RUNNING,), {"finished_at": time.time(), "error": error})

    def _spec(self, model: str) -> ModelSpec:
        repository = scan([Path(r) for r in self.options.model_repositories])
        entry = repository.models.get(model)
        if entry is None:
            raise InvalidInput(f"model '{model}' is not in the model repository")
        return entry.spec

    # ------------------------------------------------------------------ the job

    def _run(self, record: dict[str, Any]) -> str:
        spec = self._spec(record["model"])
        source = open_input(Path(record["input"]), spec)
        total = record.get("total")
        if total is None:
            total = source.count()
            self.store.update(self.job_id, {"total": total})
        sink = open_output(Path(record["output"]), record["output_format"], spec, total,
                           resume_offset=record.get("out_offset") or 0)
        try:
            outcome = _Feed(self, record, spec, source, sink).run()
        except BaseException:
            sink.close()
            raise
        finally:
            source.close()
        if outcome == COMPLETED:
            sink.finish()
            self.finish_state(COMPLETED)
        else:
            sink.close()
        self.client.delete(self.results)
        return outcome

    def renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.lease, self.token, self.options.lease_ms))


class _Feed:
    """One run of the send / collect / write loop over a job's items."""

    def __init__(self, runner: JobRunner, record: dict[str, Any], spec: ModelSpec, source: JobInput,
                 sink: JobOutput) -> None:
        self.runner = runner
        self.record = record
        self.spec = spec
        self.sink = sink
        self.model = record["model"]
        self.version = int(record["version"])
        priority = int(record.get("priority") or 0)
        self.stream = runner.keys.queue(self.model, bulk_lane(spec) if priority == 0 else level_lane(spec, priority))
        self.priority = priority
        self.max_failures = record.get("max_failures")
        self.done = int(record.get("done") or 0)
        self.failed = int(record.get("failed") or 0)
        self.in_offset = int(record.get("in_offset") or 0)
        self.out_offset = int(record.get("out_offset") or 0)
        max_rows = spec.max_batch_size if spec.max_batch_size > 0 else 1
        # Array in, array out: rows are read (and written) a whole batch at a time, never one by one.
        blocks = max_rows if source.kind == "array" and record["output_format"] != "jsonl" else 1
        self.groups: Iterator[list[InputItem]] = group_items(source.read(self.done, self.in_offset, blocks), max_rows)
        self.exhausted = False
        self.order: deque[_Group] = deque()  # submitted or resolved, not yet written, in input order
        self.by_id: dict[str, _Group] = {}  # awaiting a reply
        self.in_flight_rows = 0
        self.errors: list[tuple[int, str]] = []  # samples not yet saved
        self.last_id = b"0-0"

    def run(self) -> str:
        client = self.runner.client
        # Replies to the previous run's requests may still arrive; they match by request id.
        client.delete(self.runner.results)
        next_save = time.monotonic() + SAVE_INTERVAL_S
        while True:
            self._feed()
            self._write_ready()
            if self.max_failures is not None and 0 <= self.max_failures < self.failed:
                self._save()
                self._drop_queued()
                self.runner.finish_state(FAILED, f"{self.failed} items failed (max_failures {self.max_failures})")
                return FAILED
            if self.exhausted and not self.order:
                self._save()
                return COMPLETED
            self._collect()
            if STOP.is_set():
                self._save()
                return INTERRUPTED
            if time.monotonic() >= next_save:
                next_save = time.monotonic() + SAVE_INTERVAL_S
                verdict = self._checkpoint()
                if verdict is not None:
                    return verdict

    # -- sending

    def _feed(self) -> None:
        batch: list[_Group] = []
        while not self.exhausted and self.in_flight_rows < self.runner.options.window_rows:
            items = next(self.groups, None)
            if items is None:
                self.exhausted = True
                break
            group = _Group(items, f"{self.runner.job_id}:{items[0].index}+{len(items)}")
            self.order.append(group)
            if items[0].error is not None:  # unreadable or invalid line: fails alone, never sent
                group.errors = [items[0].error]
                continue
            batch.append(group)
            self.in_flight_rows += group.rows
        self._send(batch)

    def _send(self, groups: list[_Group]) -> None:
        if not groups:
            return
        pipe = self.runner.client.pipeline(transaction=False)
        now_us = time.time_ns() // 1000
        for group in groups:
            first = group.items[0]
            env = RequestEnvelope(id=group.request_id, model=self.model, version=self.version, inputs=pack(group.items),
                                  reply_to=self.runner.results, enqueued_at_us=now_us, outputs=first.outputs,
                                  parameters=first.parameters, priority=self.priority, client_id=first.client_id)
            pipe.xadd(self.stream, {b"d": encode_request(env)})
            self.by_id[group.request_id] = group
        pipe.expire(self.runner.results, RESULTS_TTL_S)
        ids = pipe.execute()
        for group, entry_id in zip(groups, ids, strict=False):
            group.entry = (self.stream, entry_id)

    # -- collecting

    def _collect(self) -> None:
        pipe = self.runner.client.pipeline(transaction=False)
        if self.last_id != b"0-0":
            pipe.xtrim(self.runner.results, minid=self.last_id, approximate=False)
        # Block only when there is nothing else to do: the window is full or the input is done.
        idle = self.exhausted or self.in_flight_rows >= self.runner.options.window_rows
        pipe.xread({self.runner.results: self.last_id}, count=512, block=READ_BLOCK_MS if idle else None)
        result: Any = pipe.execute()[-1]
        for _, entries in result or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                for name, payload in fields.items():
                    if name[:1] == b"d":
                        self._on_reply(decode_reply(payload))

    def _on_reply(self, reply: ReplyEnvelope) -> None:
        group = self.by_id.pop(reply.id, None)
        if group is None:
            return  # a duplicate, or a reply to a request already answered: the first reply wins
        self.in_flight_rows -= group.rows
        group.entry = None
        if reply.ok:
            try:
                group.outputs = unpack(reply.outputs or [], [i.rows for i in group.items])
                group.errors = [None] * len(group.items)
                return
            except InvalidInput as exc:
                reply = ReplyEnvelope(id=reply.id, error_code="INTERNAL", error_message=exc.message)
        if len(group.items) == 1:
            group.errors = [reply.error_message or reply.error_code]
            return
        # A packed request failed: retry its items (rows of a block) one by one so only bad ones fail.
        group.split = [_Group([one], f"{self.runner.job_id}:{one.index}+1")
                       for item in group.items for one in explode(item)]
        self.in_flight_rows += sum(g.rows for g in group.split)
        self._send(group.split)

    # -- writing, in input order

    def _write_ready(self) -> None:
        while self.order and self.order[0].resolved:
            group = self.order.popleft()
            for part in group.split or [group]:
                for i, item in enumerate(part.items):
                    error = part.errors[i]
                    outputs = part.outputs[i] if part.outputs is not None and error is None else None
                    if error is None:
                        try:
                            self.sink.write(item, outputs, None, self.model, self.version)
                        except InvalidInput as exc:  # the writer rejected the reply (shape, missing output)
                            error = exc.message
                    else:
                        self.sink.write(item, None, error, self.model, self.version)
                    if error is not None:
                        self.failed += item.count
                        self.errors.append((item.line, error))
                    self.done += item.count
                    self.in_offset = item.end_offset

    # -- progress, lease, cancel, failure threshold

    def _save(self) -> None:
        self.out_offset = self.sink.flush()  # first the output, then the record that describes it
        errors, self.errors = self.errors, []
        self.runner.store.update(self.runner.job_id, {
            "done": self.done, "failed": self.failed, "written": self.done, "in_offset": self.in_offset,
            "out_offset": self.out_offset, "updated_at": time.time()}, errors)

    def _checkpoint(self) -> str | None:
        self._save()
        if not self.runner.renew():
            log.warning("job %s: lease lost; another runner owns it now", self.runner.job_id)
            return "lease lost"
        record = self.runner.store.get(self.runner.job_id)
        if record is None or record["state"] == CANCELLED:
            self._drop_queued()
            return CANCELLED
        return None

    def _drop_queued(self) -> None:
        """Cancel: requests still queued on the lane are deleted, so no worker computes them."""
        entries = [g.entry for g in self.by_id.values() if g.entry is not None]
        if entries:
            self.runner.client.xdel(self.stream, *[entry_id for _, entry_id in entries])
        self.by_id.clear()
