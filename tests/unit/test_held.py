"""workers/held.py: a read request's scheduler entry, and the driver's bookkeeping of what it holds."""

from __future__ import annotations

from fleet.envelope import RequestEnvelope, error_reply
from fleet.errors import RequestTimeout
from fleet.redis_link import entry_order
from fleet.trace_points import BATCH_FORMED, COMPUTE_END, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_START
from workers.execute import BatchOutcome
from workers.held import (
    HeldRequest,
    HeldRequests,
    pending_for,
    stamp,
    stamp_replies,
)

OFFSET = 1_000  # this process's clock runs 1 ms behind Redis's in these tests


def to_local(redis_us: int) -> int:
    return redis_us - OFFSET


def env(rid: str = "r1", *, deadline: int | None = None, expires: int | None = None, enqueued: int = 10_000,
        traced: bool = False) -> RequestEnvelope:
    return RequestEnvelope(id=rid, model="m", version=1, inputs=[], reply_to="replies", enqueued_at_us=enqueued,
                           deadline_us=deadline, expires_us=expires, trace={} if traced else None)


def test_entry_ids_order_by_time_then_sequence() -> None:
    assert entry_order(b"1700-3") == (1700, 3)
    assert entry_order(b"1700") == (1700, 0)
    assert sorted([b"1701-0", b"1700-10", b"1700-9"], key=entry_order) == [b"1700-9", b"1700-10", b"1701-0"]


def test_a_pending_entry_is_in_this_process_clock_and_named_by_lane_and_entry() -> None:
    p = pending_for((2, b"5-1"), env(deadline=50_000), 3, ("k",), True, to_local, now=20_000)
    assert (p.request_id, p.lane, p.rows, p.shape_key) == ("2/5-1", 2, 3, ("k",))
    assert p.enqueued_at_us == 10_000 - OFFSET
    assert p.deadline_us == 50_000 - OFFSET
    assert p.delay_on_timeout is True
    assert p.aging_from_us == 20_000


def test_an_enqueue_time_ahead_of_now_counts_from_now() -> None:
    # Clocks disagree by more than the offset: the request cannot have waited a negative time.
    p = pending_for((0, b"1-0"), env(enqueued=30_000), 1, None, False, to_local, now=20_000)
    assert p.enqueued_at_us == 20_000


def test_the_caller_giving_up_first_drops_the_request_then_and_never_delays_it() -> None:
    p = pending_for((0, b"1-0"), env(deadline=50_000, expires=40_000), 1, None, True, to_local, now=20_000)
    assert (p.deadline_us, p.delay_on_timeout) == (40_000 - OFFSET, False)
    # The queue policy's deadline comes first: it stands, with its DELAY action.
    p = pending_for((0, b"1-0"), env(deadline=30_000, expires=40_000), 1, None, True, to_local, now=20_000)
    assert (p.deadline_us, p.delay_on_timeout) == (30_000 - OFFSET, True)
    # No queue deadline at all: the caller's is the deadline.
    p = pending_for((0, b"1-0"), env(expires=40_000), 1, None, False, to_local, now=20_000)
    assert p.deadline_us == 40_000 - OFFSET
    p = pending_for((0, b"1-0"), env(), 1, None, False, to_local, now=20_000)
    assert p.deadline_us is None


def held(message: tuple[int, bytes], e: RequestEnvelope) -> HeldRequest:
    return HeldRequest(message, e, e.version, pending_for(message, e, 1, None, False, to_local, now=20_000))


def test_held_requests_count_the_traced_ones_until_forgotten() -> None:
    requests = HeldRequests()
    a, b = held((0, b"1-0"), env("a", traced=True)), held((0, b"2-0"), env("b"))
    c = held((1, b"1-0"), env("c", traced=True))
    for h in (a, b, c):
        requests.add(h)
    assert requests.traced == 2 and requests["0/2-0"] is b
    assert requests.forget([a.pending, b.pending]) == [a, b]
    assert requests.traced == 1 and requests
    requests.forget([c.pending])
    assert requests.traced == 0 and not requests


def test_lost_and_cancelled_requests_are_found_per_version() -> None:
    requests = HeldRequests()
    a, b = held((0, b"1-0"), env("a")), held((0, b"2-0"), env("b"))
    b.version = 2
    requests.add(a)
    requests.add(b)
    assert requests.of_callers({"b", "unknown"}) == {2: {"0/2-0"}}
    # A message this worker does not hold (answered already) is skipped; a held one is marked lost.
    assert requests.mark_lost([(0, b"1-0"), (0, b"9-0"), (0, b"1-0")]) == {1: {"0/1-0"}}
    assert a.lost and not b.lost


def test_replies_carry_trace_stamps_only_for_traced_requests() -> None:
    a, b = held((0, b"1-0"), env("a", traced=True)), held((0, b"2-0"), env("b"))
    stamp([a.env, b.env], BATCH_FORMED, 7)
    assert a.env.trace == {BATCH_FORMED: 7} and b.env.trace is None
    replies = [error_reply(h.env, RequestTimeout()) for h in (a, b)]
    assert replies[0].error_code == "UNAVAILABLE" and replies[0].error_message == RequestTimeout().message
    outcome = BatchOutcome(replies, compute_input_ns=10, compute_infer_ns=100, compute_output_ns=1_000)
    stamp_replies([a, b], replies, outcome, redis_now_ns=5_000_000)
    assert replies[1].trace is None
    stamps = replies[0].trace
    assert stamps is not None and stamps[BATCH_FORMED] == 7
    start = stamps[COMPUTE_START]
    assert (stamps[COMPUTE_INPUT_END] - start, stamps[COMPUTE_OUTPUT_START] - start,
            stamps[COMPUTE_END] - start) == (10, 110, 1_110)
    # Outputs encoded by the loop after a hand-over from the instance's thread (workers/execute.py's
    # Computed): the output starts after it.
    outcome.handed_over_ns = 50
    stamp_replies([a], replies[:1], outcome, redis_now_ns=5_000_000)
    stamps = replies[0].trace
    assert stamps is not None
    start = stamps[COMPUTE_START]
    assert (stamps[COMPUTE_INPUT_END] - start, stamps[COMPUTE_OUTPUT_START] - start,
            stamps[COMPUTE_END] - start) == (10, 160, 1_160)
    # An expired request's reply (no outcome) carries only what it passed.
    replies = [error_reply(a.env, RequestTimeout())]
    stamp_replies([a], replies, None, redis_now_ns=5_000_000)
    assert replies[0].trace == {BATCH_FORMED: 7}
