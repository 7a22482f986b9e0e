"""Where a request waits and for how long: priority -> lane, queue policy -> deadline and queue bound.

Pure functions of the model's config (protocol.md §3.7); the gateway applies them when it enqueues, the
worker reads the timeout action of a lane, and bulk jobs use `bulk_lane`. Lanes are the model's
streams (design.md "Redis layout"): lane 0 is priority level 1, lane L-1 level L, and one more lane,
the last, is the bulk lane that only offline jobs use.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.model_spec import ModelSpec, QueuePolicy

__all__ = ["Admission", "admit", "bulk_lane", "lane_count", "lane_policy", "level_lane"]

_NO_POLICY = QueuePolicy()


@dataclass(frozen=True, slots=True)
class Admission:
    lane: int
    deadline_us: int | None  # absolute epoch µs; None = never times out while queued
    max_queue_size: int  # the lane's bound at enqueue; 0 = unbounded
    delay_on_timeout: bool = False  # DELAY: past its deadline it is kept (behind the others), not rejected


def _levels(spec: ModelSpec) -> int:
    db = spec.dynamic_batching
    return db.priority_levels if db is not None and spec.max_batch_size > 0 else 0


def lane_count(spec: ModelSpec) -> int:
    """Online lanes (one per priority level, at least one) plus the bulk lane."""
    return max(1, _levels(spec)) + 1


def bulk_lane(spec: ModelSpec) -> int:
    return lane_count(spec) - 1


def level_lane(spec: ModelSpec, priority: int) -> int:
    """The lane of a request with `priority` (Triton: 0 or out of range -> default level)."""
    levels = _levels(spec)
    if levels == 0:
        return 0  # priorities are ignored unless priority_levels > 0
    db = spec.dynamic_batching
    assert db is not None
    level = priority if 1 <= priority <= levels else db.default_priority_level
    return level - 1


def lane_policy(spec: ModelSpec, lane: int) -> QueuePolicy:
    """The queue policy of `lane`; the bulk lane and models without dynamic batching have none."""
    db = spec.dynamic_batching
    if db is None or spec.max_batch_size == 0 or lane >= bulk_lane(spec):
        return _NO_POLICY
    return db.queue_policy(lane + 1)


def admit(spec: ModelSpec, priority: int, timeout_us: int, now_us: int) -> Admission:
    """Lane, deadline and queue bound of an online request arriving at `now_us`.

    The deadline is fixed here, at enqueue (Triton does the same): the level's
    `default_timeout_microseconds`, or the request's `timeout` when the policy allows overrides and it
    is shorter. A request timeout is ignored when the default is 0: an override may only shorten.
    """
    # level_lane and lane_policy, inlined (per request): an online lane is always below the bulk lane.
    db = spec.dynamic_batching
    if db is None or spec.max_batch_size == 0:
        lane, policy = 0, _NO_POLICY
    else:
        levels = db.priority_levels
        lane = 0 if levels == 0 else (priority if 1 <= priority <= levels else db.default_priority_level) - 1
        policy = db.queue_policy(lane + 1)
    timeout = policy.default_timeout_us
    if policy.allow_timeout_override and 0 < timeout_us < timeout:
        timeout = timeout_us
    deadline = now_us + timeout if timeout > 0 else None
    return Admission(lane=lane, deadline_us=deadline, max_queue_size=policy.max_queue_size,
                     delay_on_timeout=policy.delay_on_timeout)
