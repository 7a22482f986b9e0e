"""batching.sequences (the sequence gate) and the scheduler's pinned mode: worked examples and a hypothesis
state machine that plays the driver on a fake clock: requests of many sequences arrive, requests in
flight finish in any order across sequences, time passes."""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from batching.plan import Run, SchedulerConfig
from batching.policy import BatchPolicy, Pending
from batching.scheduler import Scheduler
from batching.sequences import Admit, Refuse, SequenceGate, Wait

IDLE = 1_000


def test_first_request_needs_start_and_the_message_is_tritons() -> None:
    gate = SequenceGate("simple_sequence", 1, IDLE)
    verdict = gate.arrive("r1", 1000, False, False, 0)
    assert isinstance(verdict, Refuse)
    assert verdict.message == ("inference request for sequence 1000 to model 'simple_sequence' must specify the "
                               "START flag on the first request of the sequence")


def test_one_request_of_a_sequence_at_a_time_in_order_on_one_instance() -> None:
    gate = SequenceGate("m", 2, IDLE)
    a = gate.arrive("a1", 7, True, False, 0)
    b = gate.arrive("b1", "x", True, False, 0)
    assert isinstance(a, Admit) and isinstance(b, Admit) and a.instance != b.instance  # spread over instances
    assert gate.arrive("a2", 7, False, False, 1) == Wait("a2")
    assert gate.arrive("a3", 7, False, True, 2) == Wait("a3")
    assert gate.finished("a1", 3) == [Admit("a2", a.instance)]
    assert gate.finished("a2", 4) == [Admit("a3", a.instance)]
    assert gate.finished("a3", 5) == []
    assert gate.active() == 1  # only "x": 7 ended
    assert isinstance(gate.arrive("a4", 7, False, False, 6), Refuse)


def test_requests_after_end_without_start_are_refused_and_a_start_restarts() -> None:
    gate = SequenceGate("m", 1, IDLE)
    gate.arrive("s1", 5, True, True, 0)
    assert gate.arrive("s2", 5, False, False, 0) == Wait("s2")
    assert gate.arrive("s3", 5, True, False, 0) == Wait("s3")
    out = gate.finished("s1", 1)
    assert [type(v) for v in out] == [Refuse, Admit] and out[1].request_id == "s3"


def test_state_is_carried_and_reset_by_start() -> None:
    gate = SequenceGate("m", 1, IDLE)
    gate.arrive("r1", 1, True, False, 0)
    assert gate.state("r1") is None
    gate.set_state("r1", {"S": 1})
    gate.arrive("r2", 1, False, False, 0)
    gate.finished("r1", 1)
    assert gate.state("r2") == {"S": 1}
    gate.set_state("r2", {"S": 2})
    gate.finished("r2", 2)
    gate.arrive("r3", 1, True, False, 3)  # a START for the live sequence: from the initial state again
    assert gate.state("r3") is None


def test_idle_sequences_are_released_after_the_idle_time() -> None:
    gate = SequenceGate("m", 1, IDLE)
    gate.arrive("r1", 1, True, False, 0)
    gate.finished("r1", 10)
    assert gate.next_idle_us() == 10 + IDLE
    assert gate.release_idle(IDLE + 9) == []
    assert gate.release_idle(IDLE + 10) == [1]
    assert isinstance(gate.arrive("r2", 1, False, False, IDLE + 11), Refuse)


def test_a_sequence_with_a_request_in_flight_is_never_idle() -> None:
    gate = SequenceGate("m", 1, IDLE)
    gate.arrive("r1", 1, True, False, 0)
    assert gate.next_idle_us() is None
    assert gate.release_idle(10 * IDLE) == []


def test_pinned_scheduler_batches_each_instance_only_its_own() -> None:
    policy = BatchPolicy(max_batch_size=4)
    s = Scheduler(SchedulerConfig(policy, 2, 1, pinned=True))
    for i, inst in enumerate([0, 1, 0, 1, 0]):
        s.arrive(Pending(f"r{i}", 0, 0, None, 1, instance=inst), (1, i), 0)
    plan = s.step(0)
    runs = {a.instance: [p.request_id for p in a.batch.items] for a in plan.actions if isinstance(a, Run)}
    assert runs == {0: ["r0", "r2", "r4"], 1: ["r1", "r3"]}


class GateMachine(RuleBasedStateMachine):
    """Invariants: at most one request of a sequence in flight; a sequence's requests are let through in
    arrival order, each exactly once (or refused), always on the sequence's instance; nothing waits
    without a request of its sequence in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = SequenceGate("m", 3, IDLE)
        self.now = 0
        self.n = 0
        self.in_flight: dict[str, tuple[int, int]] = {}  # request -> (sequence, instance)
        self.waiting: dict[int, deque[str]] = {}
        self.arrived: dict[int, list[str]] = {}  # per sequence, in order, since its last (re)creation
        self.through: dict[int, list[str]] = {}
        self.decided: set[str] = set()

    def _apply(self, verdicts: list[Admit | Wait | Refuse], seq: int) -> None:
        for v in verdicts:
            if isinstance(v, Wait):
                self.waiting.setdefault(seq, deque()).append(v.request_id)
                continue
            assert v.request_id not in self.decided
            self.decided.add(v.request_id)
            if isinstance(v, Admit):
                assert not any(s == seq for s, _ in self.in_flight.values()), "two in flight"
                self.in_flight[v.request_id] = (seq, v.instance)
                self.through.setdefault(seq, []).append(v.request_id)
            if self.waiting.get(seq) and self.waiting[seq][0] == v.request_id:
                self.waiting[seq].popleft()

    @rule(seq=st.integers(1, 4), start=st.booleans(), end=st.booleans())
    def arrive(self, seq: int, start: bool, end: bool) -> None:
        self.n += 1
        rid = f"r{self.n}"
        self.arrived.setdefault(seq, []).append(rid)
        self._apply([self.gate.arrive(rid, seq, start, end, self.now)], seq)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.in_flight)))
        seq, instance = self.in_flight.pop(rid)
        self.now += 1
        verdicts = self.gate.finished(rid, self.now)
        for v in verdicts:
            if isinstance(v, Admit):
                assert v.instance == instance, "a sequence moved to another instance"
        self._apply(verdicts, seq)

    @rule(dt=st.integers(0, 2 * IDLE))
    def tick(self, dt: int) -> None:
        self.now += dt
        for gone in self.gate.release_idle(self.now):
            assert not any(s == gone for s, _ in self.in_flight.values())
            assert not self.waiting.get(gone)
        idle_at = self.gate.next_idle_us()
        assert idle_at is None or idle_at > self.now, "an idle sequence was kept past its idle time"

    @invariant()
    def instance_counts_match(self) -> None:
        assert sum(self.gate.per_instance()) == self.gate.active()

    @invariant()
    def order_kept(self) -> None:
        for seq, through in self.through.items():
            order = {rid: i for i, rid in enumerate(self.arrived[seq])}
            assert [order[r] for r in through] == sorted(order[r] for r in through)

    @invariant()
    def nothing_waits_without_one_in_flight(self) -> None:
        for seq, queue in self.waiting.items():
            if queue:
                assert any(s == seq for s, _ in self.in_flight.values())

    @invariant()
    def every_request_decided_or_waiting(self) -> None:
        waiting = {r for q in self.waiting.values() for r in q}
        for seq_arrivals in self.arrived.values():
            for rid in seq_arrivals:
                assert (rid in self.decided) != (rid in waiting)


GateMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestGateMachine = GateMachine.TestCase
