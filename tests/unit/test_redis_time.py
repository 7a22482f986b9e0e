"""fleet.redis_time (Redis's clock as the shared time base) and batching.holding, on plain numbers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from batching.holding import Holding
from fleet.redis_time import RedisClock, Sample


def test_the_offset_is_taken_halfway_through_the_round_trip() -> None:
    clock = RedisClock()
    clock.observe(Sample(sent_us=1_000, server_us=51_100, received_us=1_200))  # Redis 50 ms ahead
    assert clock.offset_us == 50_000
    assert clock.to_redis(2_000) == 52_000 and clock.to_local(52_000) == 2_000


def test_the_sample_with_the_shortest_round_trip_wins() -> None:
    clock = RedisClock()
    clock.observe(Sample(0, 10_000, 8_000))  # slow: the answer could be anywhere in 8 ms
    clock.observe(Sample(20_000, 25_100, 20_200))  # fast: offset 5 ms +- 0.1 ms
    clock.observe(Sample(30_000, 42_000, 36_000))
    assert clock.offset_us == 5_000


def test_a_clock_that_stepped_back_during_a_sample_is_ignored() -> None:
    clock = RedisClock()
    clock.observe(Sample(10_000, 99_999, 9_000))
    assert clock.offset_us == 0 and not clock.samples


@settings(max_examples=200, deadline=None)
@given(skew=st.integers(-10**7, 10**7), rtts=st.lists(st.tuples(st.integers(0, 5_000), st.integers(0, 5_000)),
                                                      min_size=1, max_size=20))
def test_the_error_is_at_most_half_the_best_round_trip(skew: int, rtts: list[tuple[int, int]]) -> None:
    """Whatever the skew, and however the round trip splits between the two legs, the estimate is off by
    at most half the shortest round trip kept: two processes with any skew agree to within that."""
    clock = RedisClock()
    t = 10**9
    for there, back in rtts:
        clock.observe(Sample(t, t + there + skew, t + there + back))
        t += 10_000
    best = min(clock.samples, key=lambda s: s.rtt_us)
    assert abs(clock.offset_us - skew) <= best.rtt_us // 2 + 1


def test_holding_counts_a_message_delivered_twice_once() -> None:
    holding = Holding(lanes=2, per_batch=4, capacity=8)
    holding.hold((0, b"1-0"), 3)
    holding.hold((0, b"1-0"), 3)  # Redis gave it out again after a restart
    assert holding.rows() == 3
    holding.release([(0, b"1-0")])
    assert holding.rows() == 0


def test_orphans_may_take_a_saturated_holding_one_batch_past_its_bound() -> None:
    holding = Holding(lanes=2, per_batch=4, capacity=8)
    for i in range(12):  # lane 0's bound: capacity + one batch
        holding.hold((0, b"%d-0" % i), 1)
    assert holding.room(0) == 0 and holding.claim_room() == 4
    for i in range(4):
        holding.hold((0, b"c%d-0" % i), 1)
    assert holding.claim_room() == 0 and holding.room(0) == -4  # nothing new is read until they are served


def test_answered_rows_stop_counting_but_stay_held_until_released() -> None:
    holding = Holding(lanes=2, per_batch=4, capacity=8)
    holding.hold((1, b"1-0"), 4)
    holding.hold((1, b"2-0"), 4)
    assert holding.room(1) == 0  # two batches: executing and next
    holding.answered([(1, b"1-0")])  # its replies are out, its acknowledgement not yet
    assert holding.room(1) == 4 and (1, b"1-0") in holding
    holding.hold((1, b"1-0"), 4)  # delivered again meanwhile: still recognised, not counted again
    assert holding.rows() == 4
    holding.release([(1, b"1-0")])
    assert holding.rows() == 4 and (1, b"1-0") not in holding
    holding.release([(1, b"2-0")])
    assert holding.rows() == 0


def test_answered_messages_are_not_unanswered() -> None:
    holding = Holding(lanes=1, per_batch=4, capacity=8)
    a, b, gone = (0, b"1-0"), (0, b"2-0"), (0, b"3-0")
    holding.hold(a, 1)
    holding.hold(b, 0)  # a request of no rows: answered must not be told by its count
    holding.answered([a, b])
    holding.hold((0, b"4-0"), 2)
    assert holding.unanswered([a, b, gone, (0, b"4-0")]) == [(0, b"4-0")]
    holding.release([a])
    holding.hold(a, 1)  # held again after its release (a new delivery): not answered any more
    assert holding.unanswered([a]) == [a]
