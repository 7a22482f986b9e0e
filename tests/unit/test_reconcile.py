"""workers/reconcile.py: the reconcile step of model control, with examples and a hypothesis state
machine that changes the desired state at random, loads succeed or fail at random, and checks that a
model that served keeps serving until its replacement does, and that the worker converges."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.reconcile import Load, Unit, UnitState, Unload, reconcile

READY, LOADING, UNLOADING = UnitState.READY, UnitState.LOADING, UnitState.UNLOADING


def test_desired_units_are_loaded_once() -> None:
    desired = {("m", 1): "g1", ("m", 2): "g1"}
    assert reconcile(desired, {}, set()) == [Load(Unit("m", 1, "g1")), Load(Unit("m", 2, "g1"))]
    assert reconcile(desired, {Unit("m", 1, "g1"): LOADING}, {Unit("m", 2, "g1")}) == []


def test_a_new_version_replaces_the_old_once_it_serves() -> None:
    old, new = Unit("m", 1, "g1"), Unit("m", 2, "g2")
    desired = {("m", 2): "g2"}
    assert reconcile(desired, {old: READY}, set()) == [Load(new)]
    assert reconcile(desired, {old: READY, new: LOADING}, set()) == []
    assert reconcile(desired, {old: READY, new: READY}, set()) == [Unload(old)]


def test_a_failed_replacement_leaves_the_old_unit_serving() -> None:
    old, new = Unit("m", 1, "g1"), Unit("m", 1, "g2")
    assert reconcile({("m", 1): "g2"}, {old: READY}, {new}) == []


def test_a_reload_of_the_same_version_waits_for_that_version() -> None:
    """Version 1 reloaded while version 2 already serves at the new generation: 1's old unit waits for
    1's new one, not for any version of the model."""
    old1, new1, new2 = Unit("m", 1, "g1"), Unit("m", 1, "g2"), Unit("m", 2, "g2")
    desired = {("m", 1): "g2", ("m", 2): "g2"}
    assert reconcile(desired, {old1: READY, new1: LOADING, new2: READY}, set()) == []
    assert reconcile(desired, {old1: READY, new1: READY, new2: READY}, set()) == [Unload(old1)]


def test_an_unloaded_model_goes_at_once_but_loading_and_unloading_units_are_left_alone() -> None:
    a, b, c = Unit("m", 1, "g1"), Unit("m", 2, "g1"), Unit("m", 3, "g1")
    assert reconcile({}, {a: READY, b: LOADING, c: UNLOADING}, set()) == [Unload(a)]


MODELS = ["a", "b"]
VERSIONS = [1, 2, 3]


class Worker(RuleBasedStateMachine):
    """The worker's side: actual units, a desired state that changes, loads that finish or fail."""

    def __init__(self) -> None:
        super().__init__()
        self.desired: dict[tuple[str, int], str] = {}
        self.actual: dict[Unit, UnitState] = {}
        self.failed: set[Unit] = set()
        self.gen = 0
        self.serving_before: set[str] = set()

    def step(self) -> None:
        """One reconcile, applied as the driver does: loads start, unloads start draining."""
        self.serving_before = self.serving()
        for action in reconcile(self.desired, self.actual, self.failed):
            if isinstance(action, Load):
                assert action.unit not in self.actual and action.unit not in self.failed
                self.actual[action.unit] = LOADING
            else:
                assert self.actual[action.unit] is READY
                self.actual[action.unit] = UNLOADING
        self.check_no_gap()

    def serving(self) -> set[str]:
        return {u.model for u, s in self.actual.items() if s is READY}

    def check_no_gap(self) -> None:
        """A model still desired that served before the step still serves after it."""
        wanted = {m for m, _ in self.desired}
        assert (self.serving_before & wanted) <= self.serving()

    @rule(model=st.sampled_from(MODELS), versions=st.sets(st.sampled_from(VERSIONS), max_size=2))
    def change_desired(self, model: str, versions: set[int]) -> None:
        self.gen += 1
        self.desired = {k: g for k, g in self.desired.items() if k[0] != model}
        self.desired.update({(model, v): f"g{self.gen}" for v in versions})
        self.failed = {u for u in self.failed if self.desired.get((u.model, u.version)) == u.gen}
        self.step()

    @precondition(lambda self: any(s is LOADING for s in self.actual.values()))
    @rule(data=st.data(), ok=st.booleans())
    def finish_a_load(self, data: st.DataObject, ok: bool) -> None:
        unit = data.draw(st.sampled_from(sorted(u for u, s in self.actual.items() if s is LOADING)))
        if ok:
            self.actual[unit] = READY
        else:
            del self.actual[unit]
            self.failed.add(unit)
        self.step()

    @precondition(lambda self: any(s is UNLOADING for s in self.actual.values()))
    @rule(data=st.data())
    def finish_an_unload(self, data: st.DataObject) -> None:
        unit = data.draw(st.sampled_from(sorted(u for u, s in self.actual.items() if s is UNLOADING)))
        del self.actual[unit]
        self.step()

    @invariant()
    def converges_once_loads_succeed(self) -> None:
        """Let every load succeed and every unload finish: then what serves is exactly what is desired
        (less what failed, plus old units kept because their replacement failed), and another step
        changes nothing."""
        actual, failed = dict(self.actual), set(self.failed)
        for _ in range(10):
            actions = reconcile(self.desired, actual, failed)
            actual = {u: READY for u, s in actual.items() if s is not UNLOADING}
            for action in actions:
                if isinstance(action, Load):
                    actual[action.unit] = READY
                else:
                    del actual[action.unit]
        assert reconcile(self.desired, actual, failed) == []
        desired_units = {Unit(m, v, g) for (m, v), g in self.desired.items()} - failed
        assert desired_units <= set(actual)
        for unit in set(actual) - desired_units:
            replacements = [Unit(m, v, g) for (m, v), g in self.desired.items() if m == unit.model]
            same = [r for r in replacements if r.version == unit.version] or replacements
            assert same and all(r in failed for r in same), f"{unit} kept without a failed replacement"


Worker.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestWorker = Worker.TestCase
