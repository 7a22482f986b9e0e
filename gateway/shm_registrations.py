"""System shared-memory registrations shared by the gateway processes of one host, as files in one
directory (`--shared-memory-dir`; `fleet up --gateways N` gives its gateways one, emptied at its start,
as tritonserver forgets its regions when it restarts).

tritonclient registers a region over one connection and infers over others, and with several gateway
processes on the same ports (SO_REUSEPORT) those land on different processes. Each registration is one
file, named by a hash of the region's name and holding its name, key, offset and byte size; each process
maps a region itself, the first time a request names it. A file appears whole or not at all (written
aside, then hard-linked to its name, which also makes "already registered" exact across processes), and
its identity (inode, and an mtime set to the nanosecond it was written) tells a process whether the
region it mapped is still the one registered: a freed inode number can come back at once, a nanosecond
clock reading does not.

The directory is this user's, and no one else may write it (made 0700; checked): a file in it decides
which object a gateway maps. Anything else found under a registration's name (a symlink, a FIFO, a file
that does not decode) is never followed or mapped: lookups and status see no region, while the name stays
taken (registering it answers "already in manager") and counts towards the cap until it is unregistered.

A directory, not Redis: a key names an object in this host's /dev/shm, so only processes of this host
may share a registration (gateway/shared_memory.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

Identity = tuple[int, int]  # (st_ino, st_mtime_ns) of a registration's file
MAX_FILE_BYTES = 64 * 1024  # a registration is ~200 bytes; a region name is at most what a request carries


@dataclass(frozen=True, slots=True)
class Registration:
    name: str
    key: str
    offset: int
    byte_size: int

    def status(self) -> dict[str, str | int]:
        """Triton's status object of the region."""
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class RegistrationFiles:
    """The registrations in `directory` (made 0700 if missing; refused if another user owns it or group or
    others may write it). Every method is safe against other processes doing the same at the same time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(directory, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ValueError(f"shared-memory directory {directory}: must be a directory of this user's that "
                             f"no one else may write (mode 0700, or 0755)")

    def _path(self, name: str) -> Path:
        # surrogatepass: a JSON body may carry a lone surrogate in a region name; it names a file all the same
        return self.directory / f"{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()}.json"

    def publish(self, reg: Registration) -> Identity | None:
        """Records `reg` and returns its identity; None if its name is registered already (by any process)."""
        aside = self.directory / f".{os.getpid()}-{uuid.uuid4().hex}.tmp"
        try:
            aside.write_text(json.dumps({"name": reg.name, "key": reg.key, "offset": reg.offset,
                                         "byte_size": reg.byte_size}))
            now = time.time_ns()
            os.utime(aside, ns=(now, now))
            os.link(aside, self._path(reg.name))
            st = os.stat(aside)  # the same inode as the name, whatever happens to the name meanwhile
            return st.st_ino, st.st_mtime_ns
        except FileExistsError:
            return None
        finally:
            aside.unlink(missing_ok=True)

    def identity(self, name: str) -> Identity | None:
        try:
            st = os.stat(self._path(name), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None

    def read(self, name: str) -> tuple[Identity, Registration] | None:
        found = _read(self._path(name))
        return found if found is not None and found[1].name == name else None

    def all(self) -> list[Registration]:
        """By name, as tritonserver lists its regions (a std::map)."""
        found = [r for path in self.directory.glob("*.json") if (r := _read(path)) is not None]
        return sorted((reg for _, reg in found), key=lambda r: r.name)

    def count(self) -> int:
        return sum(1 for _ in self.directory.glob("*.json"))

    def remove(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def remove_all(self) -> None:
        for path in self.directory.glob("*.json"):
            path.unlink(missing_ok=True)


def _read(path: Path) -> tuple[Identity, Registration] | None:
    """The registration in `path`, or None: gone, not a regular file (never followed, never blocked on),
    too large, or not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            return None
        doc = json.loads(os.read(fd, MAX_FILE_BYTES))
        reg = Registration(doc["name"], doc["key"], doc["offset"], doc["byte_size"])
        if not (isinstance(reg.name, str) and isinstance(reg.key, str) and type(reg.offset) is int
                and type(reg.byte_size) is int and reg.offset >= 0 and reg.byte_size >= 1):
            return None
        return (st.st_ino, st.st_mtime_ns), reg
    except (OSError, ValueError, TypeError, KeyError):
        return None
    finally:
        os.close(fd)
