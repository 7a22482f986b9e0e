"""Model control's shared vocabulary (Triton's --model-control-mode), used by gateways and workers alike.

* `none`: every model in the repository is served, as found at start.
* `poll`: the repository is the desired state: every process rescans it every
  `repository_poll_secs`; a model's generation is a fingerprint of its directory, so a changed config,
  a new or removed version directory or a replaced model file makes a new generation (loaded beside
  the old one, which drains once the new one serves).
* `explicit`: the desired state lives in Redis (`fleet:models`, one control record per model),
  written by the repository API's load and unload calls and seeded with `--load-model`; each call takes
  a new generation from a counter, so every worker tells calls apart.

A `Target` is one model some process should serve: where its files are and at which generation.
Nothing here talks to Redis; callers read the records and pass them in.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

# The generation of models loaded at start (none mode, `--load-model`): the same in every process.
BOOT_GEN = "0"


class ControlMode(StrEnum):
    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """One model's desired state in explicit mode: loaded or not, with the load call's overrides."""

    gen: str
    load: bool
    config: str | None = None  # a JSON ModelConfig that replaces config.pbtxt
    files: tuple[str, ...] = ()  # relative paths of `file:` overrides (contents: Keys.model_files)

    def encode(self) -> str:
        doc: dict[str, Any] = {"gen": self.gen, "load": self.load}
        if self.config is not None:
            doc["config"] = self.config
        if self.files:
            doc["files"] = list(self.files)
        return json.dumps(doc, separators=(",", ":"))

    @staticmethod
    def decode(raw: bytes | str) -> ControlRecord | None:
        """The record, or None for one this version cannot read (never fatal: the model is skipped)."""
        try:
            doc = json.loads(raw)
            gen, load = doc["gen"], doc["load"]
            config, files = doc.get("config"), doc.get("files", [])
        except (ValueError, TypeError, KeyError):
            return None
        if not (isinstance(gen, str) and isinstance(load, bool) and (config is None or isinstance(config, str))
                and isinstance(files, list) and all(isinstance(f, str) for f in files)):
            return None
        return ControlRecord(gen, load, config, tuple(files))


@dataclass(frozen=True, slots=True)
class Target:
    """A model to serve: its repository directory (None when it comes only from `file:` overrides),
    its generation, and the overrides of the load call that asked for it."""

    name: str
    gen: str
    model_dir: Path | None
    config_override: str | None = None
    files: tuple[str, ...] = field(default=())


def decode_records(raw: Mapping[Any, Any]) -> dict[str, ControlRecord]:
    """The readable records of `fleet:models` (HGETALL's answer)."""
    out: dict[str, ControlRecord] = {}
    for name, value in raw.items():
        record = ControlRecord.decode(value)
        if record is not None:
            out[name.decode() if isinstance(name, bytes) else name] = record
    return out


def startup_names(load_models: Iterable[str], dirs: Mapping[str, Path]) -> list[str]:
    """The models `--load-model` names (`*`: every model in the repository), sorted."""
    wanted = set(load_models)
    if "*" in wanted:
        wanted = (wanted - {"*"}) | set(dirs)
    return sorted(wanted)


def desired_targets(mode: ControlMode, dirs: Mapping[str, Path], records: Mapping[str, ControlRecord],
                    poll_gens: Mapping[str, str] | None = None) -> dict[str, Target]:
    """What should be served. `dirs`: the repository's model directories by name; `records`: the
    control records (explicit mode); `poll_gens`: each directory's fingerprint (poll mode, and none
    mode's at start, so a model changed between two deployments is a new generation: no process
    takes the previous deployment's published config or cached responses for it)."""
    if mode in (ControlMode.NONE, ControlMode.POLL):
        gens = poll_gens or {}
        return {name: Target(name, gens.get(name, BOOT_GEN), path) for name, path in dirs.items()}
    out: dict[str, Target] = {}
    for name, record in records.items():
        if not record.load:
            continue
        path = dirs.get(name)
        if path is None and not record.files:
            continue  # not in this process's repository: it reports nothing for it
        out[name] = Target(name, record.gen, path, record.config, record.files)
    return out


def fingerprint(model_dir: Path) -> str:
    """Poll mode's generation of a model directory: a hash of every file's path, size and mtime below
    it (hidden entries skipped). Cheap enough to take every poll for a repository of model files."""
    digest = hashlib.blake2b(digest_size=8)
    for root, subdirs, files in os.walk(model_dir):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:
                continue  # removed while walking: the next poll sees the settled directory
            digest.update(f"{os.path.relpath(path, model_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "p" + digest.hexdigest()
