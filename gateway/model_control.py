"""The repository extension's load and unload, and how a gateway follows model control (protocol-neutral:
gateway/routes.py and gateway/grpc/service.py call it). fleet/model_control.py says what the modes mean.

* `refresh()` (every readiness poll): the targets (explicit mode: the control records in Redis; poll
  mode: a rescan every `repository_poll_secs`), and the configs workers published for the
  generations the catalog would use.
* `load(name, parameters)`: explicit mode only. The overrides are checked here (a malformed `config`
  fails at once with "failed to load"), then a control record with a new generation is written (with
  the `file:` contents beside it), workers are nudged on `fleet:control`, and the call waits until a
  worker serves that generation, or every live worker has reconciled it and none serves or loads it
  (then it fails with a worker's reason), at most `model_load_timeout_s`. An ensemble's steps not loaded
  load with it, as in Triton; the ensemble is loaded once this gateway can plan it (workers load none).
* `unload(name)`: writes the record (with `unload_dependents`, an ensemble's steps' too) and returns; this
  gateway stops routing to the model at once, others within a heartbeat poll; workers drain what is
  queued before they stop reading.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import PurePosixPath
from typing import Any

import redis.asyncio as aioredis

from fleet.errors import ConfigError, ControlNotAllowed, InvalidInput, ModelNotReady, Unsupported
from fleet.keys import Keys
from fleet.model_config import parse_config_proto
from fleet.model_control import (
    BOOT_GEN,
    ControlMode,
    ControlRecord,
    Target,
    decode_records,
    desired_targets,
    fingerprint,
    startup_names,
)
from fleet.repository import Repository, composing_models, scan, with_composing
from fleet.settings import Settings
from gateway.catalog import STEP_NOT_READY, Catalog

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.1
RESCAN_UNKNOWN_S = 5.0
FILES_TTL_S = 7 * 24 * 3600  # a worker that starts later still finds the files of the records it follows


class ModelControl:
    def __init__(self, settings: Settings, client: aioredis.Redis, keys: Keys, catalog: Catalog,
                 read_heartbeats: Callable[[], Awaitable[None]]) -> None:
        self.settings = settings
        self.mode = ControlMode(settings.model_control_mode)
        self.client = client
        self.keys = keys
        self.catalog = catalog
        self._read_heartbeats = read_heartbeats
        self._records: dict[str, ControlRecord] = {}
        self._polled_at = float("-inf")
        self._lock = asyncio.Lock()  # one load or unload at a time per gateway, as Triton serialises them

    def scan(self) -> Repository:
        return scan(list(self.settings.model_repositories), auto_complete=self.settings.auto_complete_config)

    def targets(self, repository: Repository) -> dict[str, Target]:
        self.catalog.unloaded = frozenset(n for n, r in self._records.items() if not r.load)
        if self.mode in (ControlMode.NONE, ControlMode.POLL):
            gens = {name: fingerprint(path) for name, path in repository.dirs.items()}
            return desired_targets(self.mode, repository.dirs, {}, gens)
        return desired_targets(self.mode, repository.dirs, self._records)

    async def seed(self) -> None:
        """Explicit mode: `--load-model` names become control records unless one exists already."""
        if self.mode is ControlMode.EXPLICIT and self.settings.load_models:
            repository = self.catalog.repository
            for name in with_composing(repository, startup_names(self.settings.load_models, repository.dirs)):
                await self.client.hsetnx(self.keys.models(), name, ControlRecord(BOOT_GEN, True).encode())

    async def refresh(self) -> None:
        """Follow the desired state and fetch the configs the catalog lacks (see the module doc)."""
        if self.mode is ControlMode.EXPLICIT:
            self._records = decode_records(await self.client.hgetall(self.keys.models()))
            repository = self.catalog.repository
            unknown = [n for n, r in self._records.items() if r.load and not r.files and n not in repository.dirs]
            now = asyncio.get_running_loop().time()
            if unknown and now - self._polled_at >= RESCAN_UNKNOWN_S:
                # Another gateway loaded a model whose directory appeared after this one scanned.
                self._polled_at = now
                repository = await asyncio.to_thread(self.scan)
            self.catalog.set_targets(repository, self.targets(repository))
        elif self.mode is ControlMode.POLL:
            now = asyncio.get_running_loop().time()
            if now - self._polled_at >= self.settings.repository_poll_secs:
                self._polled_at = now
                repository = await asyncio.to_thread(self.scan)
                targets = await asyncio.to_thread(self.targets, repository)
                self.catalog.set_targets(repository, targets)
        await self.fetch_configs()

    async def rescan_for_index(self) -> None:
        """Explicit mode: the index lists what the repositories hold now, as Triton's does (poll mode
        rescans on its own period; none mode serves what it found at start)."""
        if self.mode is ControlMode.EXPLICIT:
            repository = await asyncio.to_thread(self.scan)
            self.catalog.set_targets(repository, self.targets(repository))

    async def fetch_configs(self) -> None:
        wanted = self.catalog.wanted_gens()
        if not wanted:
            return
        pipe = self.client.pipeline(transaction=False)
        for model, gen in wanted:
            pipe.hget(self.keys.model_configs(model), gen)
        found = await pipe.execute()
        self.catalog.add_configs({pair: text.decode() for pair, text in zip(wanted, found, strict=True)
                                  if isinstance(text, bytes)})

    # ------------------------------------------------------------------ the repository API

    def _require_explicit(self) -> None:
        if self.mode is not ControlMode.EXPLICIT:
            raise ControlNotAllowed("explicit model load / unload is not allowed if polling is enabled")

    async def load(self, name: str, parameters: Mapping[str, Any]) -> None:
        self._require_explicit()
        _check_name(name)
        config, files = _overrides(name, parameters)
        async with self._lock:
            repository = await asyncio.to_thread(self.scan)
            self.catalog.set_targets(repository, self.catalog.targets)
            if name not in repository.dirs and not files:
                why = repository.errors.get(name, "model not found in any model repository")
                raise InvalidInput(f"failed to load '{name}', failed to poll from model repository: {why}")
            if (config or files) and name in repository.models and repository.models[name].spec.ensemble:
                # Gateways plan an ensemble from the configs workers publish, and no worker loads one.
                raise Unsupported(f"failed to load '{name}': overriding an ensemble's config is not supported")
            # An ensemble's steps that are not loaded load with it, as in Triton (nested ensembles' too).
            composing = composing_models(repository, name)
            missing = [m for m in composing if m not in repository.dirs]
            if missing:
                raise InvalidInput(f"failed to load '{name}': its step model '{missing[0]}' is not in any model "
                                   f"repository")
            self._records = decode_records(await self.client.hgetall(self.keys.models()))
            loaded = {m for m, r in self._records.items() if r.load}
            steps = [m for m in composing if m not in loaded]
            gens = {m: f"e{await self.client.incr(self.keys.models_gen())}" for m in [*steps, name]}
            gen = gens[name]
            records = {m: ControlRecord(g, True, config, tuple(sorted(files))) if m == name else ControlRecord(g, True)
                       for m, g in gens.items()}
            pipe = self.client.pipeline(transaction=True)
            if files:
                pipe.hset(self.keys.model_files(name, gen), mapping=files)  # type: ignore[arg-type]
                pipe.expire(self.keys.model_files(name, gen), FILES_TTL_S)
            for model, record in records.items():
                pipe.hset(self.keys.models(), model, record.encode())
                pipe.publish(self.keys.control(), model)
            await pipe.execute()
            self._records.update(records)
            self.catalog.set_targets(repository, self.targets(repository))
            log.info("load of model%s requested (generation %s)", f"s {', '.join(map(repr, gens))}" if steps else
                     f" '{name}'", gen)
            for model, model_gen in gens.items():
                if model in repository.models and repository.models[model].spec.ensemble:
                    await self._wait_planned(model)  # gateways run ensembles: no worker serves one
                else:
                    await self._wait_loaded(model, model_gen)

    async def unload(self, name: str, parameters: Mapping[str, Any]) -> None:
        self._require_explicit()
        _check_name(name)
        dependents = parameters.get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidInput("'unload_dependents' must be a boolean")
        async with self._lock:
            # unload_dependents: an ensemble's steps go with it, as in Triton, but for those another loaded
            # ensemble still runs.
            repository = self.catalog.repository
            names = [name]
            if dependents:
                self._records = decode_records(await self.client.hgetall(self.keys.models()))
                needed = {m for other, r in self._records.items() if r.load and other != name
                          for m in composing_models(repository, other)}
                names += [m for m in composing_models(repository, name) if m not in needed]
            records = {m: ControlRecord(f"e{await self.client.incr(self.keys.models_gen())}", False) for m in names}
            pipe = self.client.pipeline(transaction=True)
            for model, record in records.items():
                pipe.hset(self.keys.models(), model, record.encode())
                pipe.publish(self.keys.control(), model)
            await pipe.execute()
            self._records.update(records)
            self.catalog.set_targets(self.catalog.repository, self.targets(self.catalog.repository))
            log.info("unload of %s requested", ", ".join(f"'{m}'" for m in names))

    async def _wait_planned(self, name: str) -> None:
        """Until this gateway runs the ensemble `name` (every step's model has a ready version), or why not."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.settings.model_load_timeout_s
        while True:
            await self._read_heartbeats()
            if name in self.catalog.ensemble_plans:
                return
            problem = self.catalog.ensemble_problems.get(name)
            if problem is not None and not problem.endswith(STEP_NOT_READY):
                raise InvalidInput(f"failed to load '{name}': {problem}")
            if loop.time() >= give_up:
                raise ModelNotReady(f"failed to load '{name}': {problem or 'its steps did not become ready'} within "
                                    f"{self.settings.model_load_timeout_s:g} s")
            await asyncio.sleep(LOAD_POLL_S)

    async def _wait_loaded(self, name: str, gen: str) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.settings.model_load_timeout_s
        while True:
            await self._read_heartbeats()
            current = ControlRecord.decode(await self.client.hget(self.keys.models(), name) or b"null")
            if current is not None and current.gen != gen:
                # Another load or unload of this model came after this one (another gateway's).
                if not current.load:
                    raise ModelNotReady(f"failed to load '{name}': it was unloaded while loading")
                gen = current.gen
            catalog = self.catalog
            serving = [u for u in catalog.units if u.model == name and u.gen == gen]
            if any(u.state == "READY" for u in serving):
                await self.fetch_configs()
                return
            reconciled = [s.get(name) == gen for s in catalog.seen]
            if catalog.seen and all(reconciled) and not serving:
                reason = catalog.failures.get(name) if catalog.failure_gens.get(name) == gen else None
                raise InvalidInput(reason if reason and reason.startswith("failed to load") else
                                   f"failed to load '{name}': {reason or 'no worker can serve it'}")
            if loop.time() >= give_up:
                raise ModelNotReady(f"failed to load '{name}': no worker served it within "
                                    f"{self.settings.model_load_timeout_s:g} s ({catalog.workers} live workers)")
            await asyncio.sleep(LOAD_POLL_S)


def _check_name(name: str) -> None:
    """A model name is a directory name in a repository (and in a worker's load directory)."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > 255:
        raise InvalidInput(f"failed to load '{name[:64]}': not a valid model name")


def _overrides(name: str, parameters: Mapping[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    """A load call's `config` (checked now, so a malformed one fails at once) and `file:` contents."""
    config = parameters.get("config")
    if config is not None:
        if not isinstance(config, str):
            raise InvalidInput(f"failed to load '{name}': the 'config' parameter must be a JSON string")
        try:
            parse_config_proto(None, source="config override", model_name=name, override_json=config)
        except ConfigError as exc:
            raise InvalidInput(exc.message if "failed to load" in exc.message
                               else f"failed to load '{name}': {exc.message}") from None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if not key.startswith("file:"):
            continue
        rel = key.removeprefix("file:")
        path = PurePosixPath(rel)
        if not rel or path.is_absolute() or ".." in path.parts or rel.startswith("\\"):
            raise InvalidInput(f"failed to load '{name}': file override path '{rel}' must be relative "
                               "to the model directory")
        if isinstance(value, bytes):
            files[str(path)] = value
        elif isinstance(value, str):
            try:
                files[str(path)] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidInput(f"failed to load '{name}': file override '{rel}' is not base64") from None
        else:
            raise InvalidInput(f"failed to load '{name}': file override '{rel}' must be base64 text")
    if files and config is None:
        raise InvalidInput(f"failed to load '{name}': a file override needs a 'config' override as well")
    return config, files
