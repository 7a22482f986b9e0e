"""The logging and trace extensions for one gateway process, protocol-neutral: HTTP (gateway/
settings_routes.py) and gRPC (LogSettings, TraceSetting) call `log_settings` and `trace_settings` with
the request's settings as a plain dict (the JSON body; for gRPC trace settings, fleet.trace_settings.
update_from_grpc converts the request) and answer the dict they return.

A change is stored in Redis and announced there (fleet/log_settings.py, fleet/trace_settings.py); this
process applies it before answering, so its own next request already sees it, and every other process
(workers, other gateways) applies it on the announcement (fleet/settings_watch.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from redis.exceptions import RedisError

from fleet.cancellation import cancel_and_wait
from fleet.errors import BrokerUnavailable, InvalidInput
from fleet.keys import Keys
from fleet.log_settings import CHANNEL_MESSAGE as LOGGING
from fleet.log_settings import parse_log_update, read_log_settings, store_log_update
from fleet.logs import apply_log_settings, current_log_settings, default_log_settings
from fleet.settings import Settings
from fleet.settings_watch import follow_settings
from fleet.supervision import Supervisor
from fleet.trace_settings import (
    CHANNEL_MESSAGE as TRACE,
)
from fleet.trace_settings import (
    TraceUpdate,
    check_update,
    parse_trace_update,
    read_trace_state,
    store_trace_update,
)
from gateway.catalog import Catalog
from gateway.tracer import Tracer

log = logging.getLogger(__name__)


def _plain(update: Any) -> Any:
    return dict(update) if isinstance(update, Mapping) else update


class RuntimeSettings:
    def __init__(self, settings: Settings, client: Any, keys: Keys, catalog: Catalog, tracer: Tracer) -> None:
        self._settings = settings
        self._client = client
        self._keys = keys
        self._catalog = catalog
        self.tracer = tracer
        self._defaults = default_log_settings(settings)
        self._task: asyncio.Task[None] | None = None

    def start(self, supervisor: Supervisor) -> None:
        """Follow the settings in Redis (read at once, then on each announcement), Redis or not."""
        url = self._settings.redis_url_or_default
        self._task = supervisor.start("settings", lambda: follow_settings(url, self._keys, (LOGGING, TRACE),
                                                                          self._on_change))

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], "settings listener")
        self.tracer.close()

    async def _on_change(self, kind: str) -> None:
        if kind == LOGGING:
            apply_log_settings(await read_log_settings(self._client, self._keys, self._defaults))
        else:
            self.tracer.apply(await read_trace_state(self._client, self._keys))

    async def log_settings(self, update: Any = None) -> dict[str, Any]:
        """GET (None) or POST (the settings to change, a JSON object) /v2/logging: the settings in force
        after it.
        Raises InvalidInput / Unsupported for a bad update (nothing is changed then), BrokerUnavailable
        when Redis cannot take it."""
        changes = {} if update is None else parse_log_update(_plain(update))
        if changes:  # else nothing to change (an empty body, only nulls): a read
            try:
                await store_log_update(self._client, self._keys, changes)
                apply_log_settings(await read_log_settings(self._client, self._keys, self._defaults))
            except (RedisError, OSError) as exc:
                raise BrokerUnavailable(f"cannot change the log settings: Redis is not reachable ({exc})") from exc
        return current_log_settings().response()

    async def trace_settings(self, model: str | None = None, update: Any = None) -> dict[str, Any]:
        """GET (None) or POST (the settings to change) /v2[/models/MODEL]/trace/setting: the settings in
        force for `model` (None or "": the global ones) after it. Raises InvalidInput for a model with no
        ready version (as Triton) or a bad update, Unsupported for one it cannot take, BrokerUnavailable
        without Redis."""
        model = model or None
        if model is not None and not self._catalog.ready_versions(model):
            # Triton asks whether the model is ready, and answers INVALID_ARG in these words when it is not.
            raise InvalidInput(f"Request for unknown model : {model}")
        changes = TraceUpdate() if update is None else parse_trace_update(_plain(update),
                                                                          str(self.tracer.file.path))
        # Else nothing to change (an empty body; gRPC asks for the settings that way): a read, which must
        # not restart the scope's sampling as an update does.
        if changes.sets or changes.clears:
            try:
                current = await read_trace_state(self._client, self._keys)
                check_update(current, model, changes)
                await store_trace_update(self._client, self._keys, model, changes)
                self.tracer.apply(await read_trace_state(self._client, self._keys))
            except (RedisError, OSError) as exc:
                raise BrokerUnavailable(f"cannot change the trace settings: Redis is not reachable ({exc})") from exc
        return self.tracer.response(model)
