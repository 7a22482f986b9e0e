"""free_port: a port another live process got from free_port is skipped, even while nothing listens on it
yet (the other pytest-xdist process's server not started, say); the claim ends with that process."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from fleet import redis_server
from fleet.redis_server import free_port


def test_a_port_claimed_elsewhere_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    low = int(redis_server._EPHEMERAL.read_text().split()[0])
    if low <= 11_000:
        pytest.skip("no room below the ephemeral range here")
    taken, free = free_port(), free_port()  # two ports this process may use, nothing listening on either
    redis_server._handed_out.difference_update({taken, free})
    # Another process's claim on `taken`: a lock on its own open of the same file, as that process would hold.
    other = os.open(redis_server._CLAIMS / str(taken), os.O_RDWR)
    for port in (taken, free):
        fcntl.flock(redis_server._claimed[port], fcntl.LOCK_UN)  # as if this process had never claimed them
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        picks = iter([taken, free])
        monkeypatch.setattr(redis_server.random, "randrange", lambda a, b: next(picks))
        assert free_port() == free
    finally:
        os.close(other)


def test_a_claim_ends_with_its_process() -> None:
    code = "from fleet.redis_server import free_port; print(free_port())"
    port = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))).stdout)
    fd = os.open(redis_server._CLAIMS / str(port), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again: the process that claimed it is gone
    finally:
        os.close(fd)
