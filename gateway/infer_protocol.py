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
import contextvars
import logging
import re
from typing import Any, ClassVar

from starlette.types import Receive
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

from fleet import log_context
from fleet.parts import Parts
from fleet.trace_points import HTTP_SEND_END, HTTP_SEND_START
from gateway.auth import Access
from gateway.fastpath import InferAnswer, InferHandler, answer_headers
from gateway.http_protocol import EdgeHttpProtocol

log = logging.getLogger(__name__)

# As fastpath's pattern, on the raw target: printable ASCII without '%' (the ASGI path unquotes), no
# query or fragment.
_TARGET = re.compile(rb"^/v2/models/([!-\x22\x24\x26-\x2e\x30-\x3e\x40-~]+)"
                     rb"(?:/versions/([!-\x22\x24\x26-\x2e\x30-\x3e\x40-~]*))?/infer$")
# A body this long is written from its own buffer, after the head (a writev), instead of copied in with it.
LONG_BODY = 1 << 16
_INTERNAL = InferAnswer(500, [(b"content-type", b"application/json")],
                        b'{"error": "internal error while answering the request"}', None)


class Served:
    """What the protocol answers with: the app's handler and state, and who may call infer."""

    __slots__ = ("handler", "state", "access", "keyed")

    def __init__(self, handler: InferHandler, state: Any, access: Access) -> None:
        self.handler = handler
        self.state = state
        self.access = access
        self.keyed = access.guards("infer")


def serving_infer(base: type[EdgeHttpProtocol], handler: InferHandler, state: Any,
                  access: Access) -> type[EdgeHttpProtocol]:
    """`base` (protocol_class's, with its limits and body budget) answering infer itself, with the app's
    handler, state and access (the auth gate's)."""

    class Serving(InferHttpProtocol, base):  # type: ignore[valid-type,misc]
        served = Served(handler, state, access)

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
        name = match.group(1).decode("ascii")
        version = None if match.group(2) is None else match.group(2).decode("ascii")
        self.scope["method"] = "POST"  # for anything that reads the cycle's scope (a log line)
        self.cycle = cycle = RequestResponseCycle(
            scope=self.scope, transport=self.transport, flow=self.flow, logger=self.logger,
            access_logger=self.access_logger, access_log=False, default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(), expect_100_continue=self.expect_100_continue,
            keep_alive=parser.should_keep_alive(), on_response=self.on_response_complete)
        # self.headers is replaced when the connection's next request begins: this one's are kept here.
        answering = self._answer(cycle, self.headers, name, version)
        task = (self.loop.create_task(answering, context=contextvars.Context()) if self.config.reset_contextvars
                else self.loop.create_task(answering))  # as uvicorn starts an ASGI task
        task.add_done_callback(self.tasks.discard)  # the server's graceful stop waits for these
        self.tasks.add(task)

    async def _answer(self, cycle: RequestResponseCycle, headers: list[tuple[bytes, bytes]], name: str,
                      version: str | None) -> None:
        if cycle.disconnected:
            return  # gone before its turn: nothing computed (the app's path would stop at receive())
        token = log_context.bind(log_context.RequestLog(name, version))
        try:
            body: bytes | None = None
            if not cycle.more_body and not cycle.waiting_for_100_continue:
                # Read whole with its head (the usual infer request): taken as receive() would give it
                # (a bytearray, which everything after reads as bytes), reading resumed as it does.
                body, cycle.body = cycle.body, bytearray()  # type: ignore[assignment]
                cycle.message_event.clear()
                self.flow.resume_reading()
            receive: Receive = cycle.receive  # type: ignore[assignment]  # uvicorn's ASGI types, Starlette's
            answer = await self.served.handler.answer(self.served.state, headers, body, receive, name, version)
            if answer is not None:
                await self._send(cycle, answer)
        except BaseException as exc:
            # The handler answers its own errors: this is a fault in the writing, or the server's graceful
            # stop giving up on the request (cancelled). As uvicorn's run_asgi: a 500 that closes the
            # connection if nothing was sent yet, else the connection closed under the partial answer.
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("answering an infer request on '%s' failed", name)
            if not cycle.response_started:
                cycle.keep_alive = False
                try:
                    await self._send(cycle, _INTERNAL)
                except Exception:
                    log.exception("answering an infer request on '%s' with a 500 failed", name)
                    self.transport.close()
            elif not cycle.response_complete:
                self.transport.close()
        finally:
            log_context.unbind(token)

    async def _send(self, cycle: RequestResponseCycle, answer: InferAnswer) -> None:
        """As uvicorn's send of a start and a body message would, in one write."""
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        trace = answer.trace
        if cycle.disconnected:
            if trace is not None:
                trace.finish()  # what it got through, without a response
            return
        if trace is not None:
            trace.stamp(HTTP_SEND_START)
        out = [STATUS_LINE[answer.status]]
        for name, value in (*cycle.default_headers, *answer_headers(answer)):
            out += [name, b": ", value, b"\r\n"]
        if not cycle.keep_alive:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        body: bytes | Parts | None = answer.body
        if isinstance(answer.body, bytes) and len(answer.body) < LONG_BODY:
            out.append(answer.body)
            body = None
        data = b"".join(out)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        self.transport.write_whole(data, body)  # type: ignore[attr-defined]
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()
        if trace is not None:
            trace.stamp(HTTP_SEND_END)
            trace.finish()
