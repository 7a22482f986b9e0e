"""The gateway's gRPC server: HTTP/2 (gateway/grpc/h2.py) on the gateway's own event loop (uvloop, next
to uvicorn), so RPCs share the process's catalog, broker, admission count and auth with HTTP.

fleet's own, not grpc.aio: grpc.aio's per-call machinery (a poller thread handing each completion to
the loop, several futures and tasks per call) cost ~230 µs of CPU per unary call, more than the rest
of the gateway's work for it, and made gRPC slower than HTTP/1.1 (bench/RESULTS.md). Here a call is one
task, and the responses finished in one loop turn leave in one write per connection.

Options follow tritonserver's flags (fleet/grpc_flags.py): keepalive and HTTP/2 ping policy, the
response compression level; message sizes are bounded by the body limit (`max_input_bytes`) both ways.
gzip and deflate request compression, as tritonclient sends it, is decompressed here, and the
decompressed size is what the limit bounds. The port is taken without SO_REUSEPORT unless `--reuse-port`
(fleet/listen.py), so a second gateway on a taken port fails at start instead of silently sharing it.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from fleet.listen import BACKLOG, address, server_socket
from fleet.settings import Settings
from gateway.auth import Access
from gateway.grpc import h2
from gateway.grpc.calls import Call, response_encoding
from gateway.grpc.h2_frames import ConnectionError_, LocalSettings
from gateway.grpc.handlers import Method, methods
from gateway.grpc.service import InferenceService
from gateway.grpc.status_codes import StatusCode
from gateway.state import GatewayState

log = logging.getLogger(__name__)

KEEPALIVE_TICK_S = 1.0  # how often connections are checked for a keepalive ping due or unanswered


def local_settings(settings: Settings) -> LocalSettings:
    """tritonserver's gRPC flags, as this server applies them."""
    return LocalSettings(
        keepalive_time_s=settings.grpc_keepalive_time_ms / 1000,
        keepalive_timeout_s=settings.grpc_keepalive_timeout_ms / 1000,
        keepalive_permit_without_calls=settings.grpc_keepalive_permit_without_calls,
        max_pings_without_data=settings.grpc_http2_max_pings_without_data,
        min_recv_ping_interval_without_data_s=settings.grpc_http2_min_recv_ping_interval_without_data_ms / 1000,
        max_ping_strikes=settings.grpc_http2_max_ping_strikes,
        max_header_list_size=settings.max_header_bytes,
    )


class GrpcConnection(asyncio.Protocol):
    """One client connection: an H2Connection fed by the transport, a Call per stream."""

    def __init__(self, frontend: GrpcFrontend) -> None:
        self.frontend = frontend
        self.loop = asyncio.get_running_loop()
        self.max_message_bytes = frontend.settings.max_input_bytes
        self.h2 = h2.H2Connection(frontend.h2_settings, self._new_stream, self.loop.time)
        self.calls: dict[int, Call] = {}
        self._transport: asyncio.Transport | None = None
        self._flush_scheduled = False

    # ------------------------------------------------------------------ transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.frontend.connections.add(self)
        if self.frontend.stopping:
            self.h2.goaway()
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            self.h2.receive(data)
        except ConnectionError_ as exc:
            log.debug("gRPC connection error: %s", exc)
            self.h2.goaway(exc.code, str(exc))
            self._flush()
            self.close()
            return
        self._flush()
        self._close_if_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self.frontend.connections.discard(self)
        self._transport = None
        for call in list(self.calls.values()):
            call.on_reset()  # the client is gone: nothing to answer

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()  # what was written still goes out first

    def flush_and_close(self) -> None:
        self._flush()
        self.close()

    # ------------------------------------------------------------------ calls

    def _new_stream(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> Call:
        path = b""
        post = content_ok = False
        timeout = accept = None
        encoding = b"identity"
        for name, value in headers:  # one pass: this runs for every call
            if name == b":path":
                path = value
            elif name == b":method":
                post = value == b"POST"
            elif name == b"content-type":
                content_ok = value.startswith(b"application/grpc")
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-accept-encoding":
                accept = value
        frontend = self.frontend
        method: Method | None = frontend.methods.get(path.decode("latin-1")) if post and content_ok else None
        call = Call(self, stream_id, method, headers, timeout, encoding,
                    response_encoding(frontend.settings.grpc_response_compression_level, accept))
        self.calls[stream_id] = call
        if method is None:
            if not content_ok:
                call.fail(StatusCode.UNKNOWN, "the content-type is not application/grpc")
            elif not post:
                call.fail(StatusCode.UNIMPLEMENTED, "gRPC calls are POST requests")
            else:
                call.fail(StatusCode.UNIMPLEMENTED, f"Method not found: {path.decode('latin-1')}")
        else:
            call.start()
        return call

    def call_ended(self, stream_id: int) -> None:
        self.calls.pop(stream_id, None)
        if not self.calls:
            self.frontend.idle.set()

    def wrote(self) -> None:
        """A call queued frames: they leave at the end of this loop turn, with whatever else is done."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        self._flush()
        self._close_if_done()

    def _flush(self) -> None:
        out = self.h2.take_output()
        if out and self._transport is not None:
            self._transport.write(out)

    def _close_if_done(self) -> None:
        if (self.h2.goaway_sent or self.h2.peer_gone) and not self.calls and not self.h2.streams:
            self.close()

    # ------------------------------------------------------------------ keepalive and stop

    def keepalive(self) -> None:
        if self.h2.keepalive_expired():
            log.info("gRPC keepalive: no ping answer within %.0f s; closing the connection",
                     self.h2.settings.keepalive_timeout_s)
            self.close()
        elif self.h2.keepalive_due():
            self.h2.ping()
            self._flush()

    def go_away(self) -> None:
        self.h2.goaway()
        self._flush()
        self._close_if_done()


class GrpcFrontend:
    """The gRPC server of one gateway. `bind()` (inside the running loop) takes the port or raises;
    `start()` serves; `stop(grace_s)` stops accepting at once and answers what was accepted."""

    def __init__(self, settings: Settings, state: GatewayState) -> None:
        self.settings = settings
        self.service = InferenceService(state)
        self.methods: dict[str, Method] = methods(self.service, Access(settings))
        self.h2_settings = local_settings(settings)
        self.connections: set[GrpcConnection] = set()
        self.idle = asyncio.Event()
        self.stopping = False
        self._socket: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._stopped: asyncio.Future[None] | None = None
        self.port = 0

    def bind(self) -> int:
        try:
            sock = server_socket(self.settings.grpc_host, self.settings.grpc_port, reuse_port=self.settings.reuse_port)
        except OSError as exc:
            raise OSError(f"cannot serve gRPC: {exc}") from None
        self._socket = sock
        self.port = int(sock.getsockname()[1])
        return self.port

    async def start(self) -> None:
        assert self._socket is not None, "bind() first"
        self._server = await asyncio.get_running_loop().create_server(lambda: GrpcConnection(self), sock=self._socket,
                                                                      backlog=BACKLOG)
        self._keepalive = asyncio.ensure_future(self._keep_alive())
        log.info("gRPC inference service on %s", address(self.settings.grpc_host, self.port))

    async def _keep_alive(self) -> None:
        tick = min(KEEPALIVE_TICK_S, self.h2_settings.keepalive_time_s / 2, self.h2_settings.keepalive_timeout_s / 2)
        while True:
            await asyncio.sleep(max(tick, 0.01))
            for connection in list(self.connections):
                connection.keepalive()

    def calls(self) -> list[Call]:
        return [call for connection in self.connections for call in connection.calls.values()]

    async def stop(self, grace_s: float) -> None:
        """Idempotent: every caller waits for the one stop."""
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._stop(grace_s))
        await asyncio.shield(self._stopped)

    async def _stop(self, grace_s: float) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()  # new connections are refused from now on
        elif self._socket is not None:
            self._socket.close()
        self.service.drain()
        for connection in list(self.connections):
            connection.go_away()  # new calls are refused; the ones running get `grace_s` to finish
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.calls() and loop.time() < deadline:
            self.idle.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await self.idle.wait()
            except TimeoutError:
                break
        calls = self.calls()
        for call in calls:
            call.cancel()
        tasks = [call.task for call in calls if call.task is not None]
        if tasks:  # let the cancelled calls write their status (bounded: a stop never hangs)
            await asyncio.wait(tasks, timeout=1.0)
        for connection in list(self.connections):
            connection.flush_and_close()
        if self._keepalive is not None:
            self._keepalive.cancel()
        log.info("gRPC inference service stopped")

