"""The scheduler's view of one model instance (batching/scheduler.py): the batches given to it, in
order (running, then staged), and whether its thread can take one now or one more behind it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batching.plan import Batch

__all__ = ["Slot"]


@dataclass(slots=True)
class Slot:
    """The scheduler's view of one instance: what it has been given, in order (running, then staged)."""

    assigned: deque[Batch] = field(default_factory=deque)
    thread_idle: bool = True  # its thread reported idle and nothing was given to it since
    no_stage: bool = False  # a stage was refused: the instance is finishing; wait for done/idle
    staged_started: bool = False  # an unstage or a growth found the staged batch already taken by the thread
    grown_from: Batch | None = None  # the staged batch a Grow replaces, until the driver says it did

    @property
    def waiting(self) -> Batch | None:
        """The batch staged here that its thread has not started, if any."""
        return self.assigned[1] if len(self.assigned) == 2 and not self.staged_started else None

    @property
    def free(self) -> bool:
        return self.thread_idle and not self.assigned

    @property
    def stageable(self) -> bool:
        return not self.thread_idle and len(self.assigned) == 1 and not self.no_stage
