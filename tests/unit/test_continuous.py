"""batching.continuous: worked examples and a hypothesis state machine that plays the engine: requests
arrive in two lanes with deadlines, passes run and report (some tokens are EOS), callers cancel, time
passes. Checked every step: the KV budget and the slots are never exceeded, nobody is overtaken within a
lane, each pass holds a sequence at most once and prefills at most `prefill_chunk` tokens, and in the end
every request ends exactly once."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from batching.continuous import Chunk, ContinuousConfig, ContinuousScheduler, Finish, TooLong


def test_prefill_is_chunked_and_decoding_goes_on_meanwhile() -> None:
    s = ContinuousScheduler(ContinuousConfig(kv_blocks=64, block_tokens=4, max_running=4, prefill_chunk=8))
    s.add("short", 3, 5, order=0)
    it = s.step(0)
    assert it.prefill == (Chunk("short", 0, 3, True),) and it.decode == ()
    assert s.report() == []
    s.add("long", 20, 2, order=1)
    it = s.step(0)
    # The long prompt takes the rest of the chunk budget; the short one decodes in the same pass.
    assert it.decode == ("short",) and it.prefill == (Chunk("long", 0, 8, False),)
    s.report()
    it = s.step(0)
    assert it.decode == ("short",) and it.prefill == (Chunk("long", 8, 16, False),)
    s.report()
    it = s.step(0)
    assert it.prefill == (Chunk("long", 16, 20, True),)
    s.report()
    it = s.step(0)
    assert set(it.decode) == {"short", "long"}
    # Both reach max_new_tokens in this pass: short its 5th token, long its 2nd.
    assert s.report() == [("short", Finish.LENGTH), ("long", Finish.LENGTH)]


def test_a_request_that_cannot_fit_alone_is_refused() -> None:
    s = ContinuousScheduler(ContinuousConfig(kv_blocks=4, block_tokens=4))
    with pytest.raises(TooLong, match="budget is 4"):
        s.add("big", 10, 8)
    s.add("fits", 10, 7)  # 16 tokens cached at most: 4 blocks


def test_preemption_frees_the_youngest_and_recomputes_it() -> None:
    s = ContinuousScheduler(ContinuousConfig(kv_blocks=4, block_tokens=4, max_running=4, prefill_chunk=64))
    s.add("old", 4, 9, order=0)
    s.add("young", 4, 9, order=1)
    s.step(0)
    s.report()
    preempted: list[str] = []
    for _ in range(20):
        it = s.step(0)
        preempted += it.preempted
        if "young" in it.preempted:
            break
        s.report()
    assert preempted == ["young"] and s.waiting() == ["young"]
    s.report()
    # The old one finishes; then the young one is readmitted and prefills its prompt and its tokens again.
    while "old" in s.running():
        s.step(0)
        s.report()
    it = s.step(0)
    assert it.admitted == ("young",) and it.prefill[0].start == 0 and it.prefill[0].end > 4


def test_an_urgent_lane_preempts_bulk_generations_for_a_slot_and_for_kv() -> None:
    # No free slot: the youngest bulk generation makes way.
    s = ContinuousScheduler(ContinuousConfig(kv_blocks=20, block_tokens=4, max_running=2, prefill_chunk=64))
    s.add("bulk-old", 4, 8, lane=2, order=0)
    s.add("bulk-young", 4, 8, lane=2, order=1)
    s.step(0)
    s.report()
    s.add("online", 4, 4, lane=0, order=2)
    it = s.step(1)
    assert it.preempted == ("bulk-young",) and it.admitted == ("online",)
    assert it.decode == ("bulk-old",) and s.waiting() == ["bulk-young"]
    s.report()
    s.add("online-2", 2, 4, lane=0, order=3)  # and the last bulk one for the next
    it = s.step(2)
    assert it.preempted == ("bulk-old",) and it.admitted == ("online-2",)
    s.report()
    # Equal lanes never preempt each other: a later online request waits its turn.
    s.add("online-3", 2, 2, lane=0, order=4)
    it = s.step(3)
    assert not it.preempted and not it.admitted and s.waiting() == ["online-3", "bulk-old", "bulk-young"]

    # A free slot but no KV room (after this step's decodes take theirs): as few bulk sequences as make it fit.
    s = ContinuousScheduler(ContinuousConfig(kv_blocks=6, block_tokens=4, max_running=3, prefill_chunk=64))
    s.add("bulk-old", 8, 8, lane=2, order=0)
    s.add("bulk-young", 8, 8, lane=2, order=1)
    s.step(0)
    s.report()
    s.add("online", 8, 4, lane=0, order=2)
    it = s.step(1)
    assert it.preempted == ("bulk-young",) and it.admitted == ("online",) and it.decode == ("bulk-old",)
    s.report()
    # A request that would not fit even with every bulk sequence gone preempts nobody.
    s.add("huge", 20, 2, lane=0, order=3)
    it = s.step(2)
    assert not it.preempted and "huge" not in it.admitted


def test_cancel_frees_the_slot_at_the_next_step_and_expiry_applies_while_waiting() -> None:
    s = ContinuousScheduler(ContinuousConfig(kv_blocks=8, block_tokens=4, max_running=1))
    s.add("a", 4, 20, order=0)
    s.add("b", 4, 5, order=1, deadline_us=100)
    s.add("c", 4, 5, order=2)
    s.step(0)
    s.cancel({"a"})
    s.report()
    it = s.step(200)
    assert ("a", Finish.CANCELLED) in it.finished and ("b", Finish.EXPIRED) in it.finished
    assert it.admitted == ("c",)


class ContinuousMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.config = ContinuousConfig(kv_blocks=12, block_tokens=4, max_running=3, prefill_chunk=10)
        self.s = ContinuousScheduler(self.config)
        self.n = 0
        self.now = 0
        self.keys: dict[str, tuple[int, int]] = {}
        self.max_new: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.ended: dict[str, Finish] = {}

    def _end(self, rid: str, why: Finish) -> None:
        assert rid not in self.ended, f"{rid} ended twice"
        self.ended[rid] = why
        if why == Finish.LENGTH:
            assert self.tokens[rid] == self.max_new[rid]

    @rule(prompt=st.integers(1, 30), new=st.integers(1, 12), lane=st.integers(0, 1),
          deadline=st.none() | st.integers(1, 50))
    def add(self, prompt: int, new: int, lane: int, deadline: int | None) -> None:
        rid = f"r{self.n}"
        try:
            self.s.add(rid, prompt, new, lane=lane, order=self.n,
                       deadline_us=None if deadline is None else self.now + deadline)
        except TooLong:
            assert -(-(prompt + new - 1) // 4) > 12
            return
        finally:
            self.n += 1
        self.keys[rid] = (lane, self.n)
        self.max_new[rid] = new
        self.tokens[rid] = 0

    @rule(dt=st.integers(0, 30))
    def advance(self, dt: int) -> None:
        self.now += dt

    @precondition(lambda self: self.keys)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        open_ids = sorted(set(self.keys) - set(self.ended))
        if open_ids:
            self.s.cancel({data.draw(st.sampled_from(open_ids))})

    @rule(data=st.data())
    def iterate(self, data: st.DataObject) -> None:
        waiting_before = {rid: self.keys[rid] for rid in self.s.waiting()}
        it = self.s.step(self.now)
        for rid, why in it.finished:
            self._end(rid, why)
        in_pass = list(it.decode) + [c.request_id for c in it.prefill]
        assert len(in_pass) == len(set(in_pass)), "a sequence twice in one pass"
        assert sum(c.end - c.start for c in it.prefill) <= self.config.prefill_chunk
        if it.admitted:
            last = max(waiting_before[rid] for rid in it.admitted)
            left = [self.keys[rid] for rid in self.s.waiting() if rid in waiting_before and rid not in it.preempted]
            assert all(k > last for k in left), "a request was overtaken within its lane order"
        produced = list(it.decode) + [c.request_id for c in it.prefill if c.last]
        stopped = set(data.draw(st.lists(st.sampled_from(produced), unique=True))) if produced else set()
        for rid in produced:
            self.tokens[rid] += 1
        for rid, why in self.s.report(stopped):
            self._end(rid, why)

    @invariant()
    def budget_and_slots_hold(self) -> None:
        used = sum(seq.blocks for seq in self.s._seqs.values())
        assert used == self.config.kv_blocks - self.s.free_blocks
        assert 0 <= self.s.free_blocks <= self.config.kv_blocks
        assert len(self.s.running()) <= self.config.max_running

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.s.busy():
                break
            it = self.s.step(self.now)
            for rid, why in it.finished:
                self._end(rid, why)
            for rid in list(it.decode) + [c.request_id for c in it.prefill if c.last]:
                self.tokens[rid] += 1
            for rid, why in self.s.report():
                self._end(rid, why)
        assert not self.s.busy(), "did not drain"
        assert set(self.ended) == set(self.keys)
        assert self.s.free_blocks == self.config.kv_blocks


ContinuousMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestContinuous = ContinuousMachine.TestCase
