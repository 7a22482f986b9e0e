"""Process lifetime: children that die with the process that started them, and a data-directory lock
that dies with its holders.

A supervisor killed with SIGKILL (the OOM killer does that) runs no cleanup, so its children would run
on in their own sessions, holding ports and sockets. Linux's parent-death signal (prctl
PR_SET_PDEATHSIG) makes the kernel signal a child the moment its parent exits, whatever killed it.

Two supervisors on one data directory would share its Redis socket and AOF (the second server unlinks
and takes over the first one's socket). `lock_data_dir` takes an flock on a file in it: the kernel drops
it when the last process holding it exits, so a SIGKILLed supervisor never leaves a stale lock.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
LOCK_FILE = "fleet-up.lock"

# Resolved once, at import: a Popen preexec_fn runs between fork and exec, where a multi-threaded parent's
# child must not take the dynamic loader's locks (dlopen), only make the system call.
_PRCTL: Callable[..., int] | None = (
    ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
)


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; a no-op elsewhere).

    Call it in the child, first thing (as a Popen `preexec_fn`, or at the top of the child's main).
    `parent_pid`: the parent expected; if it already died before the call (the child was reparented),
    the signal is sent at once. The kernel ties the signal to the parent *thread* that forked the
    child, so start children from a thread that lives as long as the supervisor (its main thread).
    The setting survives exec but is not inherited by the child's own children.
    """
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def dies_with_this_process(sig: int) -> Callable[[], None]:
    """A Popen `preexec_fn`: the child gets `sig` when the calling process (thread) exits."""
    return functools.partial(die_with_parent, sig, os.getpid())


class DataDirInUse(RuntimeError):
    """Another `fleet up` (or a process it started, still finishing) holds the data directory."""


@dataclass
class DataDirLock:
    path: Path
    fd: int  # pass it to a child (Popen pass_fds) and the lock also lasts as long as that child

    def release(self) -> None:
        os.close(self.fd)


def lock_data_dir(data_dir: Path, *, wait_for_leftovers_s: float = 10.0) -> DataDirLock:
    """Lock `data_dir` for this process, writing its PID in the lock file; raises DataDirInUse.

    Fails at once while the PID recorded there is alive. When it is not (that supervisor died and a
    child holding the lock, its Redis writing out the AOF, is still finishing), waits up to
    `wait_for_leftovers_s` for the lock, then fails naming the processes that hold it.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    path = (data_dir / LOCK_FILE).resolve()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_for_leftovers_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
        owner = _recorded_pid(fd)
        if owner is not None and _alive(owner):
            os.close(fd)
            raise DataDirInUse(f"{data_dir} is in use by another `fleet up` (PID {owner}); stop it, or give "
                               f"this one another --data-dir")
        if time.monotonic() > deadline:
            os.close(fd)
            holders = ", ".join(str(p) for p in lock_holders(path)) or "unknown"
            who = f"PID {owner}, gone" if owner is not None else "PID unknown"
            raise DataDirInUse(f"{data_dir} is locked by processes left over from a `fleet up` ({who}): "
                               f"PIDs {holders}; stop them, or give this one another --data-dir")
        time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DataDirLock(path, fd)


def _recorded_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None  # empty: its holder locked it a moment ago and has not written its PID yet


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for its parent to reap it (a SIGKILLed supervisor is one)."""
    if not Path("/proc/self").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True  # (PermissionError: alive, someone else's)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def lock_holders(path: Path) -> list[int]:
    """PIDs of the processes with `path` open (read from /proc: only those this user may inspect)."""
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(link) == str(path) for link in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
        except OSError:
            continue  # gone meanwhile, or not ours
    return sorted(found)
