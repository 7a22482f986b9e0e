"""The gateway's gRPC server: grpc.aio on the gateway's own event loop (uvloop, next to uvicorn), so
RPCs share the process's catalog, broker, admission count and auth with HTTP; no second process or
thread, no state to keep in step.

Options follow tritonserver's flags (fleet/grpc_flags.py): keepalive and HTTP/2 ping policy, the
response compression level; message sizes are bounded by the body limit (`max_input_bytes`) both
ways. gzip (and deflate) request compression, as tritonclient sends it, needs nothing: gRPC
decompresses, and the decompressed size is what the receive limit bounds. SO_REUSEPORT is off, so a
second gateway on a taken port fails at start instead of silently sharing the port.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from fleet.settings import Settings
from gateway.auth import Access
from gateway.grpc.handlers import generic_handler
from gateway.grpc.service import InferenceService
from gateway.state import GatewayState

log = logging.getLogger(__name__)

# tritonserver's --grpc-infer-response-compression-level -> gRPC's compression levels.
_LEVELS = {"none": 0, "low": 1, "med": 2, "high": 3}


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", settings.max_input_bytes),
        ("grpc.max_send_message_length", settings.max_input_bytes),
        ("grpc.keepalive_time_ms", settings.grpc_keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.grpc_keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(settings.grpc_keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", settings.grpc_http2_max_pings_without_data),
        ("grpc.http2.min_recv_ping_interval_without_data_ms",
         settings.grpc_http2_min_recv_ping_interval_without_data_ms),
        ("grpc.http2.max_ping_strikes", settings.grpc_http2_max_ping_strikes),
        ("grpc.so_reuseport", 0),
    ]
    level = _LEVELS[settings.grpc_response_compression_level]
    if level:
        options.append(("grpc.default_compression_level", level))
    return options


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcFrontend:
    """The gRPC server of one gateway. `bind()` (inside the running loop) takes the port or raises;
    `start()` serves; `stop(grace_s)` stops accepting at once and answers what was accepted."""

    def __init__(self, settings: Settings, state: GatewayState) -> None:
        self.settings = settings
        self.service = InferenceService(state)
        self._access = Access(settings)
        self._server: Any = None
        self._stopping: asyncio.Future[None] | None = None
        self.port = 0

    def bind(self) -> int:
        server = grpc.aio.server(options=server_options(self.settings))
        server.add_generic_rpc_handlers((generic_handler(self.service, self._access),))
        where = address(self.settings.grpc_host, self.settings.grpc_port)
        try:
            self.port = int(server.add_insecure_port(where))
        except RuntimeError as exc:
            raise OSError(f"cannot serve gRPC on {where}: {exc}") from None
        if self.port == 0:  # older grpcio: 0 instead of an exception
            raise OSError(f"cannot serve gRPC on {where}: the address is in use or not available")
        self._server = server
        return self.port

    async def start(self) -> None:
        await self._server.start()
        log.info("gRPC inference service on %s", address(self.settings.grpc_host, self.port))

    async def stop(self, grace_s: float) -> None:
        """Idempotent: every caller waits for the one stop."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float) -> None:
        if self._server is None:
            return
        self.service.drain()
        # New calls are refused from now on; the ones running get `grace_s` to finish, then are cancelled.
        await self._server.stop(grace_s)
        log.info("gRPC inference service stopped")
