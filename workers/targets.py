"""What one worker should serve: model control's targets (fleet/model_control.py) read for this worker's
mode and repositories, and each target's entry (its config parsed, overridden and completed), built once
per generation. workers/control.py reconciles what serves against them.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import redis.asyncio as aioredis

from fleet.errors import ConfigError, InvalidInput
from fleet.keys import Keys
from fleet.model_control import BOOT_GEN, ControlMode, Target, decode_records, desired_targets, fingerprint
from fleet.paths import contained
from fleet.repository import Completer, ModelEntry, Repository, load_model, scan
from fleet.settings import Settings

log = logging.getLogger("workers")


def repo_dirs(repo: Repository | None) -> list[tuple[str, Path]]:
    return sorted(repo.dirs.items()) if repo is not None else []


class Targets:
    def __init__(self, settings: Settings, mode: ControlMode, keys: Keys, worker_id: str, client: aioredis.Redis,
                 completer: Completer | None = None) -> None:
        self.settings = settings
        self.mode = mode
        self.keys = keys
        self.worker_id = worker_id
        self.client = client  # the worker's control connection
        self.completer = completer
        self._entries: dict[tuple[str, str], ModelEntry | str] = {}  # (model, gen) -> entry or why not
        self._boot: Repository | None = None  # none mode: the repository as found at start
        self._boot_gens: dict[str, str] = {}

    def scan(self) -> Repository:
        return scan(list(self.settings.model_repositories), auto_complete=self.settings.auto_complete_config)

    async def read(self) -> tuple[dict[str, Target], dict[str, tuple[str, str]]]:
        """The targets, and (generation, why) for the models this worker cannot serve whatever it does:
        a name two repositories hold, a control record naming a model its repositories lack."""
        missing: dict[str, tuple[str, str]] = {}
        if self.mode is ControlMode.NONE:
            if self._boot is None:
                self._boot = await asyncio.to_thread(self.scan)
                self._boot_gens = await asyncio.to_thread(lambda: {n: fingerprint(p) for n, p in repo_dirs(self._boot)})
            repo = self._boot
            targets = desired_targets(self.mode, repo.dirs, {}, self._boot_gens)
        elif self.mode is ControlMode.POLL:
            repo = await asyncio.to_thread(self.scan)
            gens = await asyncio.to_thread(lambda: {n: fingerprint(p) for n, p in repo.dirs.items()})
            targets = desired_targets(self.mode, repo.dirs, {}, gens)
        else:
            repo = await asyncio.to_thread(self.scan)
            records = decode_records(await self.client.hgetall(self.keys.models()))
            targets = desired_targets(self.mode, repo.dirs, records)
            missing = {n: (r.gen, f"failed to load '{n}': not found in the model repositories of worker "
                                  f"{self.worker_id}")
                       for n, r in records.items() if r.load and n not in targets}
        problems = {n: (BOOT_GEN, why) for n, why in repo.errors.items() if n not in repo.dirs}
        return targets, problems | missing

    def keep_only(self, targets: dict[str, Target]) -> None:
        """Forget the entries of generations no longer targeted."""
        self._entries = {k: v for k, v in self._entries.items() if k[0] in targets and targets[k[0]].gen == k[1]}

    async def entry(self, target: Target) -> ModelEntry | str:
        """The target's entry, built once per generation; a string says why it cannot be built."""
        key = (target.name, target.gen)
        if key not in self._entries:
            try:
                model_dir = await self._write_files(target) if target.files else target.model_dir
                assert model_dir is not None
                self._entries[key] = await asyncio.to_thread(
                    load_model, model_dir, name=target.name, override_json=target.config_override,
                    complete=self.completer)
            except (ConfigError, InvalidInput) as exc:
                log.error("model '%s' cannot be loaded: %s", target.name, exc.message)
                self._entries[key] = f"failed to load '{target.name}': {exc.message}"
            except Exception as exc:  # a completer running user code can raise anything
                log.exception("model '%s' cannot be loaded", target.name)
                self._entries[key] = f"failed to load '{target.name}': {exc}"
        return self._entries[key]

    async def _write_files(self, target: Target) -> Path:
        """A load call's `file:` overrides, written to a directory of this load's own (paths confined)."""
        root = self.settings.model_load_dir.resolve()
        base = contained(root, f"{self.worker_id}/{target.name}/{target.gen}")
        if base.parent.parent.parent != root:  # a name with a separator in it: never a model name
            raise InvalidInput(f"model name '{target.name}' cannot name a directory")
        raw: dict[bytes, bytes] = await self.client.hgetall(  # type: ignore[assignment]
            self.keys.model_files(target.name, target.gen))

        def write() -> None:
            base.mkdir(parents=True, exist_ok=True)
            for rel, content in raw.items():
                path = contained(base, rel.decode())
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)

        if len(raw) != len(target.files):
            raise InvalidInput(f"the files of load generation {target.gen} are gone ({len(raw)} of "
                               f"{len(target.files)} found)")
        await asyncio.to_thread(write)
        return base
