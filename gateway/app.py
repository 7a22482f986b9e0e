"""create_app(settings): the gateway's ASGI application."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from fleet.errors import ServingError
from fleet.gc_tuning import freeze_after_startup
from fleet.settings import Settings
from gateway.auth import Access, AuthGate
from gateway.errors import error_response, handle_serving_error
from gateway.fastpath import InferFastPath, InferHandler
from gateway.jobs.routes import ROUTES as JOB_ROUTES
from gateway.metrics import metrics_route
from gateway.openai_api import ROUTES as OPENAI_ROUTES
from gateway.routes import ROUTES
from gateway.settings_routes import ROUTES as SETTINGS_ROUTES
from gateway.shm_routes import ROUTES as SHM_ROUTES
from gateway.state import GatewayState
from gateway.status_routes import status_routes


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail))


async def _unexpected(request: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


class GatewayApp(FastAPI):
    """FastAPI, with the infer fast path (and the auth gate before it) in front of Starlette's own
    middleware: an infer request is answered by a plain ASGI handler that handles its own errors, so it
    pays for none of the error, telemetry and body-limit layers every other route goes through."""

    def __init__(self, settings: Settings, **kwargs: Any) -> None:
        # FastAPI's native OpenTelemetry looks up the global providers on every request; fleet exports
        # Prometheus metrics instead. Off where this FastAPI version has it.
        if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
            kwargs["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
        super().__init__(**kwargs)
        self._fleet_settings = settings
        # Both also given to the HTTP protocol, which answers infer itself (gateway/server.py).
        self.infer_handler = InferHandler()
        self.access = Access(settings)

    def build_middleware_stack(self) -> ASGIApp:
        return AuthGate(InferFastPath(super().build_middleware_stack(), self.infer_handler),
                        settings=self._fleet_settings, access=self.access)


def create_app(settings: Settings) -> GatewayApp:
    state = GatewayState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        freeze_after_startup()
        try:
            yield
        finally:
            await state.stop()

    app = GatewayApp(settings, title="fleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    # The routes are plain Starlette routes (the hot path skips FastAPI's machinery), so the document
    # FastAPI serves at /openapi.json is written, not generated: KServe's v2 spec (path templates in
    # OpenAPI form) plus fleet's extension routes (Triton's config/stats/repository, bulk jobs).
    document = json.loads((Path(__file__).parent / "openapi.json").read_text(encoding="utf-8"))
    app.openapi = lambda: document  # type: ignore[method-assign]
    app.state.fleet = state
    app.router.routes.extend([*ROUTES, *OPENAI_ROUTES, *SHM_ROUTES, *SETTINGS_ROUTES, *JOB_ROUTES, metrics_route(),
                              *status_routes()])
    app.add_exception_handler(ServingError, handle_serving_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app
