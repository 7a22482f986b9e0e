"""fleet/listen.py on real sockets: a gateway's own socket listens at once and a taken port fails it; a
shared one (SO_REUSEPORT) is only bound until its server serves; shared sockets bind one port together;
and `taken` sees any listener, shared or not."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from fleet.listen import server_socket, server_sockets, taken
from fleet.redis_server import free_port

HOST = "127.0.0.1"


def listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def test_a_socket_of_its_own_listens_at_once_and_a_second_one_fails() -> None:
    first = server_socket(HOST, 0, reuse_port=False)
    try:
        assert listening(first)
        port = first.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot take 127.0.0.1:{port}: "):
            server_socket(HOST, port, reuse_port=False)
        with pytest.raises(OSError):
            server_socket(HOST, port, reuse_port=True)  # nor does a shared one join a port held alone
        assert taken(HOST, port) is not None
    finally:
        first.close()
    assert taken(HOST, port) is None


def test_shared_sockets_bind_together_and_listen_only_once_served() -> None:
    first = server_socket(HOST, 0, reuse_port=True)
    port = first.getsockname()[1]
    second = server_socket(HOST, port, reuse_port=True)
    try:
        assert not listening(first) and not listening(second)  # still starting: no connection comes to them

        async def serve() -> None:
            server = await asyncio.get_running_loop().create_server(asyncio.Protocol, sock=first)
            try:
                assert listening(first) and not listening(second)
                assert taken(HOST, port) is not None  # a listener in the group: another fleet keeps out
                reader, writer = await asyncio.open_connection(HOST, port)  # reaches the one serving
                writer.close()
            finally:
                server.close()

        uvloop.run(serve())
    finally:
        first.close()
        second.close()


def test_http_binds_every_address_a_host_names_as_asyncio_does() -> None:
    port = free_port()
    resolved = {info[4][:2] for info in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM,
                                                            flags=socket.AI_PASSIVE)}
    sockets = server_sockets("localhost", port, reuse_port=False)
    try:
        assert {s.getsockname()[:2] for s in sockets} == resolved and all(listening(s) for s in sockets)
        assert taken("localhost", port) is not None
    finally:
        for s in sockets:
            s.close()
