"""Triton's logging extension (`/v2/logging`, gRPC LogSettings), protocol-neutral: the settings, the
validation of an update, and their one copy in Redis that every process follows.

A change is written to one hash (`Keys.log_settings`, one field per setting, so two updates of different
settings never overwrite each other) and announced on `Keys.settings_changed`; every gateway and worker
re-reads the hash and applies it to its own logging (fleet/logs.py), and a process started later reads
it at start (fleet/settings_watch.py). Fields never set fall back to the process's own defaults
(`--log-verbose`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from fleet.errors import InvalidInput, Unsupported
from fleet.keys import Keys

FORMATS = ("default", "ISO8601")
BOOLS = ("log_info", "log_warning", "log_error")
SETTINGS = ("log_file", *BOOLS, "log_verbose_level", "log_format")
VERBOSE_MAX = 2**31 - 1  # Triton keeps the level in an int32
CHANNEL_MESSAGE = "logging"  # what Keys.settings_changed carries when this hash changed


@dataclass(frozen=True, slots=True)
class LogSettings:
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    def response(self) -> dict[str, Any]:
        """What GET and POST /v2/logging answer (Triton's field names and types). `log_file` is always
        "": fleet's processes log to stderr, which their supervisor collects."""
        return {"log_file": "", "log_info": self.log_info, "log_warning": self.log_warning,
                "log_error": self.log_error, "log_verbose_level": self.log_verbose_level,
                "log_format": self.log_format}

    def merged(self, stored: dict[str, Any]) -> LogSettings:
        """These settings with the fields `stored` holds (as parse_log_update returns them)."""
        return replace(self, **{k: v for k, v in stored.items() if k in _FIELDS})


_FIELDS = frozenset(("log_info", "log_warning", "log_error", "log_verbose_level", "log_format"))


def parse_log_update(doc: Any) -> dict[str, Any]:
    """The settings a request body (a JSON object, or the dict a gRPC LogSettingsRequest converts to)
    changes, validated. A null value changes nothing, as in Triton. Raises InvalidInput naming the
    setting at fault (Triton's texts, completed), Unsupported for a log file other than ""."""
    if not isinstance(doc, dict):
        raise InvalidInput("the log settings request must be a JSON object, e.g. {\"log_verbose_level\": 1}")
    update: dict[str, Any] = {}
    for name, value in doc.items():
        if name not in SETTINGS:
            raise InvalidInput(f"unknown log setting '{name}': the settings are {', '.join(SETTINGS)}")
        if value is None:
            continue
        if name == "log_file":
            if value != "":
                raise Unsupported("log file location can not be updated through network protocol: fleet's "
                                  "processes log to stderr, which their supervisor (fleet up, compose) keeps")
        elif name in BOOLS:
            if not isinstance(value, bool):
                raise InvalidInput(f"attempt to access JSON non-boolean as boolean: '{name}' must be true or "
                                   f"false, got {json.dumps(value)}")
            update[name] = value
        elif name == "log_verbose_level":
            if type(value) is not int or not 0 <= value <= VERBOSE_MAX:
                raise InvalidInput("attempt to access JSON non-unsigned-integer as unsigned-integer: "
                                   f"'log_verbose_level' must be an integer from 0 to {VERBOSE_MAX}, "
                                   f"got {json.dumps(value)}")
            update[name] = value
        else:
            if value not in FORMATS:
                raise InvalidInput(f"invalid argument for --log_format, got: {value}: 'log_format' must be "
                                   "\"default\" or \"ISO8601\"")
            update[name] = value
    return update


def decode_stored(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """The hash as HGETALL returns it; fields this version does not know, or cannot read, are skipped
    (a newer process may have written them)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.decode()
        try:
            parsed = parse_log_update({name: json.loads(value)})
        except (ValueError, InvalidInput, Unsupported):
            continue
        out.update(parsed)
    return out


async def store_log_update(client: Any, keys: Keys, update: dict[str, Any]) -> None:
    """Write the update and announce it, in one round trip; Redis errors propagate."""
    pipe = client.pipeline(transaction=False)
    if update:
        pipe.hset(keys.log_settings(), mapping={k: json.dumps(v) for k, v in update.items()})
    pipe.publish(keys.settings_changed(), CHANNEL_MESSAGE)
    await pipe.execute()


async def read_log_settings(client: Any, keys: Keys, defaults: LogSettings) -> LogSettings:
    """The settings in force: `defaults` with whatever the hash holds."""
    raw: dict[bytes, bytes] = await client.hgetall(keys.log_settings())
    return defaults.merged(decode_stored(raw))
