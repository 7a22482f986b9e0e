"""configure_logging(settings): once per entrypoint; text to stderr (fleet up prefixes the process name)."""

from __future__ import annotations

import logging
import logging.config

from fleet.settings import Settings


def configure_logging(settings: Settings) -> None:
    level = "DEBUG" if settings.log_verbose > 0 else "INFO"
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"text": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "text"}},
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {"asyncio": {"level": "WARNING"}},
    })
