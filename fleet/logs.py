"""configure_logging(settings, role): once per entrypoint; to stderr, as text (fleet up prefixes the
process name) or, with FLEET_LOG_FORMAT=json, one JSON object per line (fleet/log_format.py).
apply_log_settings(...): the logging extension's settings (fleet/log_settings.py), at any time after."""

from __future__ import annotations

import logging
import logging.config
import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING

from fleet.log_format import TextFormatter, make_formatter
from fleet.log_settings import LogSettings

if TYPE_CHECKING:  # a Python model's stub configures its logging here without importing pydantic
    from fleet.settings import Settings

log = logging.getLogger(__name__)


class _Gate(logging.Filter):
    """Drops the records of the levels switched off (log_info, log_warning, log_error), as Triton's
    LOG_ENABLE_* do. Verbose (DEBUG) records are not even made unless a verbose level is set: the root
    logger's level says so, which keeps a disabled debug line as cheap as before."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = LogSettings()
        self.log_format = "text"  # the process's, from its start (the extension's log_format is text's timestamps)

    def filter(self, record: logging.LogRecord) -> bool:
        s = self.settings
        if record.levelno >= logging.ERROR:
            return s.log_error
        if record.levelno >= logging.WARNING:
            return s.log_warning
        if record.levelno >= logging.INFO:
            return s.log_info
        return s.log_verbose_level > 0


# One per process, like the logging module's own state it filters for.
_GATE = _Gate()


def configure_logging(settings: Settings, role: str) -> None:
    """`role`: what this process is (gateway, worker, jobs, up, stub), named in each JSON line."""
    configure_process_logging(settings.log_format, settings.log_verbose, role)


def configure_process_logging(log_format: str, verbose: int, role: str) -> None:
    """configure_logging for a process without Settings (a Python model's stub, told by its worker)."""
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"stderr": {"class": "logging.StreamHandler"}},
        "root": {"level": "DEBUG" if verbose > 0 else "INFO", "handlers": ["stderr"]},
        "loggers": {"asyncio": {"level": "WARNING"}},
    })
    _GATE.settings = LogSettings(log_verbose_level=verbose)
    _GATE.log_format = log_format
    formatter = make_formatter(log_format, role)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
        handler.addFilter(_GATE)
    if log_format == "json":
        # A collector reads one object per line: what Python would print raw goes through logging.
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    log.critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: a thread's sys.exit() is no error
        return
    name = args.thread.name if args.thread is not None else "?"
    log.critical("uncaught exception in thread %s", name,
                 exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback))


def process_log_format() -> str:
    """This process's log format ("text" or "json"), for the processes it starts (Python model stubs)."""
    return _GATE.log_format


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
    # Triton's log_format picks text's timestamps; a JSON line's are always ISO 8601.
    if new.log_format != old.log_format and _GATE.log_format == "text":
        formatter = TextFormatter(iso8601=new.log_format == "ISO8601")
        for handler in root.handlers:
            handler.setFormatter(formatter)
    # Verbose only: shows that a change reached this process, without adding an INFO line per change.
    log.debug("log settings applied: %s", " ".join(f"{k}={v}" for k, v in new.response().items()))
