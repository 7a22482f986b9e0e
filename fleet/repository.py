"""Model repositories: which models exist, with which config and which versions (protocol.md §3.1).

Contract:
* `scan(repositories)` looks at every non-hidden directory directly under each repository that
  holds a `config.pbtxt` (others are skipped: fleet does not auto-complete configs). Each becomes a
  `ModelEntry` in `Repository.models`, or, when it cannot be served, a message in
  `Repository.errors` under its name: bad config, no version directory the version policy selects,
  or the same model name in more than one repository (then neither copy is served).
* A repository path that is not a directory raises `ConfigError` (Triton refuses to start).
* Version directories are positive integers without leading zeros; other names are ignored.
* Nothing is imported or executed here; model files are not checked for existence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from fleet.errors import ConfigError
from fleet.model_config import CONFIG_FILENAME, ModelSpec, load_config

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


def version_dirs(model_dir: Path) -> tuple[int, ...]:
    """The version directories present in `model_dir`, ascending."""
    found = []
    for child in model_dir.iterdir():
        if _VERSION_DIR.fullmatch(child.name) and child.is_dir():
            version = int(child.name)
            if version <= _MAX_VERSION:
                found.append(version)
    return tuple(sorted(found))


def load_model(model_dir: Path) -> ModelEntry:
    """Parse one model directory into a `ModelEntry`; raises `ConfigError` when it cannot be
    served (bad config, or no version directory that the version policy selects)."""
    spec = load_config(model_dir)
    try:
        available = version_dirs(model_dir)
    except OSError as exc:
        raise ConfigError(f"{model_dir}: cannot list version directories: {exc}") from None
    versions = spec.version_policy.select(available)
    if not versions:
        raise ConfigError(
            f"{model_dir}: at least one version must be available under the version policy of "
            f"model '{spec.name}' (version directories present: {list(available) or 'none'})"
        )
    return ModelEntry(name=spec.name, path=model_dir, spec=spec, versions=versions)


def scan(repositories: Sequence[Path]) -> Repository:
    """Scan the repositories (see the module contract); models and errors are sorted by name."""
    candidates: dict[str, list[Path]] = {}
    for repo in repositories:
        if not repo.is_dir():
            raise ConfigError(f"{repo}: model repository is not a directory")
        for child in sorted(repo.iterdir()):
            if child.name.startswith(".") or not child.is_dir():
                continue
            if (child / CONFIG_FILENAME).is_file():
                candidates.setdefault(child.name, []).append(child)
    models: dict[str, ModelEntry] = {}
    errors: dict[str, str] = {}
    for name in sorted(candidates):
        paths = candidates[name]
        if len(paths) > 1:
            where = ", ".join(str(p) for p in paths)
            errors[name] = f"model '{name}' appears in multiple repositories: {where}"
            continue
        try:
            models[name] = load_model(paths[0])
        except ConfigError as exc:
            errors[name] = exc.message
    return Repository(models=MappingProxyType(models), errors=MappingProxyType(errors))
