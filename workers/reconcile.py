"""The reconcile step of model control, pure: what a worker serves (actual) and what it should serve
(desired) in, the loads and unloads to make out. workers/control.py runs it after every change.

A unit is one model version at one generation (a load call, or a change to the model's directory in
poll mode, makes a new generation). Rules:
* Every desired unit that is neither served nor failed here is loaded.
* A ready unit that is no longer desired is unloaded only once its replacement serves: the same
  version at the desired generation when that version is still desired, else any desired version of
  the model. While the replacement loads, the old unit keeps serving; if every replacement failed to
  load, the old unit stays (a broken new version or config never takes a working model down).
* A model with no desired version at all (unloaded, or removed from the repository in poll mode) has
  its units unloaded at once.
* Loading and unloading units are left alone: a load finishes before it can be undone, and an
  unload, once started, drains to the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True, order=True)
class Unit:
    model: str
    version: int
    gen: str


class UnitState(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"


@dataclass(frozen=True, slots=True)
class Load:
    unit: Unit


@dataclass(frozen=True, slots=True)
class Unload:
    unit: Unit


Action = Load | Unload


def reconcile(desired: Mapping[tuple[str, int], str], actual: Mapping[Unit, UnitState],
              failed: Set[Unit]) -> list[Action]:
    """`desired`: (model, version) -> generation; `actual`: the units this worker holds; `failed`: units
    whose load failed here (not retried until their generation changes). Loads first, in unit order."""
    actions: list[Action] = []
    for (model, version), gen in sorted(desired.items()):
        unit = Unit(model, version, gen)
        if unit not in actual and unit not in failed:
            actions.append(Load(unit))
    wanted_by_model: dict[str, list[Unit]] = {}
    for (model, version), gen in desired.items():
        wanted_by_model.setdefault(model, []).append(Unit(model, version, gen))
    for unit, state in sorted(actual.items()):
        if state is not UnitState.READY:
            continue
        if desired.get((unit.model, unit.version)) == unit.gen:
            continue
        wanted = wanted_by_model.get(unit.model, [])
        same_version = [w for w in wanted if w.version == unit.version]
        replacements = same_version or wanted
        if not replacements or any(actual.get(r) is UnitState.READY for r in replacements):
            actions.append(Unload(unit))
    return actions

