"""The gateway's listening sockets, made here rather than by uvicorn or asyncio when several gateway
processes share one host's ports (`--reuse-port`, which `fleet up --gateways N` passes to each).

SO_REUSEPORT lets every process that sets it bind the same address; the kernel spreads new connections
over them by a hash of the connection's addresses, so each connection stays on one process. Without the
flag a port already taken fails the start, as before: a second gateway never shares a port by accident.

A shared socket is bound here, at start, and listens only once its server starts serving (asyncio's and
uvloop's create_server call listen): the kernel hands a process connections only from then on, so a
gateway still starting (or one that fails to) leaves new connections to the processes already serving.
A socket of its own listens at once: with SO_REUSEADDR alone, two sockets may bind one port until one
of them listens, and a second gateway must fail here, not later.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from fleet.settings import Settings

BACKLOG = 1024
AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def server_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A non-blocking socket bound to host:port, listening unless shared; OSError naming the address when
    it cannot be taken. The first address `host` resolves to, dual-stack for an IPv6 one: how the gRPC
    server has always bound."""
    family, kind, proto, _, sockaddr = _addresses(host, port)[0]
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OSError(f"cannot take {address(host, port)}: {exc.strerror or exc}") from None
    return _bound(sock, host, port, sockaddr, reuse_port=reuse_port, v6only=False)


def server_sockets(host: str, port: int, *, reuse_port: bool) -> list[socket.socket]:
    """One socket per address `host` resolves to, IPv6 ones IPv6-only: how asyncio's create_server binds
    a host (and so uvicorn, for HTTP), e.g. both 127.0.0.1 and ::1 for "localhost"."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in dict.fromkeys(_addresses(host, port)):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this kernel lacks (IPv6 off): skipped, as asyncio skips it
                continue
            sockets.append(_bound(sock, host, port, sockaddr, reuse_port=reuse_port, v6only=True))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise OSError(f"cannot take {address(host, port)}: no address of it can have a socket here")
    return sockets


def _addresses(host: str, port: int) -> Sequence[AddrInfo]:
    try:
        return socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode
        raise OSError(f"cannot take {address(host, port)}: {getattr(exc, 'strerror', None) or exc}") from None


def _bound(sock: socket.socket, host: str, port: int, sockaddr: Any, *, reuse_port: bool,
           v6only: bool) -> socket.socket:
    """`sock` set up and bound (closed, and OSError naming the address, if it cannot be)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind(sockaddr)
        if not reuse_port:
            sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot take {address(host, port)}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def gateway_ports(settings: Settings) -> list[tuple[str, int, bool]]:
    """(host, port, every_address) of each port a gateway serves, bound as its server binds it: HTTP and
    metrics on every address of the HTTP host (uvicorn's way), gRPC on the first (the gRPC server's)."""
    return [(settings.http_host, settings.http_port, True), (settings.http_host, settings.metrics_port, True),
            *([(settings.grpc_host, settings.grpc_port, False)] if settings.allow_grpc else [])]


def equal_ports(settings: Settings) -> list[int] | None:
    """The ports, if two of a gateway's roles share one: gateways sharing their ports cannot have that, as
    the port's connections would be split between the roles (without SO_REUSEPORT the bind fails)."""
    numbers = [port for _, port, _ in gateway_ports(settings)]
    return numbers if len(set(numbers)) < len(numbers) else None


def taken(host: str, port: int, *, every_address: bool = True) -> str | None:
    """Why host:port cannot be had by sockets of its own, bound as the server will bind it (every address,
    as HTTP; or the first, dual-stack, as gRPC: `every_address=False`), or None. Another process listening
    there, sharing the port or not, takes it. `fleet up --gateways N` asks before starting its gateways, so
    that they never join the port group of another fleet's (SO_REUSEPORT lets any process of this user in)."""
    try:
        held = server_sockets(host, port, reuse_port=False) if every_address else [
            server_socket(host, port, reuse_port=False)]
    except OSError as exc:
        return str(exc)
    for sock in held:
        sock.close()
    return None
