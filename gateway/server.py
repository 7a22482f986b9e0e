"""`fleet gateway`: uvicorn serving the app on --http-port and /metrics on --metrics-port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Generator

import uvicorn
import uvloop
from starlette.applications import Starlette

from fleet.logs import configure_logging
from fleet.settings import Settings
from gateway.app import create_app
from gateway.http_protocol import CoalescingHttpToolsProtocol
from gateway.metrics import metrics_route

log = logging.getLogger(__name__)


def serve(settings: Settings) -> int:
    configure_logging(settings)
    app = create_app(settings)
    CoalescingHttpToolsProtocol.max_head_bytes = settings.max_header_bytes
    # The metrics port serves the same /metrics route over the main app's state.
    metrics_app = Starlette(routes=[metrics_route()])
    metrics_app.state.fleet = app.state.fleet
    level = "info" if settings.log_verbose else "warning"
    main = uvicorn.Server(uvicorn.Config(
        app, host=settings.http_host, port=settings.http_port, loop="uvloop", http=CoalescingHttpToolsProtocol,
        log_level=level, access_log=settings.log_verbose > 1, timeout_graceful_shutdown=30,
        server_header=False, date_header=False,
    ))
    side = _QuietServer(uvicorn.Config(
        metrics_app, host=settings.http_host, port=settings.metrics_port, loop="uvloop", http="httptools",
        log_level="warning", access_log=False, lifespan="off",
    ))

    async def run_both() -> None:
        task = asyncio.create_task(side.serve())
        try:
            await main.serve()
        finally:
            side.should_exit = True
            await task

    uvloop.run(run_both())
    return 0


class _QuietServer(uvicorn.Server):
    """The metrics server leaves signals to the main server, which stops it on its way out."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
