"""The requests one model's driver (workers/loop.py) holds: each read request as the driver knows it (its
message, envelope, version and scheduler entry), how its scheduler entry is made, and the bookkeeping
around them (how many are traced, which another worker has claimed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from batching.holding import MessageId
from batching.policy import Pending
from fleet.envelope import ReplyEnvelope, RequestEnvelope
from fleet.redis_time import RedisClock
from fleet.trace_points import COMPUTE_END, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_START
from workers.execute import BatchOutcome


@dataclass(slots=True)
class HeldRequest:
    message: MessageId
    env: RequestEnvelope
    version: int
    pending: Pending
    lost: bool = False  # claimed by another worker (this one stalled): never acknowledged by this one


def pending_for(message: MessageId, env: RequestEnvelope, rows: int, shape_key: Hashable, delay_on_timeout: bool,
                to_local: Callable[[int], int], now: int) -> Pending:
    """The scheduler's entry for a request read `now`. Its times are in Redis's clock: `to_local` converts
    them to this process's, once. Its queue delay counts from when the gateway enqueued it."""
    lane, entry_id = message
    deadline = None if env.deadline_us is None else to_local(env.deadline_us)
    delay = delay_on_timeout
    if env.expires_us is not None and (deadline is None or to_local(env.expires_us) < deadline):
        # The caller stops waiting before the queue policy would act: drop it then (never DELAY).
        deadline, delay = to_local(env.expires_us), False
    return Pending(request_id=f"{lane}/{entry_id.decode()}", lane=lane,
                   enqueued_at_us=min(now, to_local(env.enqueued_at_us)), deadline_us=deadline, rows=rows,
                   shape_key=shape_key, delay_on_timeout=delay, aging_from_us=now)


class HeldRequests:
    """By scheduler request id (Pending.request_id)."""

    def __init__(self) -> None:
        self._by_id: dict[str, HeldRequest] = {}
        # How many held requests are traced (the trace extension): while 0, tracing costs a batch one check.
        self.traced = 0

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __getitem__(self, request_id: str) -> HeldRequest:
        return self._by_id[request_id]

    def add(self, held: HeldRequest) -> None:
        self._by_id[held.pending.request_id] = held
        if held.env.trace is not None:
            self.traced += 1

    def forget(self, items: Iterable[Pending]) -> list[HeldRequest]:
        """These are answered or dropped: no longer held."""
        held = [self._by_id.pop(p.request_id) for p in items]
        if self.traced:
            self.traced -= sum(1 for h in held if h.env.trace is not None)
        return held

    def of_callers(self, request_ids: set[str]) -> dict[int, set[str]]:
        """Per version, the scheduler ids of the held requests with these envelope ids."""
        by_version: dict[int, set[str]] = {}
        for held in self._by_id.values():
            if held.env.id in request_ids:
                by_version.setdefault(held.version, set()).add(held.pending.request_id)
        return by_version

    def mark_lost(self, messages: list[MessageId]) -> dict[int, set[str]]:
        """Another worker claimed these messages: the held ones are marked; per version, their scheduler ids."""
        by_version: dict[int, set[str]] = {}
        for lane, entry_id in messages:
            held = self._by_id.get(f"{lane}/{entry_id.decode()}")
            if held is not None:
                held.lost = True
                by_version.setdefault(held.version, set()).add(held.pending.request_id)
        return by_version


def enqueue_times(held: list[HeldRequest], clock: RedisClock) -> list[int]:
    """When each request was enqueued, on this process's clock (`clock.to_local`, inlined: per request)."""
    offset = clock.offset_us
    return [h.env.enqueued_at_us - offset for h in held]


def stamp_replies(held: list[HeldRequest], replies: list[ReplyEnvelope], outcome: BatchOutcome | None,
                  redis_now_ns: int) -> None:
    """Traced requests' replies carry their timestamps back, with the batch's compute times (the instance
    measured them on perf_counter: converted here to Redis's clock, ns)."""
    stamps: dict[str, int] = {}
    if outcome is not None:
        start = outcome.started_ns + redis_now_ns - time.perf_counter_ns()
        output_start = start + outcome.compute_input_ns + outcome.compute_infer_ns + outcome.handed_over_ns
        stamps = {COMPUTE_START: start, COMPUTE_INPUT_END: start + outcome.compute_input_ns,
                  COMPUTE_OUTPUT_START: output_start, COMPUTE_END: output_start + outcome.compute_output_ns}
    for h, reply in zip(held, replies, strict=True):
        if h.env.trace is not None:
            reply.trace = h.env.trace | stamps


def stamp(envs: list[RequestEnvelope], point: str, now_ns: int) -> None:
    """The traced requests among `envs` passed trace point `point` at `now_ns` (Redis's clock)."""
    for env in envs:
        if env.trace is not None:
            env.trace[point] = now_ns
