"""configure_logging(settings): once per entrypoint; text to stderr (fleet up prefixes the process name).
apply_log_settings(...): the logging extension's settings (fleet/log_settings.py), at any time after."""

from __future__ import annotations

import logging
import logging.config
from datetime import UTC, datetime

from fleet.log_settings import LogSettings
from fleet.settings import Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger(__name__)


class _Gate(logging.Filter):
    """Drops the records of the levels switched off (log_info, log_warning, log_error), as Triton's
    LOG_ENABLE_* do. Verbose (DEBUG) records are not even made unless a verbose level is set: the root
    logger's level says so, which keeps a disabled debug line as cheap as before."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = LogSettings()

    def filter(self, record: logging.LogRecord) -> bool:
        s = self.settings
        if record.levelno >= logging.ERROR:
            return s.log_error
        if record.levelno >= logging.WARNING:
            return s.log_warning
        if record.levelno >= logging.INFO:
            return s.log_info
        return s.log_verbose_level > 0


class _Iso8601(logging.Formatter):
    """Triton's ISO8601 log format: UTC, `2024-05-03T17:06:05.123Z`."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        stamp = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        return stamp.replace("+00:00", "Z")


# One per process, like the logging module's own state it filters for.
_GATE = _Gate()


def configure_logging(settings: Settings) -> None:
    level = "DEBUG" if settings.log_verbose > 0 else "INFO"
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"text": {"format": TEXT_FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "text"}},
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {"asyncio": {"level": "WARNING"}},
    })
    _GATE.settings = LogSettings(log_verbose_level=settings.log_verbose)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_GATE)


def default_log_settings(settings: Settings) -> LogSettings:
    """What a process logs with until the logging extension changes it."""
    return LogSettings(log_verbose_level=settings.log_verbose)


def current_log_settings() -> LogSettings:
    return _GATE.settings


def apply_log_settings(new: LogSettings) -> None:
    """Apply the logging extension's settings to this process's logging (the root handlers)."""
    old = _GATE.settings
    if new == old:
        return  # the common case: a notification of a change this process has applied already
    _GATE.settings = new
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if new.log_verbose_level > 0 else logging.INFO)
    if new.log_format != old.log_format:
        formatter = _Iso8601(TEXT_FORMAT) if new.log_format == "ISO8601" else logging.Formatter(TEXT_FORMAT)
        for handler in root.handlers:
            handler.setFormatter(formatter)
    # Verbose only: shows that a change reached this process, without adding an INFO line per change.
    log.debug("log settings applied: %s", " ".join(f"{k}={v}" for k, v in new.response().items()))
