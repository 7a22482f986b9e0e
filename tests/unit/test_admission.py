"""fleet.admission: priority -> lane, the queue policy of each lane, and the deadline fixed at enqueue."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.admission import admit, bulk_lane, lane_count, lane_policy, level_lane
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from tests.support.model_repo import python_config


def spec(dynamic_batching: str | None, max_batch_size: int = 8) -> ModelSpec:
    extra = "" if dynamic_batching is None else f"dynamic_batching {{ {dynamic_batching} }}"
    return parse_config(python_config("m", max_batch_size=max_batch_size, extra=extra), source="m", model_name="m")


LEVELS = spec("""priority_levels: 3 default_priority_level: 2
    default_queue_policy { default_timeout_microseconds: 1000 allow_timeout_override: true max_queue_size: 5 }
    priority_queue_policy { key: 1 value: { timeout_action: DELAY default_timeout_microseconds: 500 } }""")


def test_lanes_are_levels_plus_one_bulk_lane() -> None:
    assert (lane_count(LEVELS), bulk_lane(LEVELS)) == (4, 3)
    assert (lane_count(spec("")), bulk_lane(spec(""))) == (2, 1)
    assert (lane_count(spec(None)), bulk_lane(spec(None, 0))) == (2, 1)


@pytest.mark.parametrize(("priority", "lane"), [(1, 0), (2, 1), (3, 2), (0, 1), (4, 1), (99, 1)])
def test_priority_zero_or_out_of_range_takes_the_default_level(priority: int, lane: int) -> None:
    assert level_lane(LEVELS, priority) == lane


def test_priorities_are_ignored_without_levels() -> None:
    assert level_lane(spec(""), 1) == level_lane(spec(""), 7) == 0


def test_each_level_has_its_policy_and_the_bulk_lane_none() -> None:
    assert lane_policy(LEVELS, 0).delay_on_timeout and lane_policy(LEVELS, 0).default_timeout_us == 500
    assert lane_policy(LEVELS, 1).max_queue_size == 5 and not lane_policy(LEVELS, 1).delay_on_timeout
    assert lane_policy(LEVELS, 3).max_queue_size == 0 and lane_policy(LEVELS, 3).default_timeout_us == 0


def test_deadline_is_fixed_at_enqueue_and_an_override_only_shortens_it() -> None:
    assert admit(LEVELS, 2, 0, now_us=10_000).deadline_us == 11_000
    assert admit(LEVELS, 2, 300, now_us=10_000).deadline_us == 10_300
    assert admit(LEVELS, 2, 5_000, now_us=10_000).deadline_us == 11_000
    # level 1 does not allow overrides
    assert admit(LEVELS, 1, 100, now_us=10_000).deadline_us == 10_500
    # no default timeout: a request timeout is ignored (Triton's current core)
    plain = spec("default_queue_policy { allow_timeout_override: true }")
    assert admit(plain, 0, 100, now_us=0).deadline_us is None
    assert admit(LEVELS, 3, 0, 0).max_queue_size == 5


@given(st.integers(-5, 10), st.integers(0, 10_000), st.integers(0, 10**12))
def test_admission_is_always_an_online_lane_with_a_bounded_deadline(priority: int, timeout: int, now: int) -> None:
    a = admit(LEVELS, priority, timeout, now)
    assert 0 <= a.lane < bulk_lane(LEVELS)
    assert a.deadline_us is not None and now < a.deadline_us <= now + 1000


@pytest.mark.parametrize("model", [LEVELS, spec(""), spec(None), spec(None, max_batch_size=0),
                                   spec("priority_levels: 2 default_priority_level: 1")])
@given(priority=st.integers(-3, 6))
def test_admit_takes_the_lane_and_policy_that_level_lane_and_lane_policy_name(model: ModelSpec, priority: int) -> None:
    """admit inlines both (it runs per request): it must agree with them for every model and priority."""
    lane = level_lane(model, priority)
    policy = lane_policy(model, lane)
    a = admit(model, priority, 0, 1_000)
    assert (a.lane, a.max_queue_size, a.delay_on_timeout) == (lane, policy.max_queue_size, policy.delay_on_timeout)
    assert a.deadline_us == (1_000 + policy.default_timeout_us if policy.default_timeout_us else None)
