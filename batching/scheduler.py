"""The scheduler of one model version on one worker: Triton's dynamic batcher over the worker's instances.

A state machine (style.md §3, the split vLLM makes between its scheduler and its engine core): the
driver (``workers/loop.py``) feeds it events - a request arrived, a batch finished, an instance went
idle, a staged batch could or could not be taken back, requests were cancelled - and asks ``step(now)``
what to do. The answer is a ``Plan``: actions to carry out now, and when to ask again at the latest.
It reads no clock and does no I/O; times are integer µs on the driver's clock.

What lives here and nowhere else:
- Triton's dynamic batching (``batching.policy.decide``) over every lane, strict priority between
  Triton's levels, and queue timeouts: REJECT answers an expired request at its deadline even while
  every instance is busy; DELAY keeps it behind the unexpired ones.
- Staging: while an instance computes, the next batch may wait on the instance itself, so its thread
  starts it the moment it is free, without a round trip through the event loop. By default only a
  *full* batch (the largest preferred size) is staged: a batch that could still grow is formed when
  an instance frees up, and on a CPU instance the moment that takes is CPU the gateway and the loop
  use while more requests arrive. With ``stage_partial`` (instances whose compute leaves the host's
  CPU alone: a GPU, the sleep backend) any batch is staged and grows (``Grow``) with what arrives
  until the thread takes it, as Triton's instance queue merges payloads no instance has taken yet;
  there an idle gap between batches is device time lost. A staged batch is taken back (``Unstage``)
  when a higher-priority request arrives, one of its requests is cancelled, or another instance is
  free.
- ``preserve_ordering``: replies are released in the order batches were dispatched, across instances
  (Triton assigns response slots in that order too).
- fleet's bulk lane: it ages into the lowest online lane (``BatchPolicy.aging_us``), and on CPU
  workers takes at most ``bulk_share`` of an instance's time while online requests are coming in
  (``batching/bulk_share.py``).

The driver protocol, per action:
- ``Run(instance, batch)``: start the batch on the idle instance; report ``done`` when it has
  computed, ``idle`` when the instance's thread has nothing more to run.
- ``Stage(instance, batch)``: hand it to the busy instance; if the instance refuses (it went idle in
  the meantime), report ``stage_refused``.
- ``Unstage(instance, batch)``: try to take it back; report ``unstaged(instance, taken_back)``.
- ``Grow(instance, batch, into)``: replace the staged ``batch`` with ``into`` (its requests and more) if
  the thread has not taken it yet; report ``grown(instance, into.id, replaced)``.
- ``Expire(items)``: answer with a timeout; ``Drop(items)``: cancelled, answer nothing.
- ``Release(batches)``: write these finished batches' replies now, in this order. It comes first in a
  plan, ahead of the ``Run`` of the batch that follows: the replies' write is set going before the driver
  hands the next batch to a thread (workers/instance.py says why that order pays).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque

from batching.bulk_share import BulkShare
from batching.plan import (
    Action,
    Batch,
    Drop,
    Expire,
    Grow,
    Order,
    Plan,
    Release,
    Run,
    SchedulerConfig,
    Stage,
    Unstage,
)
from batching.policy import Dispatch, Pending, Wait, decide, effective_lane
from batching.slots import Slot

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.policy = config.policy
        self._queue: list[tuple[Order, Pending]] = []  # sorted by order key (arrival order)
        self._orders: dict[str, Order] = {}  # order keys of dispatched requests, to requeue them in place
        self._slots = [Slot() for _ in range(config.instances)]
        self._next_batch = 0
        self._dropped: list[Pending] = []
        self._cancelled: set[str] = set()  # ids inside staged batches, dropped once taken back
        self._dispatched: deque[int] = deque()  # batch ids in dispatch order, not yet released
        self._completed: list[int] = []  # finished, not yet released (completion order)
        self._bulk = BulkShare(config)
        # Whether an event since the last step() may change what it decides: the driver steps again at
        # once only then, since carrying out a plan's actions can report such events (a staged batch
        # taken back, a sequence's next request let in) without waking it.
        self.changed = False

    # ------------------------------------------------------------------ what the driver can read

    def queued(self) -> int:
        """Requests waiting: queued here or staged on an instance (Triton's "pending": accepted, not
        yet executing)."""
        return len(self._queue) + sum(len(b.items) for b in self._waiting())

    def queued_by_lane(self) -> dict[int, int]:
        """`queued()` per lane (lanes with none left out): a count over the queue, for the heartbeat."""
        lanes = Counter(p.lane for _, p in self._queue)
        lanes.update(p.lane for b in self._waiting() for p in b.items)
        return dict(lanes)

    def _waiting(self) -> list[Batch]:
        return [b for b in (s.waiting for s in self._slots) if b is not None]

    def busy(self) -> bool:
        """Whether anything is queued, staged, running or awaiting release."""
        return bool(self._queue or self._dispatched or self._completed or self._dropped
                    or any(s.assigned for s in self._slots))

    # ------------------------------------------------------------------ events

    def arrive(self, item: Pending, order: Order, now_us: int) -> None:
        """A request to schedule. `order` ranks it among the queued ones (the stream entry id: a
        claimed orphan is older than new arrivals, so it goes first in its lane)."""
        self.changed = True
        self._insert(order, item)
        self._bulk.arrived(item.lane, now_us)

    def cancel(self, request_ids: set[str]) -> None:
        """Drop these requests if they have not started: queued ones at the next step, staged ones once
        taken back. Requests already running are computed (their replies are dropped by the caller)."""
        self.changed = True
        keep = [(k, p) for k, p in self._queue if p.request_id not in request_ids]
        if len(keep) != len(self._queue):
            self._dropped += [p for _, p in self._queue if p.request_id in request_ids]
            self._queue = keep
        for staged in self._waiting():
            self._cancelled |= {p.request_id for p in staged.items} & request_ids

    def done(self, instance: int, batch_id: int, now_us: int, started_us: int) -> None:
        """`instance` has computed `batch_id` (its thread moved on to the staged batch, if any)."""
        self.changed = True
        slot = self._slots[instance]
        batch = slot.assigned.popleft()
        assert batch.id == batch_id, f"instance {instance} finished batch {batch_id}, expected {batch.id}"
        slot.staged_started = False
        slot.no_stage = False
        self._completed.append(batch_id)
        for p in batch.items:
            self._orders.pop(p.request_id, None)
        if self._cancelled:  # cancelled after its thread took it (the unstage came too late): it ran
            self._cancelled -= {p.request_id for p in batch.items}
        self._bulk.finished(batch, now_us, started_us)

    def idle(self, instance: int) -> None:
        self.changed = True
        slot = self._slots[instance]
        assert not slot.assigned, f"instance {instance} went idle holding batches"
        slot.thread_idle = True
        slot.no_stage = False

    def stage_refused(self, instance: int, batch_id: int) -> None:
        """The instance went idle before it could take the staged batch: it goes back to the queue."""
        self.changed = True
        slot = self._slots[instance]
        self._requeue(slot.assigned.pop(), batch_id)
        slot.no_stage = True

    def unstaged(self, instance: int, batch_id: int, taken_back: bool) -> None:
        self.changed = True
        slot = self._slots[instance]
        if taken_back:
            self._requeue(slot.assigned.pop(), batch_id)
        else:
            slot.staged_started = True  # its thread runs it now; done() of the batch before says so

    def grown(self, instance: int, batch_id: int, replaced: bool) -> None:
        """The driver tried to replace the staged batch with the grown one, `batch_id`: done, or too late
        (the thread had taken the staged batch: it runs as it was, the newcomers go back to the queue)."""
        self.changed = True
        slot = self._slots[instance]
        into, before = slot.assigned[1], slot.grown_from
        assert into.id == batch_id and before is not None, f"batch {batch_id} is not growing on instance {instance}"
        slot.grown_from = None
        if replaced:
            return
        slot.assigned[1] = before
        slot.staged_started = True
        self._dispatched[self._dispatched.index(batch_id)] = before.id
        kept = {p.request_id for p in before.items}
        for item in into.items:
            if item.request_id not in kept:
                self._insert_back(item)

    def _requeue(self, batch: Batch, batch_id: int) -> None:
        assert batch.id == batch_id, f"batch {batch_id} is not the staged one ({batch.id})"
        self._dispatched.remove(batch_id)
        for item in batch.items:
            if item.request_id in self._cancelled:
                self._cancelled.discard(item.request_id)
                self._dropped.append(item)
            else:
                self._insert_back(item)

    def _insert_back(self, item: Pending) -> None:
        self._insert(self._orders.pop(item.request_id), item)

    def _insert(self, order: Order, item: Pending) -> None:
        if not self._queue or self._queue[-1][0] <= order:
            self._queue.append((order, item))  # the usual case: the newest arrival
            return
        self._queue.insert(bisect.bisect_right([k for k, _ in self._queue], order), (order, item))

    # ------------------------------------------------------------------ decisions

    def step(self, now_us: int) -> Plan:
        """Everything to do at `now_us`. After carrying out the actions (and reporting what they say),
        the driver calls step() again at once if that made it `changed`, else on the next event or at
        `wake_at_us`."""
        self.changed = False
        actions: list[Action] = []
        if self._dropped:
            actions.append(Drop(tuple(self._dropped)))
            self._dropped = []
        expired = [p for _, p in self._queue
                   if p.deadline_us is not None and p.deadline_us <= now_us and not p.delay_on_timeout]
        if expired:
            gone = {p.request_id for p in expired}
            self._queue = [(k, p) for k, p in self._queue if p.request_id not in gone]
            actions.append(Expire(tuple(expired)))
        unstage = self._unstage(now_us)
        if unstage:
            return Plan(tuple(actions + unstage), None)  # the queue changes once they are back
        grow = self._grow(now_us) if self.config.stage_partial else []
        if grow:
            return Plan(tuple(actions + grow), None)  # the queue changes back if one comes too late
        released = self._releasable()
        if released:
            actions.append(Release(released))
        wake = self._dispatch(now_us, actions)
        deadlines = [p.deadline_us for _, p in self._queue if p.deadline_us is not None and not p.delay_on_timeout]
        # A staged batch's requests are looked at again once within the margin of their deadlines (_unstage).
        deadlines += [p.deadline_us - self.config.stage_margin_us for slot in self._slots
                      if (staged := slot.waiting) is not None for p in staged.items
                      if p.deadline_us is not None and not p.delay_on_timeout]
        if deadlines:
            wake = min(deadlines) if wake is None else min(wake, min(deadlines))
        return Plan(tuple(actions), wake)

    def _unstage(self, now_us: int) -> list[Action]:
        out: list[Action] = []
        if not any(len(s.assigned) == 2 for s in self._slots):
            return out
        best = min((effective_lane(self.policy, p, now_us) for _, p in self._queue), default=None)
        # A batch staged behind a busy instance while another instance is free runs sooner there.
        free = any(s.free for s in self._slots)
        for i, slot in enumerate(self._slots):
            if (staged := slot.waiting) is None:
                continue
            outranked = best is not None and best < max(effective_lane(self.policy, p, now_us) for p in staged.items)
            # Staged when its deadlines were far, but the running batch outlasted the margin: back to the
            # queue, where it times out as Triton's would (expiry is checked only while queued).
            near = any(self._expires_within_margin(p, now_us) for p in staged.items)
            if free or outranked or near or any(p.request_id in self._cancelled for p in staged.items):
                out.append(Unstage(i, staged))
        return out

    def _expires_within_margin(self, item: Pending, now_us: int) -> bool:
        return (item.deadline_us is not None and not item.delay_on_timeout
                and item.deadline_us - now_us <= self.config.stage_margin_us)

    def _grow(self, now_us: int) -> list[Action]:
        """Staged batches that what has arrived since can join: the batch Triton's rules would form now
        from the staged requests and the queue, if it keeps all of the staged ones and adds some."""
        out: list[Action] = []
        for i, slot in enumerate(self._slots):
            if not self._queue:
                break
            if (staged := slot.waiting) is None:
                continue
            if staged.rows >= self._full_rows():
                continue  # Triton's rules form nothing bigger
            if self.config.preserve_ordering and staged.id != self._dispatched[-1]:
                # Replies go out in dispatch order: a newcomer that joined this batch would be answered
                # before an earlier request in a batch dispatched after it.
                continue
            decision = decide(self.policy, [*staged.items, *(p for _, p in self._queue)], now_us)
            if not isinstance(decision, Dispatch) or len(decision.items) <= len(staged.items):
                continue
            joined = {p.request_id for p in decision.items}
            if any(p.request_id not in joined for p in staged.items) or not self._stageable(decision, now_us):
                continue
            into = self._take(decision.items, replacing=staged)
            slot.assigned[1], slot.grown_from = into, staged
            out.append(Grow(i, staged, into))
        return out

    def _dispatch(self, now_us: int, actions: list[Action]) -> int | None:
        """Form batches while an instance can take one; returns when to look again (None: on an event)."""
        if self.config.pinned:
            return self._dispatch_pinned(now_us, actions)
        while self._queue:
            free = [i for i, s in enumerate(self._slots) if s.free]
            stageable = [i for i, s in enumerate(self._slots) if s.stageable] if self.config.stage else []
            if not free and not stageable:
                return None
            decision = decide(self.policy, [p for _, p in self._queue], now_us)
            if isinstance(decision, Wait):
                return decision.until_us
            if not isinstance(decision, Dispatch):
                return None  # REJECT expiries were taken out above; nothing else to do
            if self._bulk.held(decision, now_us):
                return self._bulk.after_us
            if self._bulk.capped(decision, self._slots):
                return None  # an instance's bulk batch ending is the event to look again
            if not free and not self._stageable(decision, now_us):
                return None
            batch = self._take(decision.items)
            if free:
                # The most recently freed instance: its thread and caches are warm.
                slot = self._slots[free[-1]]
                slot.thread_idle = False
                slot.assigned.append(batch)
                actions.append(Run(free[-1], batch))
            else:
                self._slots[stageable[0]].assigned.append(batch)
                actions.append(Stage(stageable[0], batch))
                # The instance may refuse it (its thread went idle meanwhile) and the batch come back: form
                # the next batch only once the driver has said (`changed`: it calls step() again at once),
                # so a lower lane is never staged elsewhere while this batch is being refused.
                self.changed = True
                return None
        return None

    def _take(self, items: tuple[Pending, ...], replacing: Batch | None = None) -> Batch:
        """A new batch of these requests, the queued ones out of the queue (their order keys kept to requeue
        them); dispatched last, or in the place of the staged batch it grows from (`replacing`)."""
        batch = Batch(self._next_batch, items)
        self._next_batch += 1
        chosen = {p.request_id for p in items}
        orders = self._orders
        kept: list[tuple[Order, Pending]] = []
        for k, p in self._queue:  # one pass over the queue (per batch; a generator frame per request else)
            if p.request_id in chosen:
                orders[p.request_id] = k
            else:
                kept.append((k, p))
        self._queue = kept
        if replacing is None:
            self._dispatched.append(batch.id)
        else:
            self._dispatched[self._dispatched.index(replacing.id)] = batch.id
        return batch

    def _dispatch_pinned(self, now_us: int, actions: list[Action]) -> int | None:
        """Per free instance, Triton's batching over the requests pinned to it."""
        wake: int | None = None
        for index, slot in enumerate(self._slots):
            if not slot.free:
                continue
            mine = [p for _, p in self._queue if p.instance == index]
            if not mine:
                continue
            decision = decide(self.policy, mine, now_us)
            if isinstance(decision, Wait):
                wake = decision.until_us if wake is None else min(wake, decision.until_us)
                continue
            if not isinstance(decision, Dispatch):
                continue
            batch = self._take(decision.items)
            slot.thread_idle = False
            slot.assigned.append(batch)
            actions.append(Run(index, batch))
        return wake

    def _full_rows(self) -> int:
        """The rows of a full batch: the largest preferred size, or 1 without batching."""
        policy = self.policy
        if not policy.dynamic or policy.max_batch_size == 0:
            return 1
        return max(policy.preferred_batch_sizes, default=policy.max_batch_size)

    def _stageable(self, decision: Dispatch, now_us: int) -> bool:
        """Whether a batch may wait behind a running one instead of in the queue: only a full one (the
        largest preferred size, or 1 without batching) unless `stage_partial`, not a bulk batch while
        online requests come in, and none of it may time out before it runs."""
        if not self.config.stage_partial and sum(p.rows for p in decision.items) < self._full_rows():
            return False
        if any(p.lane == self.config.bulk_lane for p in decision.items) and self._bulk.online_active(now_us):
            # Online traffic is about: a bulk batch waits in the queue, where an online request that
            # arrives while the instance computes still goes first.
            return False
        return not any(self._expires_within_margin(p, now_us) for p in decision.items)

    def _releasable(self) -> tuple[int, ...]:
        if not self._completed:
            return ()
        if not self.config.preserve_ordering:
            out = tuple(self._completed)
            self._completed = []
            for batch_id in out:
                self._dispatched.remove(batch_id)
            return out
        done = set(self._completed)
        released: list[int] = []
        while self._dispatched and self._dispatched[0] in done:
            released.append(self._dispatched.popleft())
        if released:
            self._completed = [b for b in self._completed if b not in set(released)]
        return tuple(released)
