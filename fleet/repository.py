"""Model repositories: which models exist, with which config and which versions (protocol.md §3.1).

Contract:
* `scan(repositories)` looks at every non-hidden directory directly under each repository that
  holds a `config.pbtxt`, or (`auto_complete=True`) any non-hidden directory: a worker completes a
  missing config from the model file (workers/auto_complete.py). Each becomes a `ModelEntry` in
  `Repository.models`, or, when it cannot be served as it is, a message in `Repository.errors` under
  its name: bad or incomplete config, no version directory the version policy selects, or the same
  model name in more than one repository (then neither copy is served). `Repository.dirs` has every
  model directory by name, except names found twice (model control loads from there).
* A repository path that is not a directory raises `ConfigError` (Triton refuses to start).
* Version directories are positive integers without leading zeros; other names are ignored.
* Nothing is imported or executed here; model files are not checked for existence.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fleet.errors import ConfigError
from fleet.model_config import CONFIG_FILENAME, load_config, parse_config_proto, spec_from_proto
from fleet.model_spec import ModelSpec

_VERSION_DIR = re.compile(r"[1-9][0-9]{0,18}")
_MAX_VERSION = 2**63 - 1


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One servable model: its directory, parsed config and the versions its policy selects."""

    name: str
    path: Path  # the model directory
    spec: ModelSpec
    versions: tuple[int, ...]  # present version dirs selected by spec.version_policy, ascending

    def model_file(self, version: int) -> Path:
        """`<model dir>/<version>/<default_model_filename>` (a file, or a directory for some
        backends); not checked for existence."""
        return self.path / str(version) / self.spec.default_model_filename


@dataclass(frozen=True, slots=True)
class Repository:
    """The result of a scan: servable models and, by model name, why others are not."""

    models: Mapping[str, ModelEntry]
    errors: Mapping[str, str]
    dirs: Mapping[str, Path] = field(default_factory=dict)


# Completes a raw config from the model's files (workers/auto_complete.py): (config, model dir, versions).
Completer = Callable[[Any, Path, tuple[int, ...]], None]


def version_dirs(model_dir: Path) -> tuple[int, ...]:
    """The version directories present in `model_dir`, ascending."""
    found = []
    for child in model_dir.iterdir():
        if _VERSION_DIR.fullmatch(child.name) and child.is_dir():
            version = int(child.name)
            if version <= _MAX_VERSION:
                found.append(version)
    return tuple(sorted(found))


def load_model(model_dir: Path, *, name: str | None = None, override_json: str | None = None,
               complete: Completer | None = None) -> ModelEntry:
    """Parse one model directory into a `ModelEntry`; raises `ConfigError` when it cannot be
    served (bad config, or no version directory that the version policy selects). `override_json`
    replaces config.pbtxt (a load call's `config`); `complete` fills in what the model file says."""
    name = name or model_dir.name
    path = model_dir / CONFIG_FILENAME
    if override_json is None and complete is None:
        spec = load_config(model_dir)
    else:
        text: str | None = None
        if override_json is None:
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                text = None  # completed from the model file
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: cannot read model configuration: {exc}") from None
        cfg = parse_config_proto(text, source=str(path), model_name=name, override_json=override_json)
        if complete is not None:
            complete(cfg, model_dir, _versions_present(model_dir))
        spec = spec_from_proto(cfg, source=str(path), model_name=name)
    available = _versions_present(model_dir)
    versions = spec.version_policy.select(available)
    if not versions:
        raise ConfigError(
            f"{model_dir}: at least one version must be available under the version policy of "
            f"model '{spec.name}' (version directories present: {list(available) or 'none'})"
        )
    return ModelEntry(name=spec.name, path=model_dir, spec=spec, versions=versions)


def _versions_present(model_dir: Path) -> tuple[int, ...]:
    try:
        return version_dirs(model_dir)
    except OSError as exc:
        raise ConfigError(f"{model_dir}: cannot list version directories: {exc}") from None


def scan(repositories: Sequence[Path], *, auto_complete: bool = False) -> Repository:
    """Scan the repositories (see the module contract); models and errors are sorted by name."""
    candidates: dict[str, list[Path]] = {}
    for repo in repositories:
        if not repo.is_dir():
            raise ConfigError(f"{repo}: model repository is not a directory")
        for child in sorted(repo.iterdir()):
            if child.name.startswith(".") or not child.is_dir():
                continue
            if auto_complete or (child / CONFIG_FILENAME).is_file():
                candidates.setdefault(child.name, []).append(child)
    models: dict[str, ModelEntry] = {}
    errors: dict[str, str] = {}
    dirs: dict[str, Path] = {}
    for name in sorted(candidates):
        paths = candidates[name]
        if len(paths) > 1:
            where = ", ".join(str(p) for p in paths)
            errors[name] = f"model '{name}' appears in multiple repositories: {where}"
            continue
        dirs[name] = paths[0]
        if not (paths[0] / CONFIG_FILENAME).is_file():
            errors[name] = f"{paths[0]}: no {CONFIG_FILENAME}; a worker completes it from the model file"
            continue
        try:
            models[name] = load_model(paths[0])
        except ConfigError as exc:
            errors[name] = exc.message
    return Repository(models=MappingProxyType(models), errors=MappingProxyType(errors),
                      dirs=MappingProxyType(dirs))


def composing_models(repository: Repository, name: str) -> list[str]:
    """The models an ensemble's steps name, nested ensembles' included (steps first), without repeats; none
    for a model that is not an ensemble: what loads with it in explicit mode (and unloads with it, asked)."""
    found: list[str] = []

    def visit(model: str, depth: int) -> None:
        entry = repository.models.get(model)
        if entry is None or not entry.spec.ensemble or depth > 8:
            return
        for step in entry.spec.proto.ensemble_scheduling.step:
            visit(step.model_name, depth + 1)
            if step.model_name not in found and step.model_name != name:
                found.append(step.model_name)

    visit(name, 0)
    return found


def with_composing(repository: Repository, names: list[str]) -> list[str]:
    """`names` with each ensemble's composing models that the repositories hold before it (explicit mode's
    startup models)."""
    return list(dict.fromkeys(m for n in names for m in (*composing_models(repository, n), n)
                              if m == n or m in repository.dirs))
