"""workers/instance.py hands a batch to its thread and lets the thread take the GIL before the loop goes on:
start() marks the instance busy and hands the batch over on the loop's next turn (after what the driver's
step set going, such as the finished batch's reply write); that hand-off returns once the thread has begun
the batch, and never waits longer than HANDOFF_WAIT_S (a thread still busy with other work). An executor
that cannot take it reports the batch failed, leaving the instance free."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from batching.plan import Batch
from workers import instance as instance_module
from workers.backends import load_backend
from workers.backends.base import LoadContext
from workers.execute import BatchOutcome, Computed, compute_batch, run_batch
from workers.instance import Callbacks, Instance, Job

from .test_execute import SPEC, MergedDoubler, env
from .test_sleep_backend import sleep_spec


def _instance(executor: ThreadPoolExecutor) -> Instance:
    backend = load_backend(LoadContext(spec=sleep_spec("0", "0"), model_dir=Path("."), version=1,
                                       instance_name="m_0", device="cpu"))
    return Instance("m_0", backend, executor)


def _job(ran: threading.Event, go: threading.Event | None = None) -> Job:
    def run() -> BatchOutcome:
        ran.set()
        if go is not None:
            assert go.wait(5)
        return None  # type: ignore[return-value]  # the outcome is the driver's business, not tested here
    return Job(1, Batch(0, ()), run)


def _callbacks(idle: asyncio.Event) -> Callbacks:
    return Callbacks(done=lambda *_: None, idle=lambda _: idle.set(), refused=lambda _: None,
                     custody_fresh=lambda: True)


def test_start_returns_once_the_thread_has_begun_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instance_module, "HANDOFF_WAIT_S", 30.0)  # so that only the thread's signal ends it
    entered = threading.Event()
    chain = Instance._chain

    def recording_chain(self: Instance, *args: object) -> None:
        entered.set()  # before the real _chain signals the loop: set by the time the hand-off returns
        chain(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Instance, "_chain", recording_chain)
    ran, go = threading.Event(), threading.Event()

    async def scenario() -> None:
        idle = asyncio.Event()
        with ThreadPoolExecutor(1) as executor:
            # The thread first started: a new one would run (holding the GIL) before submit() returns.
            executor.submit(lambda: None).result()
            instance = _instance(executor)
            instance.start(_job(ran, go), asyncio.get_running_loop(), _callbacks(idle))
            assert instance.busy and not entered.is_set()  # handed over on the loop's next turn
            started = time.monotonic()
            await asyncio.sleep(0)  # that turn: the hand-off
            assert time.monotonic() - started < 5  # the thread's signal, not the 30 s bound
            assert entered.is_set()
            go.set()
            await asyncio.wait_for(idle.wait(), 5)
        assert ran.is_set()

    asyncio.run(scenario())


def test_a_busy_thread_keeps_the_loop_no_longer_than_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instance_module, "HANDOFF_WAIT_S", 0.05)
    ran, release = threading.Event(), threading.Event()

    async def scenario() -> None:
        idle = asyncio.Event()
        with ThreadPoolExecutor(1) as executor:
            instance = _instance(executor)
            executor.submit(release.wait, 5)  # the thread is busy with something else
            started = time.monotonic()
            instance.start(_job(ran), asyncio.get_running_loop(), _callbacks(idle))
            await asyncio.sleep(0)  # the hand-off
            assert time.monotonic() - started < 2.5  # the 50 ms bound, not the 5 s the thread is busy
            assert not ran.is_set()  # the loop went on after the bound; the batch waits for the thread
            release.set()
            await asyncio.wait_for(idle.wait(), 5)
        assert ran.is_set()

    asyncio.run(scenario())


def test_an_executor_that_cannot_take_the_batch_reports_it_failed() -> None:
    ran = threading.Event()
    reports: list[object] = []

    async def scenario() -> None:
        idle = asyncio.Event()
        executor = ThreadPoolExecutor(1)
        executor.shutdown()
        instance = _instance(executor)
        callbacks = Callbacks(done=lambda _job, outcome, _started: reports.append(outcome),
                              idle=lambda _: idle.set(), refused=lambda _: None, custody_fresh=lambda: True)
        instance.start(_job(ran), asyncio.get_running_loop(), callbacks)
        await asyncio.wait_for(idle.wait(), 5)
        assert not instance.busy

    asyncio.run(scenario())
    assert not ran.is_set() and len(reports) == 1 and isinstance(reports[0], RuntimeError)


class _StubCall:
    """A stub's call as workers/execute.py's LoopRun makes it: written from the loop, its reply read there."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def begin(self, loop: asyncio.AbstractEventLoop, done: Callable[[object], None]) -> bool:
        self.order.append("stub call written")
        loop.call_soon(done, RuntimeError("the stub's reply"))
        return True


def test_a_stub_call_goes_after_what_the_step_set_going() -> None:
    """A stub's call does not wait for the GIL, but it too goes on the loop's next turn, after the finished
    batch's reply write that the driver's step set going (bench/RESULTS.md, stop 49: `double`'s batches grew)."""
    order: list[str] = []

    async def scenario() -> None:
        idle = asyncio.Event()
        with ThreadPoolExecutor(1) as executor:
            instance = _instance(executor)
            job = _job(threading.Event())
            job.on_loop = _StubCall(order)  # type: ignore[assignment]
            loop = asyncio.get_running_loop()
            loop.call_soon(order.append, "reply write")  # queued earlier in the same step
            instance.start(job, loop, _callbacks(idle))
            order.append("start returned")
            await asyncio.wait_for(idle.wait(), 5)

    asyncio.run(scenario())
    assert order == ["start returned", "reply write", "stub call written"]


def test_the_thread_leaves_its_batch_s_replies_to_the_loop() -> None:
    """A batch computed on the thread reaches `done`, on the loop, computed but not encoded (a `Computed`, which
    workers/dispatch.py completes there) while the thread goes on; a job without `compute` runs `run` whole."""
    envs = [env("a", (1, 2)), env("b", (3, 4))]
    reports: list[tuple[object, int]] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as executor:
            instance = _instance(executor)
            split = Job(1, Batch(0, ()), functools.partial(run_batch, SPEC, MergedDoubler(), envs),
                        functools.partial(compute_batch, SPEC, MergedDoubler(), envs))
            whole = Job(1, Batch(1, ()), functools.partial(run_batch, SPEC, MergedDoubler(), envs))
            for job in (split, whole):
                idle = asyncio.Event()
                callbacks = Callbacks(done=lambda _job, outcome, _started: reports.append((outcome,
                                                                                         threading.get_ident())),
                                      idle=functools.partial(lambda event, _: event.set(), idle),
                                      refused=lambda _: None, custody_fresh=lambda: True)
                instance.start(job, loop, callbacks)
                await asyncio.wait_for(idle.wait(), 5)

    asyncio.run(scenario())
    (computed, on), (outcome, _) = reports
    assert on == threading.get_ident()  # reported on the loop's thread
    assert isinstance(computed, Computed) and isinstance(outcome, BatchOutcome)
    assert [r.outputs for r in computed.complete().replies] == [r.outputs for r in outcome.replies]
