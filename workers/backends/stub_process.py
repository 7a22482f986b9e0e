"""A Python-backend stub's process, apart from its pipe (workers/backends/stub_pipe.py): how it is started,
what its end says, and a last call to it that may not return."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

# The kernel sends a child its parent-death signal when the *thread* that forked it exits, not only when
# the process does. Stubs are started on load (a loader thread), on restart and on revive (instance
# threads), so they are all forked from this one thread instead, which lives as long as the process.
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(argv: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="python-stub-spawner")
        spawner = _spawner
    return spawner.submit(subprocess.Popen, argv, pass_fds=pass_fds).result()


def exit_status(proc: subprocess.Popen[bytes] | None) -> str:
    """How a stub whose pipe closed ended, in words."""
    if proc is None:
        return "not running"
    try:
        code = proc.wait(5)  # the pipe closes a moment before the process is reaped
    except subprocess.TimeoutExpired:
        return "its pipe closed but the process still runs"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def call_or_kill(call: Callable[[], None], proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    """`call()` (a round trip to the stub `proc`) on a thread of its own, for at most `timeout_s`; then the
    stub is killed, which ends the call (its pipe closes)."""
    done = threading.Event()

    def run() -> None:
        try:
            call()
        finally:
            done.set()

    threading.Thread(target=run, name=what, daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("%s did not return within %.0f s; killing its stub", what, timeout_s)
        proc.kill()
        done.wait(5)
