"""Processes read from /proc (no psutil): the children of a process (how bench/overload.py finds the gateway,
worker and Redis that `fleet up` started, and how the e2e tests find their PIDs to signal), CPU time and RSS."""

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


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (os.sysconf("SC_CLK_TCK") a second); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def rss_mib(pid: int) -> float:
    """Resident set size (VmRSS) of a process in MiB; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
