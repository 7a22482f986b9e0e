"""Processes read from /proc (no psutil): the children of a process (how bench/overload.py finds the gateway,
worker and Redis that `fleet up` started, and how the e2e tests find their PIDs to signal), CPU time, RSS,
the TCP ports a process listens on or holds connections on; and stopping a process this program started."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"  # the `st` column of /proc/net/tcp


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


def descendants(pid: int) -> list[tuple[int, list[bytes]]]:
    """(pid, argv) of every live process below pid: its children, theirs, and so on."""
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child[0])
    return out


def fleet_children(parent_pid: int, role: str) -> list[int]:
    """The PIDs of `python -m fleet <role>` processes (gateway, worker, ...) whose parent is parent_pid
    (`fleet up`), in order."""
    return sorted(pid for pid, argv in children(parent_pid) if argv[1:4] == [b"-m", b"fleet", role.encode()])


def running(pid: int) -> bool:
    """Whether process `pid` still runs: not gone, and its main thread not a zombie (exited, waiting for its
    parent to reap it; other threads of it may still be exiting, their descriptors still open)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (os.sysconf("SC_CLK_TCK") a second); 0 if it is gone."""
    return sum(cpu_split(pid))


def cpu_split(pid: int, tid: int | None = None) -> tuple[int, int]:
    """(utime, stime) in clock ticks: of the process `pid`, or of its thread `tid` (the main thread's id is
    the pid); (0, 0) if it is gone. A process's counts include its threads that have ended."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return int(fields[11]), int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0, 0


def rss_mib(pid: int) -> float:
    """Resident set size (VmRSS) of a process in MiB; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def tcp_ports(pid: int, state: str) -> list[int]:
    """The local port of each TCP socket (IPv4 and IPv6) process `pid` holds in `state` (TCP_LISTEN,
    TCP_ESTABLISHED): its descriptors' socket inodes matched against /proc/net/tcp{,6}; [] if it is gone.
    The kernel writes those tables a page per read, so sockets opened or closed meanwhile (anywhere on the
    host) can repeat a line or skip one: repeats are dropped by inode; a caller that counts re-reads."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    ports: dict[str, int] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == state and fields[9] in inodes:
                ports[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return list(ports.values())


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
    """Signal a process this program started (if it still runs) and wait for it; SIGKILL after timeout_s."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
