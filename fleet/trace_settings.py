"""Triton's trace extension settings (`/v2[/models/NAME]/trace/setting`, gRPC TraceSetting),
protocol-neutral: validation of an update, Triton's global/per-model semantics, and their one copy in
Redis that every gateway process follows.

Semantics (Triton's server/src/tracer.cc): the global setting has each field either specified or at its
default (level OFF, rate 1000, count -1, log_frequency 0); a model's setting specifies some fields and
takes the others from the global one, following its later changes. A null value clears a field: back to
the default (global), or to the global value (model); a model whose fields are all cleared follows the
global setting again. Each update of a scope starts its sampling afresh (Triton replaces the setting
object: its count of remaining traces restarts).

Storage: one hash (`Keys.trace_settings`) with a field per scope and setting, `global.rate`,
`model:<name>.level`, ... (JSON values), written field by field in one transaction (concurrent updates
of different fields never overwrite each other), plus a `<scope>._v` counter bumped by each update of the
scope so every process sees that it was updated even when the values did not change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.errors import InvalidInput, Unsupported
from fleet.keys import Keys

LEVELS = ("TIMESTAMPS", "TENSORS")  # in the order responses list them
FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency"}
SETTINGS = (*FIELDS, "trace_file", "trace_mode")
GLOBAL = "global"
MODE = "triton"  # Triton's own JSON trace file; OpenTelemetry is not offered (README says why)
CHANNEL_MESSAGE = "trace"  # what Keys.settings_changed carries when the hash changed
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
_INTEGER = re.compile(r"-?[0-9]+")


def model_scope(model: str) -> str:
    return f"model:{model}"


@dataclass(frozen=True, slots=True)
class TraceSetting:
    """One scope's setting in force. `level` () is OFF; `count` -1 is unlimited."""

    level: tuple[str, ...] = ()
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0

    def invalid_reason(self) -> str | None:
        """Why this setting can trace nothing although a level is set (Triton refuses to set it)."""
        if self.level and self.rate == 0:
            return "sample rate must be non-zero"
        return None

    def response(self, remaining_count: int, trace_file: str) -> dict[str, Any]:
        """Triton's answer: every value a string, the level a list (["OFF"] when off)."""
        return {"trace_level": list(self.level) or ["OFF"], "trace_rate": str(self.rate),
                "trace_count": str(remaining_count), "log_frequency": str(self.log_frequency),
                "trace_file": trace_file, "trace_mode": MODE}


DEFAULT = TraceSetting()


@dataclass(frozen=True, slots=True)
class TraceUpdate:
    """A validated update of one scope: fields to set (by TraceSetting name) and fields to clear."""

    sets: dict[str, Any] = field(default_factory=dict)
    clears: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class TraceState:
    """What the hash holds: each scope's specified fields, and its update counter."""

    specs: dict[str, dict[str, Any]] = field(default_factory=dict)  # scope -> specified fields
    versions: dict[str, int] = field(default_factory=dict)  # scope -> updates so far

    def effective(self, model: str | None) -> TraceSetting:
        """The setting in force for `model` (None: the global one)."""
        setting = replace(DEFAULT, **self.specs.get(GLOBAL, {}))
        if model is not None:
            setting = replace(setting, **self.specs.get(model_scope(model), {}))
        return setting

    def has_model(self, model: str) -> bool:
        return bool(self.specs.get(model_scope(model)))

    def models(self) -> list[str]:
        return sorted(s.removeprefix("model:") for s, spec in self.specs.items() if s != GLOBAL and spec)

    def version(self, model: str | None) -> tuple[int, int]:
        """Changes whenever the setting of `model` was updated, or the global one while the model's
        follows it in some field (as Triton renews only the model settings that fall back on it)."""
        if model is None:
            return (self.versions.get(GLOBAL, 0), 0)
        follows_global = len(self.specs.get(model_scope(model), {})) < len(FIELDS)
        return (self.versions.get(GLOBAL, 0) if follows_global else 0, self.versions.get(model_scope(model), 0))

    def updated(self, scope: str, update: TraceUpdate) -> TraceState:
        spec = {k: v for k, v in self.specs.get(scope, {}).items() if k not in update.clears} | update.sets
        return TraceState({**self.specs, scope: spec}, {**self.versions, scope: self.versions.get(scope, 0) + 1})


def _integer(name: str, value: Any, low: int, high: int) -> int:
    """Triton takes these as strings ("100"); a JSON integer is taken too."""
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        number = int(value)
    elif type(value) is int:
        number = value
    elif isinstance(value, str):
        raise InvalidInput(f"Unable to parse '{name}', got: {value}")
    else:
        raise InvalidInput(f"attempt to access JSON non-string as string: '{name}' must be a string of digits, "
                           f"e.g. \"100\", got {json.dumps(value)}")
    if name == "trace_count" and number < low:
        raise InvalidInput(f"Unable to parse 'trace_count'. Expecting value >= {low}, got:{value}")
    if not low <= number <= high:
        raise InvalidInput(f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {value}")
    return number


def _levels(value: Any) -> tuple[str, ...] | None:
    """The levels a `trace_level` array sets (() = OFF); None for an empty array (no change, as Triton)."""
    if not isinstance(value, list):
        raise InvalidInput("attempt to access JSON non-array as array: 'trace_level' must be an array, "
                           "e.g. [\"TIMESTAMPS\"]")
    if not value:
        return None
    for level in value:
        if not isinstance(level, str):
            raise InvalidInput("attempt to access JSON non-string as string: each 'trace_level' must be "
                               "\"OFF\", \"TIMESTAMPS\" or \"TENSORS\"")
        if level not in ("OFF", *LEVELS):
            raise InvalidInput(f"unknown trace level '{level}': the levels are OFF, TIMESTAMPS and TENSORS")
    if "OFF" in value:
        if len(value) != 1:
            raise InvalidInput("Expect only one trace level 'OFF' is specified")
        return ()
    return tuple(level for level in LEVELS if level in value)


def parse_trace_update(doc: Any, trace_file: str) -> TraceUpdate:
    """The update a request body asks for (a JSON object; for gRPC see update_from_grpc), validated.
    `trace_file` is where this gateway writes: naming it (or null) is accepted, naming another file is
    Unsupported (as in Triton: a client must not choose where the server writes); so is a `trace_mode`
    other than "triton". Raises InvalidInput naming the setting at fault, with Triton's texts."""
    if not isinstance(doc, dict):
        raise InvalidInput("the trace settings request must be a JSON object, e.g. {\"trace_rate\": \"100\"}")
    sets: dict[str, Any] = {}
    clears: set[str] = set()
    for name, value in doc.items():
        if name not in SETTINGS:
            raise InvalidInput(f"unknown trace setting '{name}': the settings are {', '.join(SETTINGS)}")
        if name == "trace_file":
            if value is not None and value != trace_file:
                raise Unsupported("trace file location can not be updated through network protocol: this "
                                  f"gateway writes its traces to {trace_file} (FLEET_TRACE_FILE)")
            continue
        if name == "trace_mode":
            if value is not None and value != MODE:
                raise Unsupported(f"trace mode {json.dumps(value)} is not supported: fleet writes Triton's JSON "
                                  "trace file (trace_mode \"triton\") only")
            continue
        key = FIELDS[name]
        if value is None:
            clears.add(key)
            continue
        if key == "level":
            levels = _levels(value)
            if levels is not None:
                sets[key] = levels
        elif key == "count":
            sets[key] = _integer(name, value, -1, INT32_MAX)
        else:
            sets[key] = _integer(name, value, 0, UINT32_MAX)
    return TraceUpdate(sets, frozenset(clears - sets.keys()))


def check_update(state: TraceState, model: str | None, update: TraceUpdate) -> None:
    """Refuse an update after which its scope could trace nothing although a level is set (Triton's
    "invalid trace setting"); turning tracing off is always allowed."""
    scope = GLOBAL if model is None else model_scope(model)
    reason = state.updated(scope, update).effective(model).invalid_reason()
    if reason is not None:
        raise InvalidInput(f"Attempting to set invalid trace setting :{reason}")


def update_from_grpc(settings: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """A gRPC TraceSettingRequest's `settings` (each value a list of strings) as the JSON body HTTP takes:
    no value clears the setting (as Triton's gRPC server reads it), `trace_level` stays a list, the
    others take their one value."""
    return {name: None if not values else list(values) if name == "trace_level" else values[0]
            for name, values in settings.items()}


def response_to_grpc(doc: Mapping[str, Any]) -> dict[str, list[str]]:
    """A settings answer as a gRPC TraceSettingResponse's `settings`: every value a list of strings."""
    return {name: list(value) if isinstance(value, list) else [str(value)] for name, value in doc.items()}


def decode_state(raw: Mapping[bytes, bytes]) -> TraceState:
    """The hash as HGETALL returns it; fields that cannot be read are skipped (a newer process may write
    fields this one does not know)."""
    specs: dict[str, dict[str, Any]] = {}
    versions: dict[str, int] = {}
    for key, value in raw.items():
        scope, _, name = key.decode().rpartition(".")
        try:
            decoded = json.loads(value)
            if name == "_v":
                versions[scope] = int(decoded)
            elif name == "level":
                specs.setdefault(scope, {})[name] = tuple(lv for lv in LEVELS if lv in decoded)
            elif name in ("rate", "count", "log_frequency") and type(decoded) is int:
                specs.setdefault(scope, {})[name] = decoded
        except (ValueError, TypeError):
            continue
    return TraceState(specs, versions)


async def read_trace_state(client: Any, keys: Keys) -> TraceState:
    raw: dict[bytes, bytes] = await client.hgetall(keys.trace_settings())
    return decode_state(raw)


async def store_trace_update(client: Any, keys: Keys, model: str | None, update: TraceUpdate) -> None:
    """Apply `update` to the scope in Redis and announce it, atomically (MULTI); Redis errors propagate."""
    scope = GLOBAL if model is None else model_scope(model)
    pipe = client.pipeline(transaction=True)
    if update.sets:
        pipe.hset(keys.trace_settings(), mapping={f"{scope}.{k}": json.dumps(v) for k, v in update.sets.items()})
    if update.clears:
        pipe.hdel(keys.trace_settings(), *(f"{scope}.{k}" for k in update.clears))
    pipe.hincrby(keys.trace_settings(), f"{scope}._v", 1)
    pipe.publish(keys.settings_changed(), CHANNEL_MESSAGE)
    await pipe.execute()
