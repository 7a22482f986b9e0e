"""batching.policy: worked examples from protocol.md §3.5-3.7 and the properties style.md §3 requires.

Times are plain integers (epoch µs); nothing sleeps or reads a clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from batching.policy import BatchPolicy, Dispatch, Pending, Reject, Wait, decide, effective_lane, order

EXAMPLES = settings(max_examples=200, deadline=None)


def req(
    request_id: str,
    at: int = 0,
    *,
    rows: int = 1,
    lane: int = 0,
    deadline: int | None = None,
    key: Hashable = None,
    delay: bool = False,
    aging_from: int | None = None,
) -> Pending:
    return Pending(request_id, lane, at, deadline, rows, key, delay, aging_from)


# ---------------------------------------------------------------- worked examples


def test_empty_queue_is_none() -> None:
    assert decide(BatchPolicy(max_batch_size=8), [], now_us=0) is None


def test_style_guide_example_waits_for_the_delay_then_dispatches() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=5_000)
    a = req("a", at=0)
    assert decide(policy, [a], now_us=4_000) == Wait(until_us=5_000)
    assert decide(policy, [a], now_us=5_000) == Dispatch((a,))


def test_zero_delay_sends_whatever_is_queued_at_once() -> None:
    policy = BatchPolicy(max_batch_size=8)
    items = [req("a"), req("b", rows=3)]
    assert decide(policy, items, now_us=0) == Dispatch(tuple(items))


def test_wait_is_measured_from_the_oldest_request() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=5_000)
    assert decide(policy, [req("a", at=100), req("b", at=3_000)], now_us=3_000) == Wait(5_100)


def test_preferred_size_dispatches_before_the_delay() -> None:
    policy = BatchPolicy(max_batch_size=8, preferred_batch_sizes=(4,), max_queue_delay_us=10_000)
    items = [req(str(i), at=i) for i in range(5)]
    assert decide(policy, items[:3], now_us=10) == Wait(10_000)
    assert decide(policy, items[:4], now_us=10) == Dispatch(tuple(items[:4]))
    # Largest preferred prefix only; the fifth request starts the next batch.
    assert decide(policy, items, now_us=10) == Dispatch(tuple(items[:4]))


def test_largest_reachable_preferred_size_wins() -> None:
    policy = BatchPolicy(max_batch_size=8, preferred_batch_sizes=(2, 4), max_queue_delay_us=10_000)
    items = [req(str(i)) for i in range(5)]
    assert decide(policy, items[:3], now_us=1) == Dispatch(tuple(items[:2]))
    assert decide(policy, items, now_us=1) == Dispatch(tuple(items[:4]))


def test_preferred_size_is_not_awaited_past_the_delay() -> None:
    policy = BatchPolicy(max_batch_size=8, preferred_batch_sizes=(2,), max_queue_delay_us=1_000)
    items = [req("a"), req("b"), req("c")]
    assert decide(policy, items, now_us=999) == Dispatch(tuple(items[:2]))
    # Once the delay has expired Triton sends the largest batch available instead.
    assert decide(policy, items, now_us=1_000) == Dispatch(tuple(items))


def test_saturation_point_is_the_early_exit_when_no_preferred_size_fits() -> None:
    # 3 + 3 overshoots the largest preferred size (4): Triton sends the 3 that fit.
    policy = BatchPolicy(max_batch_size=8, preferred_batch_sizes=(4,), max_queue_delay_us=1_000)
    a, b = req("a", rows=3), req("b", rows=3)
    assert decide(policy, [a, b], now_us=10) == Dispatch((a,))


def test_reaching_max_preferred_rows_dispatches_without_waiting() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=1_000_000)
    items = [req("a", rows=5), req("b", rows=3)]
    assert decide(policy, items, now_us=0) == Dispatch(tuple(items))


def test_max_batch_size_closes_the_batch_without_waiting() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=1_000_000)
    a, b = req("a", rows=5), req("b", rows=5)
    assert decide(policy, [a, b], now_us=0) == Dispatch((a,))


def test_oversize_request_runs_alone_instead_of_blocking() -> None:
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_us=1_000)
    a, b = req("a", rows=9), req("b")
    assert decide(policy, [a, b], now_us=0) == Dispatch((a,))


def test_shape_mismatch_closes_the_batch_and_does_not_skip_ahead() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=1_000_000)
    a, b, c = req("a", key=(3,)), req("b", key=(5,)), req("c", key=(3,))
    assert decide(policy, [a, b, c], now_us=0) == Dispatch((a,))
    assert decide(policy, [b, c], now_us=0) == Dispatch((b,))
    assert decide(policy, [c], now_us=0) == Wait(1_000_000)


def test_higher_priority_lane_goes_first() -> None:
    policy = BatchPolicy(max_batch_size=2)
    low, high1, high2 = req("low", lane=1), req("high1", lane=0), req("high2", lane=0)
    assert decide(policy, [low, high1, high2], now_us=0) == Dispatch((high1, high2))
    assert decide(policy, [low, high1], now_us=0) == Dispatch((high1, low))


@pytest.mark.parametrize("policy", [BatchPolicy(max_batch_size=8, dynamic=False), BatchPolicy(0)])
def test_without_dynamic_batching_requests_run_one_at_a_time(policy: BatchPolicy) -> None:
    items = [req("a", lane=1), req("b"), req("c")]
    assert decide(policy, items, now_us=0) == Dispatch((items[1],))
    assert decide(policy, [items[0], items[2]], now_us=0) == Dispatch((items[2],))


def test_expired_requests_are_rejected_first_in_arrival_order() -> None:
    policy = BatchPolicy(max_batch_size=8)
    a, b = req("a", deadline=900, lane=1), req("b", deadline=2_000)
    c, d = req("c"), req("d", deadline=1_000)  # deadline == now counts as expired
    assert decide(policy, [a, b, c, d], now_us=1_000) == Reject((a, d))
    assert decide(policy, [b, c], now_us=1_000) == Dispatch((b, c))


def test_wait_wakes_at_the_nearest_deadline_then_rejects() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=5_000)
    a, b = req("a"), req("b", at=500, deadline=3_000)
    assert decide(policy, [a, b], now_us=1_000) == Wait(3_000)
    assert decide(policy, [a, b], now_us=3_000) == Reject((b,))


def test_delay_keeps_an_expired_request_behind_the_unexpired_of_its_lane_and_above() -> None:
    """protocol.md §3.7: DELAY moves it behind unexpired requests of its level and higher, not lower."""
    policy = BatchPolicy(max_batch_size=8)
    late = req("late", deadline=500, delay=True)
    fresh0, fresh1 = req("fresh0", at=100), req("fresh1", at=100, lane=1)
    assert decide(policy, [late, fresh1, fresh0], now_us=1_000) == Dispatch((fresh0, late, fresh1))
    # Not expired yet: it keeps its place.
    assert decide(policy, [late, fresh0], now_us=400) == Dispatch((late, fresh0))
    # Alone, a delayed request still runs: DELAY never drops anything.
    assert decide(policy, [late], now_us=10_000) == Dispatch((late,))


def test_delayed_requests_need_no_wakeup() -> None:
    policy = BatchPolicy(max_batch_size=8, max_queue_delay_us=5_000)
    late, fresh = req("late", deadline=500, delay=True), req("fresh", at=900)
    assert decide(policy, [late, fresh], now_us=1_000) == Wait(5_000)


def test_aging_lifts_the_bulk_lane_into_the_lowest_online_lane_only() -> None:
    policy = BatchPolicy(max_batch_size=1, aging_us=1_000, bulk_lane=2)
    bulk = req("bulk", lane=2, aging_from=10_000)
    assert effective_lane(policy, bulk, 10_999) == 2
    assert effective_lane(policy, bulk, 11_000) == 1
    assert effective_lane(policy, bulk, 99_000) == 1  # never above the lowest online level
    low = req("low", lane=1, at=11_500)
    # In lane 1 after one interval, it is first by arrival (it was admitted before the online one).
    assert decide(policy, [bulk, low], now_us=10_999) == Dispatch((low,))
    assert decide(policy, [bulk, low], now_us=11_000) == Dispatch((bulk,))
    high = req("high", lane=0, at=50_000)
    assert decide(policy, [bulk, low, high], now_us=99_000) == Dispatch((high,))


def test_online_levels_are_strict_however_long_a_request_waits() -> None:
    """Triton's priority levels never age: a level-2 request waits behind every level-1 request."""
    policy = BatchPolicy(max_batch_size=1, aging_us=1_000, bulk_lane=2)
    level2 = req("level2", lane=1, at=0, aging_from=0)
    level1 = req("level1", lane=0, at=10**9)
    assert effective_lane(policy, level2, 10**12) == 1
    assert decide(policy, [level2, level1], now_us=10**12) == Dispatch((level1,))


def test_without_aging_priority_is_strict() -> None:
    policy = BatchPolicy(max_batch_size=1)
    bulk, online = req("bulk", lane=1), req("online", at=10**9)
    assert order(policy, [bulk, online], now_us=10**12) == [online, bulk]


def test_invalid_values_are_refused() -> None:
    with pytest.raises(ValueError):
        req("a", rows=0)
    with pytest.raises(ValueError):
        BatchPolicy(max_batch_size=-1)
    with pytest.raises(ValueError):
        BatchPolicy(max_batch_size=4, max_queue_delay_us=-1)
    with pytest.raises(ValueError):
        BatchPolicy(max_batch_size=4, preferred_batch_sizes=(0,))
    with pytest.raises(ValueError):
        BatchPolicy(max_batch_size=4, aging_us=-1)


# ---------------------------------------------------------------- properties

SHAPE_KEYS = st.sampled_from([None, (2,), (3,)])


@st.composite
def policies(draw: st.DrawFn) -> BatchPolicy:
    max_batch_size = draw(st.integers(0, 8))
    preferred = draw(st.lists(st.integers(1, max(1, max_batch_size)), max_size=3, unique=True))
    return BatchPolicy(
        max_batch_size=max_batch_size,
        preferred_batch_sizes=tuple(sorted(preferred)),
        max_queue_delay_us=draw(st.sampled_from([0, 1, 100, 5_000])),
        dynamic=draw(st.booleans()),
        aging_us=draw(st.sampled_from([0, 0, 1_000, 7_000])),
        bulk_lane=draw(st.sampled_from([-1, 1, 2])),
    )


@st.composite
def queues(draw: st.DrawFn) -> tuple[list[Pending], int]:
    """A queue in arrival order (enqueue times non-decreasing) and a `now` at or after the last."""
    count = draw(st.integers(1, 10))
    at, items = 0, list[Pending]()
    for i in range(count):
        at += draw(st.integers(0, 3_000))
        timeout = draw(st.none() | st.integers(1, 10_000))
        deadline = None if timeout is None else at + timeout
        rows = draw(st.integers(1, 10))
        items.append(Pending(f"r{i}", draw(st.integers(0, 2)), at, deadline, rows, draw(SHAPE_KEYS),
                             draw(st.booleans()), at + draw(st.integers(0, 2_000))))
    return items, at + draw(st.integers(0, 10_000))


def expired(item: Pending, now_us: int) -> bool:
    return item.deadline_us is not None and item.deadline_us <= now_us


def rejectable(item: Pending, now_us: int) -> bool:
    return expired(item, now_us) and not item.delay_on_timeout


def rank(policy: BatchPolicy, item: Pending, now_us: int) -> tuple[int, bool]:
    return effective_lane(policy, item, now_us), expired(item, now_us)


def check_dispatch(policy: BatchPolicy, queue: Sequence[Pending], batch: Dispatch, now_us: int) -> None:
    """Every Dispatch invariant that can be checked against the queue it was drawn from."""
    items = batch.items
    assert items, "a dispatch is never empty"
    assert len({p.request_id for p in items}) == len(items)
    assert all(p in queue for p in items)
    rows = sum(p.rows for p in items)
    assert len(items) == 1 or rows <= policy.max_batch_size, "batch exceeds max_batch_size"
    if not policy.dynamic or policy.max_batch_size == 0:
        assert len(items) == 1
    assert len({p.shape_key for p in items}) == 1, "mismatched shapes share a batch"
    # Priority and FIFO: nothing left behind outranks, or arrived before (same rank), a dispatched one.
    # Rank = (lane after aging, delayed after unexpired); with aging off and no timeouts, it is the lane.
    position = {p.request_id: i for i, p in enumerate(queue)}
    left = [p for p in queue if p not in items]
    for d in items:
        for q in left:
            assert rank(policy, q, now_us) >= rank(policy, d, now_us), "a lower rank overtook a higher one"
            if rank(policy, q, now_us) == rank(policy, d, now_us):
                assert position[q.request_id] > position[d.request_id], "FIFO broken within a rank"
    # Within the batch: ranks ascending, arrival order within a rank.
    ranks = [(rank(policy, p, now_us), position[p.request_id]) for p in items]
    assert ranks == sorted(ranks)


@EXAMPLES
@given(policies(), queues())
def test_decision_properties(policy: BatchPolicy, queue_now: tuple[list[Pending], int]) -> None:
    queue, now_us = queue_now
    decision = decide(policy, queue, now_us)
    overdue = tuple(p for p in queue if rejectable(p, now_us))
    if overdue:
        assert decision == Reject(overdue)
        return
    if isinstance(decision, Dispatch):
        check_dispatch(policy, queue, decision, now_us)
    else:
        assert isinstance(decision, Wait)
        assert decision.until_us > now_us
        for p in queue:
            assert decision.until_us <= p.enqueued_at_us + policy.max_queue_delay_us
            assert p.delay_on_timeout or p.deadline_us is None or decision.until_us <= p.deadline_us


@EXAMPLES
@given(policies(), queues())
def test_nothing_waits_once_the_delay_is_up(
    policy: BatchPolicy, queue_now: tuple[list[Pending], int]
) -> None:
    queue, _ = queue_now
    now_us = min(p.enqueued_at_us for p in queue) + policy.max_queue_delay_us
    assert not isinstance(decide(policy, queue, now_us), Wait)


class QueueMachine(RuleBasedStateMachine):
    """A worker driving `decide` against a model queue with a fake clock.

    Every request must leave the queue exactly once (dispatched or rejected), expired requests are
    never dispatched, a Wait is honoured by advancing the clock to it, and the queue always drains.
    """

    def __init__(self) -> None:
        super().__init__()
        self.policy = BatchPolicy(max_batch_size=1)
        self.now_us = 0
        self.queue: list[Pending] = []
        self.arrived: set[str] = set()
        self.done: dict[str, str] = {}  # request_id -> "dispatched" | "rejected"

    @initialize(policy=policies(), start=st.integers(0, 10**15))
    def setup(self, policy: BatchPolicy, start: int) -> None:
        self.policy, self.now_us = policy, start

    @rule(
        lane=st.integers(0, 2),
        rows=st.integers(1, 10),
        key=SHAPE_KEYS,
        timeout=st.none() | st.integers(1, 10_000),
        delay=st.booleans(),
    )
    def arrive(self, lane: int, rows: int, key: Hashable, timeout: int | None, delay: bool) -> None:
        request_id = f"r{len(self.arrived)}"
        deadline = None if timeout is None else self.now_us + timeout
        self.queue.append(Pending(request_id, lane, self.now_us, deadline, rows, key, delay))
        self.arrived.add(request_id)

    @rule(delta=st.integers(0, 6_000))
    def advance_clock(self, delta: int) -> None:
        self.now_us += delta

    @rule()
    def decide_once(self) -> None:
        decision = decide(self.policy, self.queue, self.now_us)
        if isinstance(decision, Wait):
            assert decision.until_us > self.now_us
        elif decision is not None:
            self.apply(decision)

    @rule()
    def drain(self) -> None:
        """Act like the worker with no new arrivals: honour each Wait, until the queue is empty."""
        for _ in range(3 * len(self.queue) + 3):
            decision = decide(self.policy, self.queue, self.now_us)
            if decision is None:
                break
            if isinstance(decision, Wait):
                assert decision.until_us > self.now_us
                self.now_us = decision.until_us
                # Having waited as told, the head of the queue must now move.
                assert not isinstance(decide(self.policy, self.queue, self.now_us), Wait)
            else:
                self.apply(decision)
        assert not self.queue, "the queue did not drain"
        assert set(self.done) == self.arrived

    def apply(self, decision: Dispatch | Reject) -> None:
        for p in decision.items:
            assert p.request_id not in self.done, f"{p.request_id} left the queue twice"
        if isinstance(decision, Reject):
            assert all(rejectable(p, self.now_us) for p in decision.items)
            assert not any(rejectable(p, self.now_us) for p in self.queue if p not in decision.items)
        else:
            assert not any(rejectable(p, self.now_us) for p in self.queue), "expired request survived"
            check_dispatch(self.policy, self.queue, decision, self.now_us)
        outcome = "rejected" if isinstance(decision, Reject) else "dispatched"
        for p in decision.items:
            self.done[p.request_id] = outcome
            self.queue.remove(p)

    @invariant()
    def each_request_is_queued_or_done_exactly_once(self) -> None:
        queued = [p.request_id for p in self.queue]
        assert len(queued) == len(set(queued))
        assert not set(queued) & set(self.done)
        assert set(queued) | set(self.done) == self.arrived

    def teardown(self) -> None:
        self.drain()


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@EXAMPLES
@given(lane=st.integers(1, 3), aging_us=st.integers(1, 50_000), batch_us=st.integers(1, 5_000),
       max_batch=st.integers(1, 8))
def test_aging_bounds_how_long_the_bulk_lane_waits_under_saturation(
    lane: int, aging_us: int, batch_us: int, max_batch: int
) -> None:
    """A flood on the lowest online lane that fills every batch cannot hold a bulk request past
    aging_us plus one batch, for any rates."""
    policy = BatchPolicy(max_batch_size=max_batch, aging_us=aging_us, bulk_lane=lane)
    now, seq = 0, 0
    low = Pending("low", lane, 0, None, 1, aging_from_us=0)
    queue = [low]
    while True:
        # Saturation: a full batch of fresh online work arrives before every decision.
        for _ in range(max_batch):
            queue.append(Pending(f"o{seq}", lane - 1, now, None, 1))
            seq += 1
        decision = decide(policy, queue, now)
        assert isinstance(decision, Dispatch)
        if low in decision.items:
            break
        queue = [p for p in queue if p not in decision.items]
        now += batch_us
        assert now <= aging_us + 2 * batch_us, "the bulk lane starved"
