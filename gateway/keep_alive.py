"""uvicorn's httptools protocol with its keep-alive timeout kept by one timer per idle stretch.

uvicorn arms a timer (`call_later`) as each response completes and cancels it as the next request's bytes
arrive: two calls into the event loop a request, 1.1-2.2 µs in uvloop, warm (bench/RESULTS.md, stop 64).
Here a completed response notes when the connection went idle, arriving bytes note that it is not
(`_unset_keepalive_if_required`, which uvicorn calls there too), and one timer per idle stretch closes the
connection once the timeout has passed since its last answer, re-armed when it comes early: a busy
connection arms one timer per keep-alive timeout, not one a request. When a connection closes is uvicorn's.
gateway/http_protocol.py builds the gateway's limits on top.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class IdleKeepAlive(HttpToolsProtocol):
    __slots__ = ("_idle_since", "_keep_timer")  # (see EdgeHttpProtocol's slots)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._idle_since = -1.0  # when the last response completed with nothing after it; -1: not idle
        self._keep_timer: asyncio.TimerHandle | None = None  # the keep-alive timeout's, one per idle stretch
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._keep_timer is not None:
            self._keep_timer.cancel()
            self._keep_timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        """uvicorn's, but for its keep-alive timer (above)."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = -1.0
        self.flow.resume_reading()
        if self.pipeline:  # a pipelined request starts now
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = now = self.loop.time()
        if self._keep_timer is None:
            self._keep_timer = self.loop.call_at(now + self.timeout_keep_alive, self._keep_alive_due)

    def _unset_keepalive_if_required(self) -> None:
        """uvicorn's, called as bytes arrive and as the connection is lost: not idle."""
        self._idle_since = -1.0

    def _keep_alive_due(self) -> None:
        self._keep_timer = None
        if self._idle_since < 0 or self.transport.is_closing():
            return  # busy since: the response that ends it arms the next
        due = self._idle_since + self.timeout_keep_alive
        if self.loop.time() < due:  # went idle again after a request since this was armed
            self._keep_timer = self.loop.call_at(due, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()
