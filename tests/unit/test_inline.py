"""When the worker's event loop computes a batch itself (workers/inline.py), and the thread that watches
such batches, since the loop's own watchdog cannot while the loop computes (workers/watchdog.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from workers.backends.base import InferenceItem, InProcessBackend, ItemResult
from workers.inline import SoloCost, may_inline
from workers.instance import Instance
from workers.watchdog import Watchdog

FAST = SoloCost(rows=1, ns=300_000)


@pytest.mark.parametrize(("requests", "rows", "last", "queued", "others", "max_ns", "inline"), [
    (1, 1, FAST, 0, False, 1_000_000, True),  # alone, as small and as quick as the last one
    (1, 1, FAST, 0, False, 300_000, True),  # at the limit
    (1, 1, FAST, 0, False, 299_999, False),  # the last one took longer than the limit
    (1, 1, FAST, 0, False, 0, False),  # not guarded (or switched off)
    (1, 1, None, 0, False, 1_000_000, False),  # nothing measured yet: the thread computes and measures
    (1, 2, FAST, 0, False, 1_000_000, False),  # more rows than the measured one
    (2, 2, SoloCost(4, 300_000), 0, False, 1_000_000, False),  # two requests: under load, the thread
    (1, 1, FAST, 1, False, 1_000_000, False),  # another request waits
    (1, 1, FAST, 0, True, 1_000_000, False),  # another instance computes: the loop reports for it
])
def test_the_loop_computes_a_lone_quick_request_only(requests: int, rows: int, last: SoloCost | None, queued: int,
                                                     others: bool, max_ns: int, inline: bool) -> None:
    assert may_inline(requests, rows, last, queued, others, max_ns) is inline


class _Inline(InProcessBackend):
    runs_inline = True

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return []

    def close(self) -> None:
        pass


def _instance(backend: InProcessBackend) -> Instance:
    return Instance("m_0", backend, ThreadPoolExecutor(1))  # type: ignore[arg-type]


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
    dog = Watchdog("m", [instance], watchdog_s=0.4, on_hung=hung.append)
    try:
        assert dog.guard_inline()
        instance.running_inline, instance.running_since = True, time.monotonic()
        time.sleep(0.25)
        instance.running_inline, instance.running_since = False, None
        time.sleep(0.5)
        assert hung == []
    finally:
        dog.unguard()
        instance.executor.shutdown()


def test_nothing_is_computed_by_the_loop_where_a_hang_could_not_be_handled() -> None:
    capable, plain = _instance(_Inline()), _instance(_Inline())
    plain.inline_capable = False
    before = threading.active_count()
    assert not Watchdog("m", [capable], watchdog_s=0, on_hung=print).guard_inline()  # no limit
    assert not Watchdog("m", [capable], watchdog_s=1.0).guard_inline()  # nothing to do about one
    assert not Watchdog("m", [plain], watchdog_s=1.0, on_hung=print).guard_inline()  # none computes so
    assert threading.active_count() == before
    capable.executor.shutdown()
    plain.executor.shutdown()
