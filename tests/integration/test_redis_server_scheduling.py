"""The embedded server's scheduling (fleet/redis_server.py `batch_scheduled`): SCHED_BATCH for the server and
every thread it starts, kept across a restart; left as any process without it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from fleet.redis_server import LocalServer, start_server

# A child inherits its parent's policy: under a test runner started with another one, neither test would say
# anything about `batch_scheduled`.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.sched_getscheduler(0) != os.SCHED_OTHER,
                                reason="SCHED_BATCH is Linux's, and the runner must run as any process")


def _policies(server: LocalServer) -> set[int]:
    """The scheduling policy of each of the server's threads (its background I/O threads included)."""
    pid = server.process.pid
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
    return policies


def test_a_batch_scheduled_server_and_its_threads_run_under_sched_batch_across_a_restart(tmp_path: Path) -> None:
    # With a parent-death signal too, as `fleet up` starts it: both settings in the one child setup.
    server = start_server(tmp_path / "batch", appendonly=True, batch_scheduled=True,
                          parent_death_signal=signal.SIGTERM)
    try:
        assert len(os.listdir(f"/proc/{server.process.pid}/task")) > 1  # its threads are checked too
        assert _policies(server) == {os.SCHED_BATCH}
        server.process.kill()
        server.process.wait()
        server.restart()
        assert _policies(server) == {os.SCHED_BATCH}
    finally:
        server.stop()


def test_a_server_started_without_it_is_scheduled_as_any_process(tmp_path: Path) -> None:
    server = start_server(tmp_path / "other", appendonly=False)
    try:
        assert _policies(server) == {os.SCHED_OTHER}
    finally:
        server.stop()
