"""batching.scheduler: worked examples and a hypothesis state machine that plays the driver and the
instance threads (with their real races: a stage refused by an instance that just went idle, an unstage
that comes too late) on a fake clock. Nothing sleeps."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batching.plan import (
    Action,
    Batch,
    Drop,
    Expire,
    Grow,
    Plan,
    Release,
    Run,
    SchedulerConfig,
    Stage,
    Unstage,
)
from batching.policy import BatchPolicy, Pending, effective_lane
from batching.scheduler import Scheduler


def req(rid: str, at: int = 0, *, lane: int = 0, rows: int = 1, deadline: int | None = None,
        delay: bool = False) -> Pending:
    return Pending(rid, lane, at, deadline, rows, None, delay, at)


def ids(items: tuple[Pending, ...]) -> list[str]:
    return [p.request_id for p in items]


def kinds(plan: Plan) -> list[str]:
    return [type(a).__name__ for a in plan.actions]


def make(max_batch: int = 4, instances: int = 1, *, delay_us: int = 0, preferred: tuple[int, ...] = (),
         bulk_lane: int = 1, preserve: bool = False, bulk_share: float = 1.0, partial: bool = False) -> Scheduler:
    policy = BatchPolicy(max_batch_size=max_batch, preferred_batch_sizes=preferred, max_queue_delay_us=delay_us,
                         bulk_lane=bulk_lane)
    return Scheduler(SchedulerConfig(policy, instances, bulk_lane, bulk_share, preserve_ordering=preserve,
                                     stage_partial=partial))


# ---------------------------------------------------------------- worked examples


def test_a_free_instance_runs_what_is_queued_and_the_next_full_batch_is_staged() -> None:
    s = make(max_batch=2)
    for i in range(5):
        s.arrive(req(f"r{i}"), (1, i), now_us=0)
    plan = s.step(0)
    assert kinds(plan) == ["Run", "Stage"]
    run, stage = plan.actions
    assert isinstance(run, Run) and ids(run.batch.items) == ["r0", "r1"]
    assert isinstance(stage, Stage) and ids(stage.batch.items) == ["r2", "r3"] and stage.instance == 0
    assert s.queued() == 3  # r4 queued, r2 r3 staged: Triton's "pending"
    assert s.step(0).actions == ()  # r4 waits: a partial batch is formed when the instance frees up


def test_a_partial_batch_is_never_staged_on_a_host_bound_instance() -> None:
    s = make(max_batch=4)
    s.arrive(req("a"), (1, 0), 0)
    assert kinds(s.step(0)) == ["Run"]
    s.arrive(req("b"), (1, 1), 0)
    assert s.step(0).actions == ()


def test_a_staged_batch_grows_with_what_arrives_until_the_thread_takes_it() -> None:
    s = make(max_batch=4, partial=True)
    s.arrive(req("a"), (1, 0), 0)
    (run,) = s.step(0).actions
    s.arrive(req("b"), (1, 1), 0)
    (stage,) = s.step(0).actions
    assert isinstance(stage, Stage) and ids(stage.batch.items) == ["b"]
    s.arrive(req("c"), (1, 2), 0)
    s.arrive(req("d"), (1, 3), 0)
    (grow,) = s.step(0).actions
    assert isinstance(grow, Grow) and grow.batch == stage.batch and ids(grow.into.items) == ["b", "c", "d"]
    s.grown(0, grow.into.id, replaced=True)
    assert s.step(0).actions == () and s.queued() == 3
    s.arrive(req("e"), (1, 4), 0)
    s.arrive(req("f"), (1, 5), 0)
    (grow,) = s.step(0).actions
    assert isinstance(grow, Grow) and ids(grow.into.items) == ["b", "c", "d", "e"]  # max_batch_size: f waits
    s.grown(0, grow.into.id, replaced=True)
    assert s.step(0).actions == ()
    assert isinstance(run, Run)
    s.done(0, run.batch.id, 10, 0)  # the thread moved on to b..e
    plan = s.step(10)
    # Release comes first in a plan (ahead of a Run, whose hand-off holds the loop: workers/instance.py).
    assert kinds(plan) == ["Release", "Stage"] and ids(plan.actions[1].batch.items) == ["f"]  # type: ignore[union-attr]


def test_a_growth_that_comes_too_late_runs_the_batch_as_it_was_and_requeues_the_rest() -> None:
    s = make(max_batch=4, partial=True)
    s.arrive(req("a"), (1, 0), 0)
    (run,) = s.step(0).actions
    s.arrive(req("b"), (1, 1), 0)
    s.step(0)
    s.arrive(req("c"), (1, 2), 0)
    (grow,) = s.step(0).actions
    assert isinstance(grow, Grow)
    s.grown(0, grow.into.id, replaced=False)  # the thread had taken "b" alone
    assert s.step(0).actions == () and s.queued() == 1
    assert isinstance(run, Run)
    s.done(0, run.batch.id, 10, 0)
    plan = s.step(10)
    assert kinds(plan) == ["Release", "Stage"] and ids(plan.actions[1].batch.items) == ["c"]  # type: ignore[union-attr]
    assert plan.actions[0] == Release((run.batch.id,))


def test_with_preserve_ordering_only_the_last_dispatched_batch_grows() -> None:
    s = make(max_batch=4, instances=2, partial=True, preserve=True)

    def arrive(rid: str, key: str, order: int) -> None:
        s.arrive(Pending(rid, 0, 0, None, 1, key, False, 0), (1, order), 0)

    arrive("x", "k", 0)
    arrive("y", "j", 1)
    assert kinds(s.step(0)) == ["Run", "Run"]
    arrive("b", "k", 2)
    (stage_b,) = s.step(0).actions
    arrive("c", "j", 3)  # another shape: a batch of its own, staged on the other instance, dispatched after b's
    (stage_c,) = s.step(0).actions
    assert isinstance(stage_b, Stage) and isinstance(stage_c, Stage) and stage_b.instance != stage_c.instance
    arrive("d", "j", 4)  # joins c's batch, the last dispatched
    (grow,) = s.step(0).actions
    assert isinstance(grow, Grow) and ids(grow.into.items) == ["c", "d"]
    s.grown(grow.instance, grow.into.id, replaced=True)
    arrive("n", "k", 5)  # could join b's batch, but would then be answered before c and d
    assert s.step(0).actions == () and s.queued() == 4


def test_a_cancel_that_comes_after_the_thread_took_the_batch_is_forgotten_when_it_is_done() -> None:
    s = make(max_batch=1)
    s.arrive(req("a"), (1, 0), 0)
    s.arrive(req("b"), (1, 1), 0)
    run, stage = s.step(0).actions
    s.cancel({"b"})
    (unstage,) = s.step(0).actions
    assert isinstance(unstage, Unstage)
    s.unstaged(0, unstage.batch.id, taken_back=False)  # the thread had taken "b": it runs
    assert isinstance(run, Run) and isinstance(stage, Stage)
    s.done(0, run.batch.id, 10, 0)
    s.done(0, stage.batch.id, 20, 10)
    assert s._cancelled == set()  # noqa: SLF001 - nothing left to drop: "b" ran


def test_a_batch_staged_behind_a_busy_instance_moves_to_one_that_frees_up() -> None:
    s = make(max_batch=4, instances=2, partial=True)
    s.arrive(req("a"), (1, 0), 0)
    (first,) = s.step(0).actions
    s.arrive(req("b"), (1, 1), 0)
    (second,) = s.step(0).actions
    assert isinstance(first, Run) and isinstance(second, Run) and first.instance != second.instance
    s.arrive(req("c"), (1, 2), 0)
    (stage,) = s.step(0).actions
    assert isinstance(stage, Stage)
    other = first if first.instance != stage.instance else second
    s.done(other.instance, other.batch.id, 10, 0)
    s.idle(other.instance)
    plan = s.step(10)
    assert kinds(plan) == ["Unstage"]
    s.unstaged(stage.instance, stage.batch.id, taken_back=True)
    plan = s.step(10)
    runs = [a for a in plan.actions if isinstance(a, Run)]
    assert [(r.instance, ids(r.batch.items)) for r in runs] == [(other.instance, ["c"])]


def test_a_higher_priority_arrival_takes_back_a_staged_batch() -> None:
    s = make(max_batch=1, bulk_lane=2)
    s.arrive(req("low0", lane=1), (1, 0), 0)
    s.arrive(req("low1", lane=1), (1, 1), 0)
    assert kinds(s.step(0)) == ["Run", "Stage"]
    s.arrive(req("high", lane=0), (2, 0), 0)
    plan = s.step(0)
    assert kinds(plan) == ["Unstage"]
    s.unstaged(0, plan.actions[0].batch.id, taken_back=True)  # type: ignore[union-attr]
    plan = s.step(0)
    assert kinds(plan) == ["Stage"] and ids(plan.actions[0].batch.items) == ["high"]  # type: ignore[union-attr]


def test_an_unstage_that_comes_too_late_leaves_the_batch_running() -> None:
    s = make(max_batch=1, bulk_lane=2)
    s.arrive(req("low0", lane=1), (1, 0), 0)
    s.arrive(req("low1", lane=1), (1, 1), 0)
    run, stage = s.step(0).actions
    s.arrive(req("high", lane=0), (2, 0), 0)
    (unstage,) = s.step(0).actions
    assert isinstance(unstage, Unstage)
    s.unstaged(0, unstage.batch.id, taken_back=False)  # the thread took it already
    assert s.step(0).actions == ()  # not asked again
    assert isinstance(run, Run) and isinstance(stage, Stage)
    s.done(0, run.batch.id, 10, 0)  # the thread had moved on to low1
    assert kinds(s.step(10)) == ["Release", "Stage"]  # high is staged behind low1


def test_reject_answers_an_expired_request_while_every_instance_is_busy() -> None:
    s = make(max_batch=1)
    s.arrive(req("busy"), (1, 0), 0)
    s.step(0)
    s.arrive(req("late", deadline=150), (1, 1), 0)
    plan = s.step(100)
    assert plan.actions == () and plan.wake_at_us == 150
    plan = s.step(150)
    assert kinds(plan) == ["Expire"] and ids(plan.actions[0].items) == ["late"]  # type: ignore[union-attr]


def test_a_staged_request_goes_back_to_the_queue_to_time_out_when_the_running_batch_outlasts_the_margin() -> None:
    """Staged when its deadline was more than the margin away (1 s); the running batch takes 3 s. Once
    within the margin it is taken back, so that it times out in the queue at its deadline instead of
    running after it (seen on a real Valkey: a 1.5 s REJECT request behind a 3 s batch answered 200)."""
    s = make(max_batch=1)
    s.arrive(req("busy"), (1, 0), 0)
    s.arrive(req("late", deadline=1_500_000), (1, 1), 0)
    run, stage = s.step(0).actions
    assert isinstance(run, Run) and isinstance(stage, Stage) and ids(stage.batch.items) == ["late"]
    plan = s.step(10)
    assert plan.actions == () and plan.wake_at_us == 500_000  # looked at again 1 s before its deadline
    plan = s.step(500_000)
    assert kinds(plan) == ["Unstage"]
    s.unstaged(0, stage.batch.id, taken_back=True)
    plan = s.step(500_000)
    assert plan.actions == () and plan.wake_at_us == 1_500_000  # queued, not staged again
    plan = s.step(1_500_000)
    assert kinds(plan) == ["Expire"] and ids(plan.actions[0].items) == ["late"]  # type: ignore[union-attr]


def test_delay_keeps_an_expired_request_behind_the_unexpired_ones() -> None:
    s = make(max_batch=1)
    s.arrive(req("late", deadline=10, delay=True), (1, 0), 0)
    s.arrive(req("fresh"), (1, 1), 20)
    plan = s.step(20)
    assert ids(plan.actions[0].batch.items) == ["fresh"]  # type: ignore[union-attr]


def test_the_queue_delay_waits_then_sends_a_partial_batch() -> None:
    s = make(max_batch=8, delay_us=100)
    s.arrive(req("a", at=1_000), (1, 0), 1_000)
    plan = s.step(1_050)
    assert plan.actions == () and plan.wake_at_us == 1_100
    assert kinds(s.step(1_100)) == ["Run"]


def test_a_claimed_orphan_goes_before_newer_requests_of_its_lane() -> None:
    s = make(max_batch=1)
    s.arrive(req("new"), (2_000, 0), 0)
    s.arrive(req("orphan"), (1_000, 5), 0)  # an older stream entry, claimed from a dead worker
    assert ids(s.step(0).actions[0].batch.items) == ["orphan"]  # type: ignore[union-attr]


def test_preserve_ordering_releases_in_dispatch_order_across_instances() -> None:
    s = make(max_batch=1, instances=2, preserve=True)
    s.arrive(req("first"), (1, 0), 0)
    s.arrive(req("second"), (1, 1), 0)
    first, second = s.step(0).actions
    assert isinstance(first, Run) and isinstance(second, Run)
    s.done(second.instance, second.batch.id, 5, 0)
    assert s.step(5).actions == ()  # the second finished first: held
    s.done(first.instance, first.batch.id, 9, 0)
    (release,) = s.step(9).actions
    assert isinstance(release, Release) and release.batches == (first.batch.id, second.batch.id)


def test_without_preserve_ordering_a_finished_batch_is_released_at_once() -> None:
    s = make(max_batch=1, instances=2)
    s.arrive(req("first"), (1, 0), 0)
    s.arrive(req("second"), (1, 1), 0)
    _, second = s.step(0).actions
    s.done(second.instance, second.batch.id, 5, 0)  # type: ignore[union-attr]
    assert s.step(5).actions == (Release((second.batch.id,)),)  # type: ignore[union-attr]


def test_a_finished_batch_is_released_ahead_of_the_batch_that_follows_it() -> None:
    """The replies' write is set going before the next batch is handed over: the hand-off holds the worker's
    loop until the instance's thread has begun (workers/instance.py), and replies written after it waited
    for that (bench/RESULTS.md, stop 49: `double` 1.13x at C=32)."""
    s = make(max_batch=2, delay_us=100)
    s.arrive(req("a"), (1, 0), 0)
    s.arrive(req("b"), (1, 1), 0)
    (run,) = s.step(0).actions
    s.arrive(req("c"), (1, 2), 5)  # not a full batch: not staged, it waits for the instance
    assert kinds(s.step(5)) == []
    assert isinstance(run, Run)
    s.done(0, run.batch.id, 200, 0)
    s.idle(0)
    plan = s.step(200)
    assert kinds(plan) == ["Release", "Run"] and plan.actions[0] == Release((run.batch.id,))


def test_cancelled_requests_are_dropped_queued_or_staged() -> None:
    s = make(max_batch=1)
    for i in range(3):
        s.arrive(req(f"r{i}"), (1, i), 0)
    run, stage = s.step(0).actions
    s.cancel({"r1", "r2"})
    plan = s.step(0)
    assert kinds(plan) == ["Drop", "Unstage"] and ids(plan.actions[0].items) == ["r2"]  # type: ignore[union-attr]
    s.unstaged(0, plan.actions[1].batch.id, taken_back=True)  # type: ignore[union-attr]
    plan = s.step(0)
    assert kinds(plan) == ["Drop"] and ids(plan.actions[0].items) == ["r1"]  # type: ignore[union-attr]


def test_bulk_takes_its_share_while_online_requests_come_in() -> None:
    s = make(max_batch=1, bulk_share=0.25)
    s.arrive(req("bulk0", lane=1), (1, 0), 0)
    s.arrive(req("bulk1", lane=1), (1, 1), 0)
    s.arrive(req("online", lane=0), (1, 2), 0)
    run = s.step(0).actions[0]
    assert isinstance(run, Run) and ids(run.batch.items) == ["online"]
    s.done(0, run.batch.id, 10, 0)
    s.idle(0)
    run = next(a for a in s.step(10).actions if isinstance(a, Run))
    assert ids(run.batch.items) == ["bulk0"]
    s.done(0, run.batch.id, 20, 10)  # bulk ran 10 µs: at a share of 1/4, 30 µs idle follow
    s.idle(0)
    plan = s.step(20)
    assert [a for a in plan.actions if isinstance(a, Run)] == [] and plan.wake_at_us == 50
    assert any(isinstance(a, Run) for a in s.step(50).actions)


def test_generation_slots_are_never_staged_and_bulk_holds_at_most_its_cap() -> None:
    policy = BatchPolicy(max_batch_size=0, dynamic=False, bulk_lane=1)
    s = Scheduler(SchedulerConfig(policy, 3, 1, stage=False, bulk_instances=2))
    for i in range(4):
        s.arrive(req(f"bulk{i}", lane=1), (1, i), 0)
    bulk = [a for a in s.step(0).actions if isinstance(a, Run)]
    assert [ids(a.batch.items) for a in bulk] == [["bulk0"], ["bulk1"]]
    assert s.step(0).actions == ()  # a third slot is free, but it is kept for online requests
    s.arrive(req("online0", lane=0), (1, 4), 0)
    s.arrive(req("online1", lane=0), (1, 5), 0)
    plan = s.step(0)
    assert [ids(a.batch.items) for a in plan.actions if isinstance(a, Run)] == [["online0"]]
    assert s.step(0).actions == ()  # every slot busy: online1 waits queued, never staged behind one
    s.done(bulk[0].instance, bulk[0].batch.id, 10, 0)
    s.idle(bulk[0].instance)
    runs = [a for a in s.step(10).actions if isinstance(a, Run)]
    assert [ids(a.batch.items) for a in runs] == [["online1"]]  # online first; bulk2 then waits for a slot


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        make(instances=0)
    with pytest.raises(ValueError):
        make(bulk_share=0)


# ---------------------------------------------------------------- the state machine


@dataclass
class _Thread:
    """An instance's thread, as workers/instance.py runs it."""

    running: Batch | None = None
    staged: Batch | None = None
    busy: bool = False


@dataclass
class _World:
    threads: list[_Thread]
    posted: deque[tuple[str, int, int]] = field(default_factory=deque)  # (event, instance, batch id)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(instances=st.integers(1, 3), max_batch=st.integers(1, 4), delay_us=st.sampled_from([0, 50, 400]),
                preserve=st.booleans(), share=st.sampled_from([1.0, 0.5]), levels=st.integers(1, 2),
                partial=st.booleans())
    def setup(self, instances: int, max_batch: int, delay_us: int, preserve: bool, share: float, levels: int,
              partial: bool) -> None:
        self.bulk_lane = levels
        self.policy = BatchPolicy(max_batch_size=max_batch, max_queue_delay_us=delay_us, aging_us=1_000,
                                  bulk_lane=self.bulk_lane)
        self.s = Scheduler(SchedulerConfig(self.policy, instances, self.bulk_lane, share, preserve_ordering=preserve,
                                           stage_partial=partial))
        self.world = _World([_Thread() for _ in range(instances)])
        self.preserve = preserve
        self.now = 0
        self.seq = 0
        self.arrived: dict[str, Pending] = {}
        self.ended: dict[str, str] = {}  # request id -> how it ended
        self.dispatched: list[int] = []  # batch ids in dispatch order
        self.batches: dict[int, Batch] = {}
        self.released: list[int] = []
        self.finished: set[int] = set()

    # -- the world

    @rule(lane=st.integers(0, 2), rows=st.integers(1, 3), timeout=st.none() | st.integers(1, 2_000),
          delay=st.booleans())
    def arrive(self, lane: int, rows: int, timeout: int | None, delay: bool) -> None:
        lane = min(lane, self.bulk_lane)
        rid = f"r{self.seq}"
        item = Pending(rid, lane, self.now, None if timeout is None or lane == self.bulk_lane else self.now + timeout,
                       rows, None, delay, self.now)
        self.arrived[rid] = item
        self.s.arrive(item, (self.now, self.seq), self.now)
        self.seq += 1

    @rule(dt=st.integers(1, 800))
    def advance(self, dt: int) -> None:
        self.now += dt

    @rule(data=st.data())
    def thread_finishes(self, data: st.DataObject) -> None:
        busy = [i for i, t in enumerate(self.world.threads) if t.running is not None]
        if busy:
            self.finish(data.draw(st.sampled_from(busy)))

    def finish(self, i: int) -> None:
        """Instance i's thread computes its batch and moves on to the staged one, or goes idle."""
        t = self.world.threads[i]
        assert t.running is not None
        self.world.posted.append(("done", i, t.running.id))
        t.running, t.staged = t.staged, None
        if t.running is None:
            t.busy = False
            self.world.posted.append(("idle", i, -1))

    @rule()
    def deliver(self) -> None:
        if not self.world.posted:
            return
        event, i, batch_id = self.world.posted.popleft()
        if event == "done":
            self.s.done(i, batch_id, self.now, max(0, self.now - 100))
            self.finished.add(batch_id)
        else:
            self.s.idle(i)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        open_ids = sorted(set(self.arrived) - set(self.ended))
        if open_ids:
            self.s.cancel({data.draw(st.sampled_from(open_ids))})

    @rule()
    def step(self) -> None:
        for _ in range(50):
            plan = self.s.step(self.now)
            if plan.wake_at_us is not None:
                assert plan.wake_at_us > self.now or plan.actions, "a wake-up in the past with nothing to do"
            if not plan.actions:
                return
            for action in plan.actions:
                self.apply(action)
            if not self.s.changed:
                # The driver steps again at once only if carrying out the plan changed the scheduler
                # (workers/loop.py), else on the next event: a step now must find nothing to do.
                again = self.s.step(self.now)
                assert not again.actions, f"a step after a plan that changed nothing acted: {kinds(again)}"
                return
        raise AssertionError("step() kept producing actions without any event")

    def apply(self, action: Action) -> None:
        if isinstance(action, (Run, Stage)):
            self.check_batch(action.batch)
            t = self.world.threads[action.instance]
            if isinstance(action, Run):
                assert not t.busy, "Run on a busy instance"
                t.busy, t.running = True, action.batch
            elif not t.busy or t.staged is not None:
                self.s.stage_refused(action.instance, action.batch.id)
                return
            else:
                t.staged = action.batch
            self.dispatched.append(action.batch.id)
            self.batches[action.batch.id] = action.batch
        elif isinstance(action, Grow):
            self.check_batch(action.into)
            assert {p.request_id for p in action.batch.items} < {p.request_id for p in action.into.items}
            t = self.world.threads[action.instance]
            replaced = t.staged is not None and t.staged.id == action.batch.id
            if replaced:
                t.staged = action.into
                self.dispatched[self.dispatched.index(action.batch.id)] = action.into.id
                self.batches[action.into.id] = action.into
            self.s.grown(action.instance, action.into.id, replaced)
        elif isinstance(action, Unstage):
            t = self.world.threads[action.instance]
            taken = t.staged is not None and t.staged.id == action.batch.id
            if taken:
                t.staged = None
                self.dispatched.remove(action.batch.id)
            self.s.unstaged(action.instance, action.batch.id, taken)
        elif isinstance(action, Expire):
            for p in action.items:
                assert p.deadline_us is not None and p.deadline_us <= self.now and not p.delay_on_timeout
                self.end(p.request_id, "expired")
        elif isinstance(action, Drop):
            for p in action.items:
                self.end(p.request_id, "dropped")
        elif isinstance(action, Release):
            for batch_id in action.batches:
                assert batch_id in self.finished, "released before it was computed"
                self.released.append(batch_id)
                for p in self.batches[batch_id].items:
                    self.end(p.request_id, "answered")

    def end(self, rid: str, how: str) -> None:
        assert rid in self.arrived and rid not in self.ended, f"{rid} ended twice ({self.ended.get(rid)}, {how})"
        self.ended[rid] = how

    def check_batch(self, batch: Batch) -> None:
        items = batch.items
        assert items
        assert len(items) == 1 or batch.rows <= self.policy.max_batch_size
        for p in items:
            assert not (p.deadline_us is not None and p.deadline_us <= self.now and not p.delay_on_timeout), \
                "an expired REJECT request was dispatched"
        # Strict priority: nothing still queued outranks a dispatched request.
        lanes = [effective_lane(self.policy, p, self.now) for p in items]
        waiting = set(self.arrived) - set(self.ended) - {p.request_id for p in items} - self.in_flight()
        for rid in waiting:
            other = self.arrived[rid]
            expired = other.deadline_us is not None and other.deadline_us <= self.now
            if not expired:
                assert effective_lane(self.policy, other, self.now) >= min(lanes), "a higher lane was overtaken"

    def in_flight(self) -> set[str]:
        return {p.request_id for b in self.dispatched if b not in self.released for p in self.batches[b].items}

    @invariant()
    def released_in_dispatch_order(self) -> None:
        if getattr(self, "preserve", False):
            assert self.released == self.dispatched[: len(self.released)]

    @invariant()
    def threads_hold_at_most_one_staged_batch(self) -> None:
        for t in getattr(self, "world", _World([])).threads:
            assert t.staged is None or t.running is not None

    @precondition(lambda self: hasattr(self, "s"))
    @rule()
    def drain(self) -> None:
        """The world settles: time passes, threads finish, events arrive; everything ends exactly once."""
        for _ in range(10_000):
            self.step()
            if self.world.posted:
                self.deliver()
                continue
            busy = [i for i, t in enumerate(self.world.threads) if t.running is not None]
            if busy:
                self.finish(busy[0])
                continue
            if set(self.arrived) == set(self.ended) and not self.s.busy():
                return
            self.now += 100
        raise AssertionError(f"did not settle: {len(self.arrived) - len(self.ended)} open, queued {self.s.queued()}")

    def teardown(self) -> None:
        if hasattr(self, "s"):
            self.drain()
            assert set(self.ended) == set(self.arrived)


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
