"""The gateway's HTTP protocol answering infer requests itself, past uvicorn's ASGI cycle and the app.

An infer request through ASGI crosses uvicorn's cycle (its scope, task wrapper, receive and send with
their per-header checks), the proxy-headers middleware, FastAPI's and Starlette's entry, the auth gate
and the fast path's own match before the handler runs, and answers in two sends. Profiled under
perf_analyzer (`mlp`, C=32), that plumbing was about a fifth of the gateway's CPU. Here the protocol
hands the request to the same InferHandler (gateway/fastpath.py) from its parser callback and writes
the answer as one buffer.

Only a request nothing of that plumbing would change takes this path: POST to an infer URL in origin
form without percent-escapes or a query, HTTP/1.1 without an upgrade, no earlier request of its
connection unanswered (pipelined requests keep uvicorn's queue, which runs them in order), access
logging off, and where infer needs an API key, a valid one. Anything else goes to the app as before,
which answers it the same way, through the same handler. The connection-level limits, timeouts and
error answers (gateway/http_protocol.py) apply to both paths alike: this class only changes who runs
the request once its head is read.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, ClassVar

from starlette.types import Receive
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from fleet import log_context
from fleet.settings import Settings
from fleet.trace_points import HTTP_SEND_END, HTTP_SEND_START
from gateway.auth import Access
from gateway.fastpath import InferAnswer, InferHandler
from gateway.http_protocol import EdgeHttpProtocol

log = logging.getLogger(__name__)

# As fastpath's pattern, on the raw target: no '%' (the ASGI path unquotes), no query or fragment.
_TARGET = re.compile(rb"^/v2/models/([^/?%#]+)(?:/versions/([^/?%#]*))?/infer$")
_INTERNAL = InferAnswer(500, [(b"content-type", b"application/json")],
                        b'{"error": "internal error while answering the request"}', None)


class Served:
    """What the protocol answers with: the app's handler and state, and who may call infer."""

    __slots__ = ("handler", "state", "access", "keyed")

    def __init__(self, handler: InferHandler, state: Any, settings: Settings) -> None:
        self.handler = handler
        self.state = state
        self.access = Access(settings)
        self.keyed = self.access.guards("infer")


def serving_infer(base: type[EdgeHttpProtocol], handler: InferHandler, state: Any,
                  settings: Settings) -> type[EdgeHttpProtocol]:
    """`base` (protocol_class's, with its limits and body budget) answering infer itself."""

    class Serving(InferHttpProtocol, base):  # type: ignore[valid-type,misc]
        served = Served(handler, state, settings)

    return Serving


class InferHttpProtocol(EdgeHttpProtocol):
    served: ClassVar[Served]

    def _begin_cycle(self) -> None:
        parser = self.parser
        cycle = self.cycle
        match = None
        if (parser.get_method() == b"POST" and (cycle is None or cycle.response_complete)
                and not self.access_log and self.limit_concurrency is None
                and parser.get_http_version() == "1.1" and not parser.should_upgrade()):
            match = _TARGET.match(self.url)
        served = self.served
        if match is None or (served.keyed and not served.access.allowed(
                next((v for k, v in self.headers if k == b"authorization"), None))):
            super()._begin_cycle()  # the app's way (which also answers a refused key)
            return
        try:
            name = match.group(1).decode("ascii")
            version = None if match.group(2) is None else match.group(2).decode("ascii")
        except UnicodeDecodeError:
            super()._begin_cycle()
            return
        self.scope["method"] = "POST"  # for anything that reads the cycle's scope (a log line)
        self.cycle = cycle = RequestResponseCycle(
            scope=self.scope, transport=self.transport, flow=self.flow, logger=self.logger,
            access_logger=self.access_logger, access_log=False, default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(), expect_100_continue=self.expect_100_continue,
            keep_alive=parser.should_keep_alive(), on_response=self.on_response_complete)
        # self.headers is replaced when the connection's next request begins: this one's are kept here.
        task = self.loop.create_task(self._answer(cycle, self.headers, name, version))
        task.add_done_callback(self.tasks.discard)  # the server's graceful stop waits for these
        self.tasks.add(task)

    async def _answer(self, cycle: RequestResponseCycle, headers: list[tuple[bytes, bytes]], name: str,
                      version: str | None) -> None:
        token = log_context.bind(log_context.RequestLog(name, version))
        try:
            body: bytes | None = None
            if not cycle.more_body and not cycle.waiting_for_100_continue:
                # Read whole with its head (the usual infer request): taken as receive() would give it
                # (a bytearray, which everything after reads as bytes).
                body, cycle.body = cycle.body, bytearray()  # type: ignore[assignment]
                cycle.message_event.clear()
            receive: Receive = cycle.receive  # type: ignore[assignment]  # uvicorn's ASGI types, Starlette's
            answer = await self.served.handler.answer(self.served.state, headers, body, receive, name, version)
            if answer is not None:
                await self._send(cycle, answer)
        except Exception:  # the handler answers its own errors: this is a fault in the writing
            log.exception("answering an infer request on '%s' failed", name)
            if not cycle.response_started:
                await self._send(cycle, _INTERNAL)
        finally:
            log_context.unbind(token)

    async def _send(self, cycle: RequestResponseCycle, answer: InferAnswer) -> None:
        """As uvicorn's send of a start and a body message would, in one write."""
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        trace = answer.trace
        if trace is not None:
            trace.stamp(HTTP_SEND_START)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        body = answer.body
        headers = answer.headers
        out = [STATUS_LINE[answer.status]]
        for name, value in cycle.default_headers:
            out += [name, b": ", value, b"\r\n"]
        out += [b"content-type: ", headers[0][1], b"\r\ncontent-length: %d\r\n" % len(body)]
        for name, value in headers[1:]:
            out += [name, b": ", value, b"\r\n"]
        if not cycle.keep_alive:
            out.append(b"connection: close\r\n")
        out += [b"\r\n", body]
        self.transport.write_whole(b"".join(out))  # type: ignore[attr-defined]
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()
        if trace is not None:
            trace.stamp(HTTP_SEND_END)
            trace.finish()
