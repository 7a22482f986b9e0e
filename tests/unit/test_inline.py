"""When the worker's event loop computes a batch itself (workers/inline.py), and the thread that watches
such batches, since the loop's own watchdog cannot while the loop computes (workers/watchdog.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batching.holding import Holding
from batching.plan import Batch
from workers.backends.base import InferenceItem, InProcessBackend, ItemResult
from workers.execute import BatchOutcome
from workers.inline import LONE_BATCHES, Costs, Neighbours, batch_cost, may_inline
from workers.instance import Callbacks, Instance, Job
from workers.watchdog import Watchdog


def _costs(*measured: tuple[int, int]) -> Costs:
    costs = Costs()
    for nbytes, ns in measured:
        costs.measured(nbytes, ns)
    return costs


def test_nothing_measured_predicts_nothing() -> None:
    assert Costs().predict(1024) is None


def test_a_batch_costs_what_one_at_least_as_large_did_or_that_of_a_smaller_one_scaled_up() -> None:
    costs = _costs((1024, 300_000))
    assert costs.predict(1024) == 300_000
    assert costs.predict(16) == 300_000  # smaller: no cheaper than the measured one (its fixed part)
    assert costs.predict(3072) == 900_000  # three times the bytes: at most three times the time
    assert costs.predict(1025) == 300_293  # (rounded up)


def test_the_smallest_bound_counts() -> None:
    # A lone request (1 KiB, 0.3 ms) and a batch of 16 (16 KiB, 1.2 ms): a batch of 13 is bounded by the
    # batch (1.2 ms), not by 13 lone requests (3.9 ms); a lone request by itself, not by the batch.
    costs = _costs((1024, 300_000), (16_384, 1_200_000))
    assert costs.predict(13_312) == 1_200_000
    assert costs.predict(1024) == 300_000
    assert costs.predict(32_768) == 2_400_000


def test_a_batch_as_large_that_just_took_long_says_more_than_cheaper_smaller_ones() -> None:
    # A cost that grows faster than the bytes (or two measures under different loads): 16 lone requests
    # would say 1.6 ms, but the last 16 KiB batch took 3 ms.
    costs = _costs((1024, 100_000), (16_384, 3_000_000))
    assert costs.predict(16_384) == 3_000_000 and costs.predict(20_000) == 3_662_110


def test_each_band_of_sizes_keeps_its_last_measure() -> None:
    costs = _costs((16_384, 1_200_000), (1024, 300_000), (1024, 500_000))  # the later lone one replaces
    assert costs.predict(1024) == 500_000 and costs.predict(16_384) == 1_200_000
    costs.measured(20_000, 900_000)  # the same band as 16 KiB (16,384-32,767 bytes): replaces it
    assert costs.predict(16_384) == 900_000


def test_a_batch_costs_its_wall_time_on_the_loop_and_its_cpu_time_on_the_thread() -> None:
    # On the thread a batch also waits for the GIL and a core, which it would not on the loop.
    assert batch_cost(3_000_000, 1_200_000, on_the_loop=False) == 1_200_000
    assert batch_cost(3_000_000, 1_200_000, on_the_loop=True) == 3_000_000  # how long it held the loop
    assert batch_cost(3_000_000, -1, on_the_loop=False) == 3_000_000  # not measured


@given(fixed=st.integers(0, 10_000_000), per_byte=st.integers(0, 10_000),
       measured=st.lists(st.integers(1, 1 << 22), min_size=1, max_size=12), data=st.data())
def test_for_a_fixed_part_and_a_part_in_proportion_the_prediction_is_never_short(
        fixed: int, per_byte: int, measured: list[int], data: st.DataObject) -> None:
    def cost(n: int) -> int:
        return fixed + per_byte * n

    nbytes = data.draw(st.one_of(st.sampled_from(measured), st.integers(0, 1 << 22)))
    costs = _costs(*[(n, cost(n)) for n in measured])
    predicted = costs.predict(nbytes)
    assert predicted is not None and predicted >= cost(nbytes)
    if [n for n in measured if n.bit_length() == nbytes.bit_length()][-1:] == [nbytes]:  # measured, and kept
        assert predicted == cost(nbytes)


QUICK, SLOW = 300_000, 1_200_000


@pytest.mark.parametrize(("predicted", "max_ns", "inline"), [
    (QUICK, 1_000_000, True),
    (1_000_000, 1_000_000, True),  # at the limit
    (1_000_001, 1_000_000, False),  # past it
    (None, 1_000_000, False),  # nothing measured yet: the thread computes and measures
    (QUICK, 0, False),  # not guarded (or switched off)
])
def test_the_loop_computes_a_batch_predicted_within_the_limit(predicted: int | None, max_ns: int,
                                                              inline: bool) -> None:
    assert may_inline(predicted, max_ns, bulk=False, neighbours_hold=False, sole=True, others_running=False,
                      lone_batches=0, queued=0) is inline


def test_a_sole_instance_has_its_batches_computed_by_the_loop_whatever_else_waits() -> None:
    assert may_inline(QUICK, 1_000_000, bulk=False, neighbours_hold=False, sole=True, others_running=False,
                      lone_batches=0, queued=50)


def test_a_batch_with_a_bulk_request_goes_to_the_thread() -> None:
    assert not may_inline(QUICK, 1_000_000, bulk=True, neighbours_hold=False, sole=True, others_running=False,
                          lone_batches=0, queued=0)
    assert not may_inline(QUICK, 1_000_000, bulk=True, neighbours_hold=False, sole=False, others_running=False,
                          lone_batches=LONE_BATCHES, queued=0)


def test_while_another_model_of_the_worker_holds_requests_the_thread_computes() -> None:
    assert not may_inline(QUICK, 1_000_000, bulk=False, neighbours_hold=True, sole=True, others_running=False,
                          lone_batches=0, queued=0)
    assert not may_inline(QUICK, 1_000_000, bulk=False, neighbours_hold=True, sole=False, others_running=False,
                          lone_batches=LONE_BATCHES, queued=0)


def test_neighbours_say_whether_another_loop_holds_requests() -> None:
    neighbours = Neighbours()
    mine, other = Holding(1, 8, 16), Holding(1, 8, 16)
    neighbours.add(mine)
    neighbours.add(other)
    mine.hold((0, b"1-0"), 1)
    assert not neighbours.others_hold(mine) and neighbours.others_hold(other)  # its own do not count
    other.hold((0, b"2-0"), 1)
    assert neighbours.others_hold(mine)
    other.answered([(0, b"2-0")])  # its reply written: nothing waits on the loop for it
    assert not neighbours.others_hold(mine)
    other.hold((0, b"3-0"), 1)
    neighbours.remove(other)  # its loop ended
    assert not neighbours.others_hold(mine)


@pytest.mark.parametrize(("lone_batches", "queued", "others", "inline"), [
    (1, 0, False, False),  # one at a time is not a pattern yet
    (LONE_BATCHES - 1, 0, False, False),
    (LONE_BATCHES, 0, False, True),  # the clients send one at a time
    (40, 0, False, True),
    (LONE_BATCHES, 1, False, False),  # another request waits: another instance can take it
    (LONE_BATCHES, 0, True, False),  # another instance computes: the loop reports for it
])
def test_with_other_instances_only_lone_requests_of_clients_sending_one_at_a_time(
        lone_batches: int, queued: int, others: bool, inline: bool) -> None:
    assert may_inline(QUICK, 1_000_000, bulk=False, neighbours_hold=False, sole=False, others_running=others,
                      lone_batches=lone_batches, queued=queued) is inline
    assert not may_inline(SLOW, 1_000_000, bulk=False, neighbours_hold=False, sole=False, others_running=others,
                          lone_batches=lone_batches, queued=queued)


class _Inline(InProcessBackend):
    runs_inline = True

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return []

    def close(self) -> None:
        pass


def _instance(backend: InProcessBackend) -> Instance:
    return Instance("m_0", backend, ThreadPoolExecutor(1, thread_name_prefix="m_0"))


def test_a_batch_the_loop_computes_past_the_limit_is_handed_to_on_hung_from_the_guard_thread() -> None:
    instance = _instance(_Inline())
    calls: list[tuple[object, str]] = []
    called = threading.Event()

    def on_hung(hung: object) -> None:
        calls.append((hung, threading.current_thread().name))
        called.set()

    dog = Watchdog("m", [instance], watchdog_s=0.2, on_hung=on_hung)
    try:
        assert dog.guard_inline() and dog.guard_inline()  # one thread, however often asked
        # Computed on the instance's thread past the limit: the loop's own check handles that one.
        instance.running_since = time.monotonic() - 10
        assert not called.wait(0.3)
        instance.running_inline = True  # the loop computes it: the loop cannot look, the guard does
        assert called.wait(2.0)
        time.sleep(0.3)
        assert calls == [(instance, "m-inline-watchdog")]  # once
    finally:
        dog.unguard()
        instance.executor.shutdown()


def test_a_batch_the_loop_computes_within_the_limit_is_left_alone() -> None:
    instance = _instance(_Inline())
    hung: list[object] = []
    dog = Watchdog("m", [instance], watchdog_s=1.2, on_hung=hung.append)
    try:
        assert dog.guard_inline()
        instance.running_inline, instance.running_since = True, time.monotonic()
        time.sleep(0.4)  # past the guard's look (every 0.3 s here), within the limit
        instance.running_inline, instance.running_since = False, None
        time.sleep(1.5)
        assert hung == []
    finally:
        dog.unguard()
        instance.executor.shutdown()


def test_nothing_is_computed_by_the_loop_where_a_hang_could_not_be_handled() -> None:
    capable, plain = _instance(_Inline()), _instance(_Inline())
    plain.inline_capable = False
    assert not Watchdog("none", [capable], watchdog_s=0, on_hung=print).guard_inline()  # no limit
    assert not Watchdog("none", [capable], watchdog_s=1.0).guard_inline()  # nothing to do about one
    assert not Watchdog("none", [plain], watchdog_s=1.0, on_hung=print).guard_inline()  # none computes so
    assert "none-inline-watchdog" not in [t.name for t in threading.enumerate()]
    capable.executor.shutdown()
    plain.executor.shutdown()


def _run_jobs(first: Job, inline_still: bool, staged: Job | None = None) -> tuple[list[tuple[int, str, object]], bool]:
    """Start `first` (to be computed by the loop, if that still holds when it gets to it), with `staged`
    queued behind it: each batch reported done (its id, the thread it was reported on, its outcome), and
    whether the instance ended idle."""
    instance = _instance(_Inline())
    reports: list[tuple[int, str, object]] = []

    async def main() -> None:
        idle = asyncio.Event()

        def done(job: Job, outcome: object, started_us: int) -> None:
            reports.append((job.batch.id, threading.current_thread().name, outcome))

        callbacks = Callbacks(done=done, idle=lambda _: idle.set(), refused=lambda _: None, custody_fresh=lambda: True)
        first.inline = lambda: inline_still
        instance.start(first, asyncio.get_running_loop(), callbacks)
        if staged is not None:
            assert instance.stage(staged)
        await asyncio.wait_for(idle.wait(), 5)

    asyncio.run(main())
    instance.executor.shutdown()
    return reports, not instance.busy


def _job(batch_id: int, ran: list[str]) -> Job:
    def run() -> BatchOutcome:
        ran.append(threading.current_thread().name)
        return BatchOutcome([], 0, 0, 0)

    return Job(1, Batch(batch_id, ()), run)


LOOP = "MainThread"  # asyncio.run's


def test_the_loop_computes_the_batch_and_the_thread_the_one_staged_behind_it() -> None:
    ran: list[str] = []
    first, second = _job(1, ran), _job(2, ran)
    reports, idle = _run_jobs(first, True, second)
    assert [(batch_id, on) for batch_id, on, _ in reports] == [(1, LOOP), (2, LOOP)]  # reported on the loop
    assert ran[0] == LOOP and ran[1].startswith("m_0")  # computed by the loop, then by the instance's thread
    assert first.on_the_loop and not second.on_the_loop  # so each is costed as batch_cost says
    assert idle


def _staged_behind(first_on_loop: bool) -> tuple[list[str], list[str], list[int], bool]:
    """A batch the loop may compute, staged behind one computed by the loop (or the thread): the threads
    that computed the two, those that asked whether the staged one may go inline, the batches reported in
    order, and whether the instance ended idle."""
    ran: list[str] = []
    asked: list[str] = []

    def inline() -> bool:
        asked.append(threading.current_thread().name)
        return True

    staged = _job(2, ran)
    staged.inline = inline
    reports, idle = _run_jobs(_job(1, ran), first_on_loop, staged)
    return ran, asked, [r[0] for r in reports], idle


def test_a_staged_batch_the_loop_may_compute_is_computed_by_the_loop_after_one_it_computed() -> None:
    ran, asked, reported, idle = _staged_behind(first_on_loop=True)
    assert ran == [LOOP, LOOP] and asked == [LOOP] and reported == [1, 2] and idle


def test_a_staged_batch_behind_one_the_thread_computes_is_the_thread_s_and_never_asks() -> None:
    ran, asked, reported, idle = _staged_behind(first_on_loop=False)
    assert len(ran) == 2 and all(name.startswith("m_0") for name in ran) and asked == []
    assert reported == [1, 2] and idle


def test_a_batch_the_loop_may_no_longer_compute_goes_to_the_thread() -> None:
    ran: list[str] = []
    job = _job(1, ran)
    reports, idle = _run_jobs(job, False)
    assert len(ran) == 1 and ran[0].startswith("m_0") and [r[0] for r in reports] == [1] and idle
    assert not job.on_the_loop


def test_a_batch_that_raises_on_the_loop_is_reported_and_the_instance_idles() -> None:
    def broken() -> BatchOutcome:
        raise RuntimeError("outside the model")

    reports, idle = _run_jobs(Job(1, Batch(1, ()), broken), True)
    [(batch_id, on, outcome)] = reports
    assert (batch_id, on) == (1, LOOP) and isinstance(outcome, RuntimeError) and idle
