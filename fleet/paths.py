"""Containment of caller-named paths: a path a request names must resolve (symlinks followed) inside a
directory the server chose. Pure functions over paths; they read the file system only to follow links.

Bulk jobs use `inside_any` for server-side input paths (gateway/jobs/service.py). Model load with file
overrides (POST /v2/repository/models/NAME/load, 501 today) is to write its files through `contained`,
under one configured directory, so an override named `../../etc/x` or a symlink cannot escape it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from fleet.errors import InvalidInput


def _resolve(path: Path) -> Path:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte, an unknown ~user
        raise InvalidInput(f"invalid path {str(path)!r}: {exc}") from exc


def contained(base: Path, candidate: Path | str) -> Path:
    """`candidate`, relative to `base` (an absolute one stands alone), resolved; InvalidInput unless the
    result is `base` itself or below it once both are resolved (so `..` and escaping symlinks fail)."""
    root = _resolve(Path(base))
    path = _resolve(root / candidate)
    if not path.is_relative_to(root):
        raise InvalidInput(f"path {str(candidate)!r} is outside the directory it must stay in")
    return path


def inside_any(bases: Iterable[Path], candidate: Path | str) -> Path:
    """`candidate` resolved (relative to the working directory); InvalidInput unless it lies inside one of
    `bases` (each resolved too). No bases: nothing is allowed."""
    path = _resolve(Path(candidate))
    for base in bases:
        if path.is_relative_to(_resolve(Path(base))):
            return path
    raise InvalidInput(f"path {str(candidate)!r} is outside the directories the server may read")
