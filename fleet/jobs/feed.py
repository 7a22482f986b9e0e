"""One run of a bulk job over its items: send requests, collect replies, write outputs in input order.

Flow control: at most `window_rows` rows are held, counted from the moment a row is submitted until it is
written to the output, not merely until it is answered: answered rows waiting behind an unanswered head still
count, so however long the head takes, the runner holds (and Redis queues) at most a window of rows.

Liveness: a request without a reply `reply_timeout_s` after it was sent is checked. If its stream entry
still exists (queued on the lane, or held by a worker that has not replied yet), it is not lost and its
timer restarts. If the entry is gone and no reply came, it is sent again with the same request id.
Workers write a reply before they delete its request (one ordered pipeline), and the check reads
the results stream after looking for the entry, in the same round trip; so "gone and unanswered" means
the reply is lost: trimmed or deleted from the results stream, or lost in a Redis restart or failover (a
job's requests and replies are not logged to the AOF or the replicas: fleet/unlogged.py). A results
stream found gone or gone back below the last reply read (Redis lost it, on a clock behind) is read from
its start again at that check (fleet/jobs/results.py).

Delivery: computing is at-least-once (a lost reply is computed again; a resumed run sends again what
the dead run had in flight), output is exactly-once per item: replies are matched by request id, the
first reply wins and later duplicates are dropped, and each item is written once, in input order.

Failure: an item that cannot be read, parsed, encoded or computed is that item's error, and the job goes
on. The job itself fails when more than `max_failures` items failed, or, when `max_failures` is not set,
fast: as soon as the first FAIL_FAST_ITEMS items (all of them, in a smaller job) have all failed, since
then the input does not fit the model (a wrong shape, datatype or input name on every line) and the
rest would fail the same way. Failures are also counted by message (bounded), for the job's summary.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from fleet.admission import bulk_lane, level_lane
from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, encode_request, readable_reply
from fleet.errors import InvalidInput, ServingError
from fleet.jobs.formats import (
    InputItem,
    JobInput,
    JobOutput,
    check_rows,
    explode,
    group_items,
    pack,
    request_batches,
    write_each,
)
from fleet.jobs.records import CANCELLED, COMPLETED, ERROR_SAMPLES, FAILED, ErrorCounts
from fleet.jobs.results import RESULTS_TTL_S, ResultsReader
from fleet.model_spec import ModelSpec
from fleet.redis_time import RedisClock
from fleet.unlogged import UNLOGGED_XADD

if TYPE_CHECKING:
    from fleet.jobs.runner import JobRunner

log = logging.getLogger(__name__)

SAVE_INTERVAL_S = 0.25
INTERRUPTED = "interrupted"
# Without max_failures, a job whose first this many items (or all, if fewer) all failed fails at once.
FAIL_FAST_ITEMS = 100
INT64 = (-(2**63), 2**63 - 1)

# Set when this job worker is asked to stop (SIGTERM): the runner saves its progress and returns, the
# job stays `running` with its lease released, and the next job worker resumes it.
STOP = threading.Event()


@dataclass(slots=True)
class _Group:
    """Items sent as one request, in input order; replaced by one group per item if it fails packed."""

    items: list[InputItem]
    request_id: str
    entry: bytes | None = None  # the lane entry id of the latest submission, while unanswered
    sent_at: float = 0.0  # monotonic: the latest submission, or the latest check that found it queued
    reply: list[WireTensor] | None = None  # the items' outputs, their rows in order, once answered
    errors: list[str | None] = field(default_factory=list)  # per item, once answered with an error (or not sent)
    split: list[_Group] | None = None

    @property
    def rows(self) -> int:
        return sum(i.rows for i in self.items)

    def parts(self) -> list[_Group]:
        """The groups its items were last sent in, in order: itself, or (once split, perhaps again) its parts'."""
        return [self] if self.split is None else [leaf for part in self.split for leaf in part.parts()]

    @property
    def resolved(self) -> bool:
        if self.split is not None:
            return all(g.resolved for g in self.split)
        return self.reply is not None or bool(self.errors)


class Feed:
    """The send / collect / write loop of one run; `run()` returns the outcome (a state, or why it stopped)."""

    def __init__(self, runner: JobRunner, record: dict[str, Any], spec: ModelSpec, source: JobInput,
                 sink: JobOutput) -> None:
        self.runner = runner
        self.window_rows = runner.options.window_rows
        self.reply_timeout_s = runner.options.reply_timeout_s
        self.sink = sink
        self.model = record["model"]
        self.version = int(record["version"])
        priority = int(record.get("priority") or 0)
        self.stream = runner.keys.queue(self.model, bulk_lane(spec) if priority == 0 else level_lane(spec, priority),
                                         version=self.version)
        self.priority = priority
        self.max_failures = record.get("max_failures")
        self.done = int(record.get("done") or 0)
        self.failed = int(record.get("failed") or 0)
        total = int(record.get("total") or 0)
        explicit = self.max_failures is not None and self.max_failures >= 0
        # The fail-fast check runs when a failure brings `done` to this many with none succeeded.
        self.fail_fast_at = None if explicit or total == 0 else min(FAIL_FAST_ITEMS, total)
        self.unit = "lines" if source.kind == "jsonl" else "rows"
        self.error_counts = ErrorCounts.from_json(record.get("error_counts"))
        self.counts_saved = True
        # Why the job fails fast, set when the all-failed prefix is complete (the counts as of then). A run
        # that stopped right after such a prefix was written, before it could act on it, acts now.
        self.fail_fast: str | None = None
        if self.fail_fast_at is not None and self.failed == self.done >= self.fail_fast_at:
            self.fail_fast = self._fail_fast_reason()
        self.in_offset = int(record.get("in_offset") or 0)
        self.out_offset = int(record.get("out_offset") or 0)
        max_rows = spec.max_batch_size if spec.max_batch_size > 0 else 1
        # Array in, array out: rows are read (and written) a whole batch at a time, never one by one.
        blocks = max_rows if source.kind == "array" and record["output_format"] != "jsonl" else 1
        # Several batches' rows in one request where the job says so and the model runs it in parts.
        self.max_rows = max_rows
        pack = request_batches(spec, priority, int(record.get("pack_batches") or 1), self.window_rows)
        self.groups: Iterator[list[InputItem]] = group_items(source.read(self.done, self.in_offset, blocks),
                                                             max_rows * pack)
        self.exhausted, self.failure = False, ""
        self.order: deque[_Group] = deque()  # submitted or resolved, not yet written, in input order
        self.by_id: dict[str, _Group] = {}  # awaiting a reply
        self.held_rows = 0  # rows of `order`: from submission until written
        self.resent = 0  # requests sent again after their reply was lost
        self.next_check = math.inf  # monotonic: the earliest time a request may be overdue
        self.errors: list[tuple[int, str]] = []  # samples not yet saved
        self.results = ResultsReader(runner.client, runner.results, runner.job_id)
        # Envelope times are Redis's clock (fleet/redis_time.py); sampled again at every checkpoint.
        self.redis_clock = RedisClock()
        self._sample_clock()

    def run(self) -> str:
        client = self.runner.client
        # Replies to the previous run's requests may still arrive; they match by request id.
        client.delete(self.runner.results)
        next_save = time.monotonic() + SAVE_INTERVAL_S
        while True:
            self._feed()
            self._write_ready()
            reason = self._failure()
            if reason is not None:
                self._save()
                self._drop_queued()
                self.failure = reason  # recorded by the runner, once the output is finished
                return FAILED
            if self.exhausted and not self.order:
                self._save()
                return COMPLETED
            self._collect()
            if STOP.is_set():
                self._save()
                return INTERRUPTED
            now = time.monotonic()
            if now >= self.next_check:
                self._resend_lost(now)
            if now >= next_save:
                next_save = now + SAVE_INTERVAL_S
                verdict = self._checkpoint()
                if verdict is not None:
                    return verdict

    # -- sending

    def _feed(self) -> None:
        batch: list[_Group] = []
        while not self.exhausted and self.held_rows < self.window_rows:
            items = next(self.groups, None)
            if items is None:
                self.exhausted = True
                break
            group = _Group(items, f"{self.runner.job_id}:{items[0].index}+{len(items)}")
            self.order.append(group)
            self.held_rows += group.rows
            if items[0].error is not None:  # unreadable or invalid line: fails alone, never sent
                group.errors = [items[0].error]
                continue
            batch.append(group)
        self._send(batch)

    def _send(self, groups: list[_Group]) -> None:
        """XADD each group's request (again, for a resend: same request id) and start its reply timer. A
        request that cannot be encoded fails its items here (they share its parameters), never the job."""
        if not groups:
            return
        pipe = self.runner.client.pipeline(transaction=False)
        now_us = self.redis_clock.to_redis(self.redis_clock.now_us())
        sent: list[_Group] = []
        for group in groups:
            first = group.items[0]
            env = RequestEnvelope(id=group.request_id, model=self.model, version=self.version, inputs=pack(group.items),
                                  reply_to=self.runner.results, enqueued_at_us=now_us, outputs=first.outputs,
                                  parameters=first.parameters, priority=self.priority, client_id=first.client_id)
            try:
                payload = encode_request(env)
            except (ServingError, OverflowError, ValueError, TypeError) as exc:
                group.errors = [_unencodable(first, exc)] * len(group.items)
                continue
            pipe.eval(UNLOGGED_XADD, 1, self.stream, "*", "d", payload)  # not logged (AOF, replicas): fleet/unlogged.py
            self.by_id[group.request_id] = group
            sent.append(group)
        if not sent:
            return
        pipe.expire(self.runner.results, RESULTS_TTL_S)
        ids = pipe.execute()
        sent_at = time.monotonic()
        for group, entry_id in zip(sent, ids, strict=False):
            group.entry = entry_id
            group.sent_at = sent_at
        self.next_check = min(self.next_check, sent_at + self.reply_timeout_s)

    # -- collecting

    def _collect(self) -> None:
        pipe = self.runner.client.pipeline(transaction=False)
        # Block only when there is nothing else to do: the window is full or the input is done.
        self.results.queue_read(pipe, block=self.exhausted or self.held_rows >= self.window_rows)
        self._on_replies(pipe.execute()[-1])

    def _on_replies(self, result: Any) -> None:
        for payload in self.results.payloads(result):
            # A corrupt entry must not end the job: its request is sent again at its timeout.
            reply = readable_reply(payload, "a job's reply")
            if reply is not None:
                self._on_reply(reply)

    def _on_reply(self, reply: ReplyEnvelope) -> None:
        group = self.by_id.pop(reply.id, None)
        if group is None:
            return  # a duplicate, or a reply to a request already answered: the first reply wins
        group.entry = None
        if reply.ok:
            try:
                outputs = list(reply.outputs or [])
                check_rows(outputs, [i.rows for i in group.items])  # (split as they are written: write_reply)
                group.reply = outputs
                return
            except InvalidInput as exc:
                reply = ReplyEnvelope(id=reply.id, error_code="INTERNAL", error_message=exc.message)
        if len(group.items) == 1 and group.items[0].count == 1:
            group.errors = [reply.error_message or reply.error_code]
            return
        # A packed request failed: retry its items (rows of a block) one by one so only bad ones fail; one of
        # several batches' rows (`pack_batches`), as its items would have gone unpacked (a failed one of those is
        # then retried item by item). Same rows, still held by the parent group: the window count does not change.
        job = self.runner.job_id
        if group.rows > self.max_rows:
            group.split = [_Group(g, f"{job}:{g[0].index}+{len(g)}") for g in group_items(group.items, self.max_rows)]
        else:
            # A block's rows one by one too, under ids of their own (its first row's plain id is the block's).
            group.split = [_Group([one], f"{job}:{one.index}+1" + ("/r" if item.count > 1 else ""))
                           for item in group.items for one in explode(item)]
        self._send(group.split)

    # -- liveness: a lost reply never stalls the job

    def _resend_lost(self, now: float) -> None:
        """Check every request unanswered for `reply_timeout_s`: one whose lane entry still exists waits on
        (its timer restarts); one whose entry is gone without a reply is sent again, same request id."""
        overdue = [g for g in self.by_id.values() if now - g.sent_at >= self.reply_timeout_s]
        if overdue:
            self.results.reread_if_rewound()
            pipe = self.runner.client.pipeline(transaction=False)
            for group in overdue:
                entry = group.entry or b"0-0"
                pipe.xrange(self.stream, min=entry, max=entry, count=1)
            # After the lookups, in the same round trip: a reply written before its entry was deleted is
            # read here, never mistaken for a lost one.
            self.results.queue_read_all(pipe)
            *found, replies = pipe.execute()
            self._on_replies(replies)
            lost = []
            for group, entries in zip(overdue, found, strict=True):
                if entries:
                    group.sent_at = now  # queued or being computed: not lost
                elif group.request_id in self.by_id:
                    lost.append(group)
            if lost:
                self.resent += len(lost)
                log.warning("job %s: %d request(s) unanswered for %.0f s and gone from %s; sending them again "
                            "(%d so far)", self.runner.job_id, len(lost), self.reply_timeout_s, self.stream,
                            self.resent)
                self._send(lost)
        self.next_check = min((g.sent_at for g in self.by_id.values()), default=math.inf) + self.reply_timeout_s

    # -- writing, in input order

    def _write_ready(self) -> None:
        while self.order and self.order[0].resolved:
            group = self.order.popleft()
            self.held_rows -= group.rows
            for part in group.parts():
                if part.reply is not None:
                    errors = self.sink.write_reply(part.items, part.reply, self.model, self.version)
                else:
                    errors = write_each(self.sink, part.items, [None] * len(part.items), part.errors, self.model,
                                        self.version)
                for item, error in zip(part.items, errors, strict=True):
                    self.done += item.count
                    self.in_offset = item.end_offset
                    if error is not None:
                        self._on_failed(item, error)

    def _on_failed(self, item: InputItem, error: str) -> None:
        """Count a written failure; only failures pay for this, the success path stays as it was."""
        self.failed += item.count
        if self.failed - item.count < ERROR_SAMPLES:  # the record keeps the first samples only
            self.errors.append((item.line, error))
        self.error_counts.add(error, item.count)
        self.counts_saved = False
        # `failed == done`: nothing has succeeded yet, so this failure completes an all-failed prefix.
        if self.fail_fast is None and self.fail_fast_at is not None and self.failed == self.done >= self.fail_fast_at:
            self.fail_fast = self._fail_fast_reason()

    def _fail_fast_reason(self) -> str:
        n = self.done
        which = f"all {n} {self.unit}" if n < FAIL_FAST_ITEMS else f"the first {n} {self.unit} all"
        return f"{which} failed; {self.error_counts.most_common_text(self.unit)}"

    def _failure(self) -> str | None:
        """Why the job fails now, or None: the fail-fast rule, or more than max_failures failed."""
        if self.fail_fast is not None:
            return self.fail_fast
        if self.max_failures is not None and 0 <= self.max_failures < self.failed:
            return (f"{self.failed} items failed (max_failures {self.max_failures}); "
                    f"{self.error_counts.most_common_text('items')}")
        return None

    # -- progress, lease, cancel, failure threshold

    def _save(self) -> None:
        self.out_offset = self.sink.flush()  # first the output, then the record that describes it
        errors, self.errors = self.errors, []
        fields: dict[str, Any] = {
            "done": self.done, "failed": self.failed, "written": self.done, "in_offset": self.in_offset,
            "out_offset": self.out_offset, "updated_at": time.time()}
        if not self.counts_saved:
            fields["error_counts"] = self.error_counts.to_json()
            self.counts_saved = True
        self.runner.store.update(self.runner.job_id, fields, errors)

    def _sample_clock(self) -> None:
        try:
            self.redis_clock.sample_sync(self.runner.client)
        except redis.ResponseError as exc:  # TIME not allowed to this ACL user: envelope times stay local
            log.debug("job %s: cannot read Redis's clock: %s", self.runner.job_id, exc)

    def _checkpoint(self) -> str | None:
        self._save()
        self._sample_clock()
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
            self.runner.client.xdel(self.stream, *entries)
        self.by_id.clear()


def _unencodable(item: InputItem, exc: Exception) -> str:
    """What the client sent that the envelope cannot carry (msgpack: integers beyond 64 bits)."""
    if isinstance(exc, ServingError):
        return exc.message
    for key, value in item.parameters.items():
        if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
            return f"parameter '{key}' is outside the signed 64-bit integer range"
    if isinstance(exc, OverflowError):
        return "the request holds an integer outside the 64-bit range"
    return "the request cannot be encoded for the model's queue"
