"""When the worker's event loop computes a batch itself (workers/inline.py), and the thread that watches
such batches, since the loop's own watchdog cannot while the loop computes (workers/watchdog.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from batching.plan import Batch
from workers.backends.base import InferenceItem, InProcessBackend, ItemResult
from workers.execute import BatchOutcome
from workers.inline import SoloCost, may_inline
from workers.instance import Callbacks, Instance, Job
from workers.watchdog import Watchdog

FAST = SoloCost(nbytes=1024, ns=300_000)


@pytest.mark.parametrize(("lone_batches", "inline"), [(1, False), (2, False), (3, True), (40, True)])
def test_the_loop_computes_only_where_the_clients_send_one_at_a_time(lone_batches: int, inline: bool) -> None:
    assert may_inline(lone_batches, 1024, FAST, 0, False, 1_000_000) is inline


@pytest.mark.parametrize(("nbytes", "last", "queued", "others", "max_ns", "inline"), [
    (1024, FAST, 0, False, 1_000_000, True),  # alone, as small and as quick as the last one
    (16, FAST, 0, False, 1_000_000, True),  # smaller
    (1024, FAST, 0, False, 300_000, True),  # at the limit
    (1024, FAST, 0, False, 299_999, False),  # the last one took longer than the limit
    (1024, FAST, 0, False, 0, False),  # not guarded (or switched off)
    (1024, None, 0, False, 1_000_000, False),  # nothing measured yet: the thread computes and measures
    (1025, FAST, 0, False, 1_000_000, False),  # larger than the measured one (more rows, or wider)
    (1024, FAST, 1, False, 1_000_000, False),  # another request waits
    (1024, FAST, 0, True, 1_000_000, False),  # another instance computes: the loop reports for it
])
def test_the_loop_computes_a_lone_quick_request_only(nbytes: int, last: SoloCost | None, queued: int, others: bool,
                                                     max_ns: int, inline: bool) -> None:
    assert may_inline(3, nbytes, last, queued, others, max_ns) is inline


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
    reports, idle = _run_jobs(_job(1, ran), True, _job(2, ran))
    assert [(batch_id, on) for batch_id, on, _ in reports] == [(1, LOOP), (2, LOOP)]  # reported on the loop
    assert ran[0] == LOOP and ran[1].startswith("m_0")  # computed by the loop, then by the instance's thread
    assert idle


def test_a_batch_the_loop_may_no_longer_compute_goes_to_the_thread() -> None:
    ran: list[str] = []
    reports, idle = _run_jobs(_job(1, ran), False)
    assert len(ran) == 1 and ran[0].startswith("m_0") and [r[0] for r in reports] == [1] and idle


def test_a_batch_that_raises_on_the_loop_is_reported_and_the_instance_idles() -> None:
    def broken() -> BatchOutcome:
        raise RuntimeError("outside the model")

    reports, idle = _run_jobs(Job(1, Batch(1, ()), broken), True)
    [(batch_id, on, outcome)] = reports
    assert (batch_id, on) == (1, LOOP) and isinstance(outcome, RuntimeError) and idle
