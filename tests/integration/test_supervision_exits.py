"""`fleet up`'s and `fleet gateway --processes N`'s supervision (fleet/launcher.py): a child that keeps
dying while Redis answers stops everything, and the command then exits 1 (an orchestrator's restart
policy sees a failure); the same exits while Redis is unreachable are the outage's, not counted."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from fleet import launcher
from fleet.redis_server import LocalServer, free_port


def _dying_children() -> launcher._Children:
    children = launcher._Children({"doomed": [sys.executable, "-c", "raise SystemExit(3)"]}, env={})
    children.start("doomed")
    return children


def test_a_child_that_keeps_dying_stops_the_supervisor(redis_server: LocalServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "RESTART_DELAY_S", 0.0)
    children = _dying_children()
    started = time.monotonic()
    try:
        assert launcher._supervise(children, None, redis_server.url, threading.Event()) is True
    finally:
        children.stop(timeout_s=5)
    assert len(children.exits["doomed"]) == launcher.CRASH_LOOP_EXITS
    assert time.monotonic() - started < 30


def test_exits_while_redis_is_unreachable_are_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "RESTART_DELAY_S", 0.0)
    children = _dying_children()
    stopping = threading.Event()
    result: list[bool] = []
    supervising = threading.Thread(target=lambda: result.append(
        launcher._supervise(children, None, f"redis://127.0.0.1:{free_port()}/0", stopping)))
    supervising.start()
    try:
        # More restarts than a crash loop allows if they counted (each start is a new PID).
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while len(seen) <= launcher.CRASH_LOOP_EXITS and time.monotonic() < deadline:
            seen.add(children.procs["doomed"].pid)
            time.sleep(0.01)
    finally:
        stopping.set()
        supervising.join(30)
        children.stop(timeout_s=5)
    assert len(seen) > launcher.CRASH_LOOP_EXITS and result == [False]
    assert children.exits["doomed"] == []
