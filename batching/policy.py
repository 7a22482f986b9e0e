"""Dynamic batching policy: Triton's ``GetDynamicBatch`` as a pure function of plain values.

The worker loop (``workers/loop.py``) turns its queue into ``Pending`` values, reads its clock once and
asks ``decide(policy, pending, now_us)`` what to do. The answer is a value, never an effect:

* ``Reject(items)``  - these requests expired while queued under REJECT; answer them with a timeout,
                       never run them. (Expired requests under DELAY stay, behind the unexpired ones.)
* ``Dispatch(items)`` - run exactly these requests, in this order, as one batch now.
* ``Wait(until_us)`` - nothing is ready; call ``decide`` again at ``until_us`` or on a new arrival.
* ``None``           - the queue is empty.

The driver removes whatever a ``Reject`` or ``Dispatch`` names and calls ``decide`` again, so one call
answers one question. This module reads no clock and does no I/O (style.md §3); all times are integer
epoch microseconds, the unit of Triton's ``max_queue_delay_microseconds``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeAlias

__all__ = ["BatchPolicy", "Decision", "Dispatch", "Pending", "Reject", "Wait", "decide", "effective_lane",
           "order"]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How one model batches; built from its ``config.pbtxt`` (protocol.md §3.4).

    ``max_batch_size`` is in rows; 0 means the model does not batch, so every request runs alone.
    ``preferred_batch_sizes`` is already normalised by the config parser; sizes above
    ``max_batch_size`` are simply never reached. ``dynamic`` is False when the config has no
    ``dynamic_batching`` block: then requests run one per dispatch, in order.

    Priority between lanes is strict, as between Triton's priority levels: a level-2 request never
    overtakes a level-1 request. ``aging_us`` is fleet's extension for its own bulk lane
    (``bulk_lane``; -1 = none): a bulk request that has waited ``aging_us`` since
    ``Pending.aging_from_us`` competes in the lowest online lane, in arrival order with it, so an
    offline job keeps moving (slowly) under a saturating online load. It never lifts an online
    request, and never lifts bulk above the lowest online level. 0 = strict for the bulk lane too.
    Raises ValueError on negative sizes or delays.
    """

    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    dynamic: bool = True
    aging_us: int = 0
    bulk_lane: int = -1

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}")
        if self.aging_us < 0:
            raise ValueError(f"aging_us must be >= 0, got {self.aging_us}")
        if any(size < 1 for size in self.preferred_batch_sizes):
            raise ValueError(f"preferred batch sizes must be >= 1, got {self.preferred_batch_sizes}")


# Not frozen, though never changed in place (a new one is made with dataclasses.replace): one is made for
# every request a worker reads, and a frozen dataclass's __init__ (object.__setattr__ field by field) took
# 1.3 µs against 0.5 (bench/RESULTS.md, stop 63). So it is not hashable, nor are the plans that hold it.
@dataclass(slots=True)
class Pending:
    """One queued request, as the policy sees it.

    ``lane`` 0 is the highest priority. ``deadline_us`` is absolute (None = no queue timeout); a request
    whose deadline is ``<= now_us`` has expired: it is rejected, or with ``delay_on_timeout`` (Triton's
    DELAY action) kept but served behind every unexpired request of its lane and the lanes above.
    ``rows`` is the request's size along the batch axis (>= 1, else ValueError). Two requests may share
    a batch only if their ``shape_key`` values are equal (protocol.md §3.6); the driver puts whatever
    must match (shapes, input names) into it. ``aging_from_us`` is when the request started competing
    for this worker's instances (None = ``enqueued_at_us``); lane aging counts from there, so a bulk
    item that sat in Redis for a minute is not promoted the moment a worker reads it.
    ``instance``: see the field.
    """

    request_id: str
    lane: int
    enqueued_at_us: int
    deadline_us: int | None
    rows: int
    shape_key: Hashable = None
    delay_on_timeout: bool = False
    aging_from_us: int | None = None
    # The instance a sequence's request must run on (batching/sequences.py); None = any. Only a scheduler
    # configured `pinned` reads it.
    instance: int | None = None

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"request {self.request_id!r}: rows must be >= 1, got {self.rows}")


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Run these requests as one batch now, in this order (never empty)."""

    items: tuple[Pending, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """Re-evaluate at ``until_us`` or on a new arrival, whichever comes first; always ``> now_us``."""

    until_us: int


@dataclass(frozen=True, slots=True)
class Reject:
    """These requests expired while queued (``deadline_us <= now_us``): answer them with a timeout."""

    items: tuple[Pending, ...]


Decision: TypeAlias = Dispatch | Wait | Reject


@dataclass(frozen=True, slots=True)
class _Walk:
    """Where the scan of the candidates stopped (counts are prefix lengths of the candidate list)."""

    taken: int  # requests accumulated into the pending batch
    rows: int  # their total rows
    best: int  # prefix to send early (preferred size or saturation point); 0 = none
    stopped_early: bool  # the next request did not fit (max size) or did not match (shape_key)


def decide(policy: BatchPolicy, pending: Sequence[Pending], now_us: int) -> Decision | None:
    """Decide what the worker should do with its queue at ``now_us``.

    ``pending`` is the whole queue in arrival order. Returns None iff it is empty. Otherwise:

    1. If any request has expired under REJECT, ``Reject`` all of them (in arrival order) before
       anything else, so such a request is never dispatched.
    2. Candidates are ranked by ``order``: effective lane (after aging), then unexpired before delayed,
       then arrival. A ``Dispatch`` is always a non-empty prefix of that order: a lower-priority request
       never overtakes a higher-priority one, and nothing overtakes an earlier request of its rank.
    3. Without dynamic batching (or with ``max_batch_size == 0``) the first candidate runs alone.
    4. Otherwise Triton's ``GetDynamicBatch`` (protocol.md §3.5): a dispatch holds at most
       ``max_batch_size`` rows, except that a lone oversize request still runs (so nothing deadlocks),
       and requests are never split. A ``Wait`` never reaches past any queued request's
       ``enqueued_at_us + max_queue_delay_us`` nor past its deadline.
    """
    if not pending:
        return None
    # One pass (over every queued request, at every step): what expired under REJECT, and whether the queue
    # needs ranking at all. It is in service order already unless its lanes differ, a DELAY request's
    # deadline has passed (it goes behind the others) or its bulk requests may have aged.
    expired: list[Pending] = []
    lane = pending[0].lane
    ranked = not (policy.aging_us and lane == policy.bulk_lane and lane != 0)
    for p in pending:
        deadline = p.deadline_us
        if deadline is not None and deadline <= now_us:
            if p.delay_on_timeout:
                ranked = False
            else:
                expired.append(p)
        if p.lane != lane:
            ranked = False
    if expired:
        return Reject(tuple(expired))
    candidates = pending if ranked else order(policy, pending, now_us)
    if not policy.dynamic or policy.max_batch_size == 0:
        return Dispatch((candidates[0],))
    return _dynamic_batch(policy, candidates, now_us)


def effective_lane(policy: BatchPolicy, item: Pending, now_us: int) -> int:
    """The lane ``item`` competes in at ``now_us``: its own, except that a bulk request that has waited
    ``aging_us`` competes in the lowest online lane (the one just above the bulk lane)."""
    if policy.aging_us == 0 or item.lane != policy.bulk_lane or item.lane == 0:
        return item.lane
    since = item.enqueued_at_us if item.aging_from_us is None else item.aging_from_us
    return item.lane - 1 if now_us - since >= policy.aging_us else item.lane


def order(policy: BatchPolicy, pending: Sequence[Pending], now_us: int) -> list[Pending]:
    """The queue in service order: effective lane, then unexpired before delayed, then arrival."""
    # sorted() is stable, so arrival order survives within each rank.
    return sorted(pending, key=lambda p: (effective_lane(policy, p, now_us), _expired(p, now_us)))


def _expired(item: Pending, now_us: int) -> bool:
    return item.deadline_us is not None and item.deadline_us <= now_us


_ENQUEUED_AT = attrgetter("enqueued_at_us")  # (a C getter: min over a batch runs no Python frame per request)


def _dynamic_batch(policy: BatchPolicy, candidates: Sequence[Pending], now_us: int) -> Decision:
    max_pref = max(policy.preferred_batch_sizes, default=policy.max_batch_size)
    walk = _walk(policy, candidates, max_pref)
    batch = candidates[: walk.taken]
    oldest_us = min(map(_ENQUEUED_AT, batch))
    delay_us = policy.max_queue_delay_us
    # Triton treats a zero delay as "never expires" here, so a preferred prefix still wins at delay 0.
    delay_exceeded = delay_us != 0 and now_us - oldest_us >= delay_us

    if walk.best and not delay_exceeded:
        return Dispatch(tuple(candidates[: walk.best]))
    if walk.stopped_early or walk.rows >= max_pref or delay_us == 0 or delay_exceeded:
        # The batch cannot grow (or may not wait any longer): send the largest batch available.
        return Dispatch(tuple(batch))

    # Only reached when the walk took every candidate, so oldest_us is the oldest in the queue and no
    # request waits past its own delay; oldest_us + delay_us > now_us because the delay has not been
    # exceeded. REJECT deadlines are all > now_us (expired ones were rejected first); DELAY deadlines
    # need no wake-up: passing one only reorders the queue, which the next decision sees anyway.
    until_us = oldest_us + delay_us
    deadlines = [p.deadline_us for p in candidates if p.deadline_us is not None and not p.delay_on_timeout]
    if deadlines:
        # Wake at the nearest timeout so the expired request is answered promptly (Triton does too).
        until_us = min(until_us, min(deadlines))
    return Wait(until_us)


def _walk(policy: BatchPolicy, candidates: Sequence[Pending], max_pref: int) -> _Walk:
    preferred = frozenset(policy.preferred_batch_sizes)
    first = candidates[0]
    # The first request is always taken, even if it alone exceeds max_batch_size: a bulk job's packed
    # request, which the worker runs in parts (workers/request_parts.py); any other, the gateway should
    # have rejected, but holding it back would block its lane forever.
    taken, rows = 1, first.rows
    best = 1 if rows in preferred else 0
    for item in candidates[1:]:
        grown = rows + item.rows
        if grown > max_pref and best == 0:
            # Saturation mark (Triton): with no preferred size reached, the largest prefix within the
            # largest preferred size is the early-exit candidate. Rows only grow from here, so no
            # preferred size can be reached later and `best` is final.
            best = taken
        if grown > policy.max_batch_size or item.shape_key != first.shape_key:
            # Stop rather than skip ahead to a later request that would fit: skipping would break FIFO
            # and could starve the odd request. It starts the next batch instead.
            return _Walk(taken, rows, best, stopped_early=True)
        taken, rows = taken + 1, grown
        if rows in preferred:
            best = taken
    return _Walk(taken, rows, best, stopped_early=False)
