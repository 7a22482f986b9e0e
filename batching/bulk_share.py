"""fleet's bulk lane beside online traffic, for one scheduler (batching/scheduler.py): on CPU workers bulk
batches take at most `bulk_share` of an instance's time while online requests are coming in, a bulk batch
is not staged then (an online request arriving meanwhile still goes first), and at most `bulk_instances`
instances hold bulk batches at once (a generation engine's slots). Pure: times are the driver's µs."""

from __future__ import annotations

from collections.abc import Sequence

from batching.plan import Batch, SchedulerConfig
from batching.policy import Dispatch, Pending
from batching.slots import Slot

__all__ = ["BulkShare"]


class BulkShare:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._online_seen_us: int | None = None
        self.after_us = 0  # a bulk-only batch waits until then while online requests come in

    def arrived(self, lane: int, now_us: int) -> None:
        if lane != self.config.bulk_lane:
            self._online_seen_us = now_us

    def finished(self, batch: Batch, now_us: int, started_us: int) -> None:
        share = self.config.bulk_share
        if share < 1 and self._bulk_only(batch.items):
            # While online requests come in, each bulk batch is followed by idle time in proportion.
            self.after_us = now_us + int((now_us - started_us) * (1 - share) / share)

    def online_active(self, now_us: int) -> bool:
        seen = self._online_seen_us
        return seen is not None and now_us - seen < self.config.online_quiet_us

    def held(self, decision: Dispatch, now_us: int) -> bool:
        """A bulk-only batch waits out the bulk share's idle time (until `after_us`) while online requests
        come in."""
        return now_us < self.after_us and self.online_active(now_us) and self._bulk_only(decision.items)

    def capped(self, decision: Dispatch, slots: Sequence[Slot]) -> bool:
        """A bulk-only batch while `bulk_instances` instances already hold one."""
        cap = self.config.bulk_instances
        if not cap or not self._bulk_only(decision.items):
            return False
        return sum(1 for s in slots if any(self._bulk_only(b.items) for b in s.assigned)) >= cap

    def _bulk_only(self, items: Sequence[Pending]) -> bool:
        bulk = self.config.bulk_lane
        return all(p.lane == bulk for p in items)
