"""The child processes of a process, read from /proc (no psutil): how bench/overload.py finds the gateway,
worker and Redis that `fleet up` started, and how the e2e tests find their PIDs to signal."""

from __future__ import annotations

from pathlib import Path


def children(parent_pid: int) -> list[tuple[int, list[bytes]]]:
    """(pid, argv) of every live process whose parent is parent_pid."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != parent_pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        found.append((int(stat.parent.name), argv))
    return found
