"""uvicorn's httptools protocol with coalesced writes and a bound on a request's head.

uvicorn writes a response's head (http.response.start) and body (http.response.body) with two
transport.write calls: two send syscalls and two TCP segments per response. Profiled under
perf_analyzer at C=32, those two writes were ~30% of the gateway's CPU. Buffering the writes made
during one event-loop turn and sending them together halves that; nothing waits longer than the
current loop turn.

uvicorn sets no limit on the request line and headers: httptools buffers a 20 MB header whole. Here a
head still incomplete after `max_head_bytes` is answered 431 and the connection closed, so a client
holds at most that much (plus one read) of the gateway's memory per connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _CoalescingTransport:
    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # everything else is the real transport's
        return getattr(self._transport, name)


_TOO_LARGE = b"request line and headers exceed the limit of %d bytes"


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = 64 * 1024  # set from Settings.max_header_bytes by gateway/server.py

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._in_head = True  # between requests, or reading one's request line and headers
        self._head_bytes = 0
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)  # may include the start of a body: checked only if still in the head
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            body = b'{"error": "%s"}' % (_TOO_LARGE % self.max_head_bytes)
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
                                 b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0
