"""`fleet gateway`: uvicorn serving the app on --http-port and /metrics on --metrics-port, and (unless
--allow-grpc false) Triton's gRPC service on --grpc-port, on the same event loop (gateway/grpc/server.py).
With --reuse-port all three ports are shared with the host's other gateway processes (fleet/listen.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Generator

import uvicorn
import uvloop
from starlette.applications import Starlette

from fleet.listen import equal_ports, server_sockets
from fleet.logs import configure_logging
from fleet.settings import Settings
from gateway.app import create_app
from gateway.grpc.server import GrpcFrontend
from gateway.http_protocol import protocol_class
from gateway.infer_protocol import serving_infer
from gateway.metrics import metrics_route

log = logging.getLogger(__name__)

GRACEFUL_STOP_S = 30  # what HTTP and gRPC calls in flight at SIGTERM get to finish


def serve(settings: Settings) -> int:
    configure_logging(settings, "gateway")
    app = create_app(settings)
    # The metrics port serves the same /metrics route over the main app's state.
    metrics_app = Starlette(routes=[metrics_route()])
    metrics_app.state.fleet = app.state.fleet
    level = "info" if settings.log_verbose else "warning"
    protocol = protocol_class(settings)  # one class for both ports: one budget of body bytes per process
    main = _GatewayServer(uvicorn.Config(
        app, host=settings.http_host, port=settings.http_port, loop="uvloop",
        # Infer requests answered by the protocol itself (the metrics port serves no infer).
        http=serving_infer(protocol, app.infer_handler, app.state.fleet, app.access),
        ws="none",  # no websocket routes: an Upgrade header changes nothing
        log_level=level, access_log=settings.log_verbose > 1, timeout_graceful_shutdown=GRACEFUL_STOP_S,
        log_config=None,  # uvicorn's lines go to the root handler: fleet's format (JSON in containers)
        server_header=False, date_header=False,
    ))
    side = _QuietServer(uvicorn.Config(
        metrics_app, host=settings.http_host, port=settings.metrics_port, loop="uvloop", http=protocol,
        ws="none",
        log_level="warning", access_log=False, lifespan="off", log_config=None,
    ))

    async def run_both() -> int:
        http_sockets: list[socket.socket] | None = None
        metrics_sockets: list[socket.socket] | None = None
        if settings.reuse_port:
            # Sockets of its own, shared with the host's other gateway processes (uvicorn sets no SO_REUSEPORT).
            if (numbers := equal_ports(settings)) is not None:
                log.error("--reuse-port needs distinct HTTP, metrics and gRPC ports, not %s", numbers)
                return 1
            try:
                http_sockets = server_sockets(settings.http_host, settings.http_port, reuse_port=True)
                metrics_sockets = server_sockets(settings.http_host, settings.metrics_port, reuse_port=True)
            except OSError as exc:
                log.error("%s", exc)
                return 1
        if settings.allow_grpc:
            # Made in the running loop and its port taken before anything serves:
            # a taken port fails the start, as a taken HTTP port does.
            frontend = GrpcFrontend(settings, app.state.fleet)
            try:
                frontend.bind()
            except OSError as exc:
                log.error("%s", exc)
                return 1
            main.grpc = frontend
            app.state.fleet.drains.append(lambda: frontend.stop(GRACEFUL_STOP_S))
        tasks: list[asyncio.Task[None]] = []

        def start_side() -> None:
            task = asyncio.create_task(side.serve(metrics_sockets))
            task.add_done_callback(side_ended)
            tasks.append(task)

        def side_ended(task: asyncio.Task[None]) -> None:
            # A metrics server that fails (its socket cannot listen, say) stops the gateway: not one serving
            # without the metrics port it was asked for.
            if not task.cancelled() and task.exception() is not None and not main.should_exit:
                log.error("the metrics server on :%d failed: %s", settings.metrics_port, task.exception())
                main.should_exit = True

        if settings.reuse_port:
            main.after_startup = start_side  # a shared metrics port too serves only once the state is up
        else:
            start_side()
        try:
            await main.serve(http_sockets)
        finally:
            side.should_exit = True
            await asyncio.gather(*tasks)
        return 0

    return uvloop.run(run_both())


class _GatewayServer(uvicorn.Server):
    """The main server. With gRPC on, it starts the gRPC server once the app has started (the state
    the RPCs use is up), and on SIGTERM stops it together with HTTP: both refuse new calls at once; the
    app's shutdown (GatewayState.stop) waits for the gRPC calls in flight before the broker stops."""

    grpc: GrpcFrontend | None = None
    after_startup: Callable[[], None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.grpc is not None and not self.should_exit:
            await self.grpc.start()
        if self.after_startup is not None and not self.should_exit:
            self.after_startup()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.grpc is not None:
            stopping = asyncio.ensure_future(self.grpc.stop(GRACEFUL_STOP_S))
            stopping.add_done_callback(lambda t: t.cancelled() or t.exception())  # awaited by the state too
        await super().shutdown(sockets)


class _QuietServer(uvicorn.Server):
    """The metrics server leaves signals to the main server, which stops it on its way out."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
