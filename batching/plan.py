"""What a scheduler (batching/scheduler.py) and its driver say to each other: the batches it forms, the
actions it asks for, its plan for a moment, and its configuration. Plain frozen data, no logic beyond the
config's checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from batching.policy import BatchPolicy, Pending

__all__ = ["Action", "Batch", "Drop", "Expire", "Grow", "Order", "Plan", "Release", "Run", "SchedulerConfig", "Stage",
           "Unstage"]


@dataclass(frozen=True, slots=True)
class Batch:
    id: int
    items: tuple[Pending, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.items)


@dataclass(frozen=True, slots=True)
class Run:
    instance: int
    batch: Batch


@dataclass(frozen=True, slots=True)
class Stage:
    instance: int
    batch: Batch


@dataclass(frozen=True, slots=True)
class Unstage:
    instance: int
    batch: Batch


@dataclass(frozen=True, slots=True)
class Grow:
    instance: int
    batch: Batch
    into: Batch


@dataclass(frozen=True, slots=True)
class Expire:
    items: tuple[Pending, ...]


@dataclass(frozen=True, slots=True)
class Drop:
    items: tuple[Pending, ...]


@dataclass(frozen=True, slots=True)
class Release:
    batches: tuple[int, ...]


Action: TypeAlias = Run | Stage | Unstage | Grow | Expire | Drop | Release
Order: TypeAlias = tuple[int, int]  # a request's rank in arrival order: its stream entry id (ms, seq)


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...]
    wake_at_us: int | None  # call step() again by then, even if no event comes; None = only on an event


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: BatchPolicy
    instances: int
    bulk_lane: int
    # The most of an instance's time bulk batches take while online requests are coming in (< 1 only
    # on CPU devices, where bulk compute holds a core the online path needs).
    bulk_share: float = 1.0
    preserve_ordering: bool = False
    # Online traffic counts as present for this long after an online request arrived.
    online_quiet_us: int = 200_000
    # A batch is staged only if none of its requests can time out within this margin, and goes back to
    # the queue once one could (expiry is checked only while queued; a running batch may outlast it).
    stage_margin_us: int = 1_000_000
    # Sequence batching: every request names its instance (Pending.instance), each instance batches only
    # its own, and nothing is staged (a sequence has one request in flight at a time anyway).
    pinned: bool = False
    # Hand a batch to a busy instance (staging). Off for a generation engine's slots: a request staged behind
    # a generation would wait for all of it while other slots free up.
    stage: bool = True
    # Stage batches that could still grow, and grow them until taken (see the module docstring).
    stage_partial: bool = False
    # At most this many instances hold bulk batches at once (0: no cap). A generation engine's slots keep the
    # rest for online requests, which then preempt bulk generations inside the engine.
    bulk_instances: int = 0

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"a scheduler needs at least one instance, got {self.instances}")
        if not 0 < self.bulk_share <= 1:
            raise ValueError(f"bulk_share must be in (0, 1], got {self.bulk_share}")
