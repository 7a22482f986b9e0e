"""Process lifetime: children that die with the process that started them.

A supervisor killed with SIGKILL (the OOM killer does that) runs no cleanup, so its children would run
on in their own sessions, holding ports and sockets. Linux's parent-death signal (prctl
PR_SET_PDEATHSIG) makes the kernel signal a child the moment its parent exits, whatever killed it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; a no-op elsewhere).

    Call it in the child, first thing (as a Popen `preexec_fn`, or at the top of the child's main).
    `parent_pid`: the parent expected; if it already died before the call (the child was reparented),
    the signal is sent at once. The kernel ties the signal to the parent *thread* that forked the
    child, so start children from a thread that lives as long as the supervisor (its main thread).
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
