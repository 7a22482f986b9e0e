"""How a log record becomes a line: text for a terminal, or one JSON object per line for a log
collector (FLEET_LOG_FORMAT=json, what containers run with).

Both add what the line is about (fleet/log_context.py: model, version, request id or a batch's ids),
taken from what the call site passed with `extra=` or else from the context bound where it logged.

A JSON line: {"ts": "2026-01-02T03:04:05.678Z", "level": "INFO", "logger": "workers", "role": "worker",
"pid": 12, "msg": "...", "model": "m", "version": 1, "request_id": "..." | "request_ids": [...],
"exc": "Traceback ..."}; the context and exception fields only where there are any.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime

from fleet.log_context import FIELDS, current_fields

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")

Context = Callable[[], dict[str, object]]


def iso8601(created: float) -> str:
    """A record's time as Triton's ISO8601 logs write it: UTC, milliseconds, `Z`."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def line_context(record: logging.LogRecord, context: Context) -> dict[str, object]:
    """The line's context fields: the call site's `extra=` ones, else the bound context's."""
    explicit = {name: record.__dict__[name] for name in FIELDS if record.__dict__.get(name) is not None}
    if explicit:
        return explicit
    return context()


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a message's or traceback's newlines are escaped)."""

    def __init__(self, role: str, context: Context = current_fields) -> None:
        super().__init__()
        self.role = role
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": iso8601(record.created), "level": record.levelname, "logger": record.name,
            "role": self.role, "pid": record.process, "msg": record.getMessage(),
        }
        doc.update(line_context(record, self.context))
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, the context after the message as ` [model=m version=1 request_id=...]`; timestamps
    as logging's default or, with `iso8601`, as Triton's ISO8601 log format."""

    def __init__(self, iso8601: bool = False, context: Context = current_fields) -> None:
        super().__init__(TEXT_FORMAT)
        self.iso8601 = iso8601
        self.context = context

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        return iso8601(record.created) if self.iso8601 else super().formatTime(record, datefmt)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        fields = line_context(record, self.context)
        if not fields:
            return line
        shown = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in fields.items())
        return f"{line} [{shown}]"


def make_formatter(log_format: str, role: str, iso8601: bool = False) -> logging.Formatter:
    """The formatter of a process logging in `log_format` ("text" or "json") as `role`."""
    return JsonFormatter(role) if log_format == "json" else TextFormatter(iso8601)


def as_json_line(line: str, role: str, pid: int, created: float) -> str:
    """A line a child process wrote, for `fleet up`'s JSON output: a JSON object as it is, anything else
    (a crash's traceback, a model's print) wrapped in one, so that every line of the output parses."""
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line
        except ValueError:
            pass
    return json.dumps({"ts": iso8601(created), "level": "INFO", "logger": "output", "role": role, "pid": pid,
                       "msg": line}, ensure_ascii=False)
