"""System shared-memory registrations shared by the gateway processes of one host, as files in one
directory (`--shared-memory-dir`; `fleet up --gateways N` gives its gateways one, emptied at its start,
as tritonserver forgets its regions when it restarts).

tritonclient registers a region over one connection and infers over others, and with several gateway
processes on the same ports (SO_REUSEPORT) those land on different processes. Each registration is one
file, named by a hash of the region's name and holding its name, key, offset and byte size; each process
maps a region itself, the first time a request names it. A file appears whole or not at all (written
aside, then hard-linked to its name, which also makes "already registered" exact across processes), and
its identity (inode, mtime) tells a process whether the region it mapped is still the one registered.

A directory, not Redis: a key names an object in this host's /dev/shm, so only processes of this host
may share a registration (gateway/shared_memory.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

Identity = tuple[int, int]  # (st_ino, st_mtime_ns) of a registration's file


@dataclass(frozen=True, slots=True)
class Registration:
    name: str
    key: str
    offset: int
    byte_size: int


class RegistrationFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.directory / f"{hashlib.sha256(name.encode()).hexdigest()}.json"

    def publish(self, reg: Registration) -> Identity | None:
        """Records `reg` and returns its identity; None if its name is registered already (by any process)."""
        aside = self.directory / f".{os.getpid()}-{uuid.uuid4().hex}.tmp"
        aside.write_text(json.dumps({"name": reg.name, "key": reg.key, "offset": reg.offset,
                                     "byte_size": reg.byte_size}))
        try:
            os.link(aside, self._path(reg.name))
            st = os.stat(aside)  # the same inode as the name, whatever happens to the name meanwhile
            return st.st_ino, st.st_mtime_ns
        except FileExistsError:
            return None
        finally:
            aside.unlink(missing_ok=True)

    def identity(self, name: str) -> Identity | None:
        try:
            st = os.stat(self._path(name))
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def read(self, name: str) -> tuple[Identity, Registration] | None:
        try:
            with open(self._path(name), "rb") as f:
                st = os.fstat(f.fileno())
                doc = json.loads(f.read())
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns), _registration(doc)

    def all(self) -> list[Registration]:
        """By name, as tritonserver lists its regions (a std::map)."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                found.append(_registration(json.loads(path.read_bytes())))
            except FileNotFoundError:  # unregistered meanwhile
                continue
        return sorted(found, key=lambda r: r.name)

    def count(self) -> int:
        return sum(1 for _ in self.directory.glob("*.json"))

    def remove(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def remove_all(self) -> None:
        for path in self.directory.glob("*.json"):
            path.unlink(missing_ok=True)


def _registration(doc: dict[str, object]) -> Registration:
    return Registration(str(doc["name"]), str(doc["key"]), int(str(doc["offset"])), int(str(doc["byte_size"])))
