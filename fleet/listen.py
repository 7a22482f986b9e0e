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

BACKLOG = 1024


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def server_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A non-blocking socket bound to host:port (dual-stack for an IPv6 host), listening unless shared;
    OSError naming the address when it cannot be taken."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            if not reuse_port:
                sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise OSError(f"cannot take {address(host, port)}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def taken(host: str, port: int) -> str | None:
    """Why host:port cannot be had by a socket of its own (another process listens there, sharing it or
    not), or None. `fleet up --gateways N` asks before starting its gateways, so that they never join
    the port group of another fleet's gateways (SO_REUSEPORT lets any process of this user in)."""
    try:
        server_socket(host, port, reuse_port=False).close()
    except OSError as exc:
        return str(exc)
    return None
