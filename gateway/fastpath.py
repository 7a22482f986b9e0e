"""The infer hot path as a bare ASGI middleware: POST /v2/models/NAME[/versions/V]/infer is answered
here without Starlette's routing table, Request/Response objects or exception middleware.

design.md measured the framework layer in front of a handler at up to 2x the cost of a bare ASGI
callable; everything else (metadata, config, stats, errors for other routes) stays on the app's routes.
The route in routes.py serves the same URL with the same code path, for clarity and as a fallback.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from fleet import log_context
from fleet.content_encoding import compress, decompress, response_encoding
from fleet.errors import InvalidInput, ServingError, TooLarge
from fleet.parts import Parts, joined
from fleet.trace_points import HTTP_RECV_END, HTTP_RECV_START, HTTP_SEND_END, HTTP_SEND_START
from gateway.errors import status_for
from gateway.routes import parse_version
from gateway.tracer import Trace

log = logging.getLogger(__name__)

_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]*))?/infer$")
_JSON = b"application/json"
# A request still waiting for its reply this long starts watching its connection: a client that went
# away cancels it (never computed, if no worker has started it). Quick replies never pay for a watcher.
DISCONNECT_WATCH_S = 0.05


class _Waiting:
    """One request waiting for its reply: cancels the request's task if its client disconnects."""

    __slots__ = ("receive", "task", "since", "watcher", "disconnected")

    def __init__(self, receive: Receive, since: float, loop: asyncio.AbstractEventLoop) -> None:
        self.receive = receive
        self.task = asyncio.current_task(loop)  # (the loop given: looking it up is a getpid() on Python 3.11)
        self.since = since
        self.watcher: asyncio.Task[None] | None = None
        self.disconnected = False

    def watch(self) -> None:
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if self.task is not None:
            self.task.cancel()


class _DisconnectWatch:
    """The requests of one process waiting for replies. One timer, not one per request (a timer handle
    per request cost more than the rest of the hot path's bookkeeping), starts a watcher for each that
    has waited DISCONNECT_WATCH_S."""

    def __init__(self) -> None:
        self._waiting: dict[_Waiting, None] = {}  # insertion-ordered: oldest first
        self._timer: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the process's one loop, once known

    def add(self, receive: Receive) -> _Waiting:
        loop = self._loop
        if loop is None or self._timer is None or self._timer.done():
            # Looked up once per loop (each lookup is a getpid() on Python 3.11): a loop that ended (tests
            # run several in turn) cancelled the timer it ran.
            self._loop = loop = asyncio.get_running_loop()
            # Its own context: started from inside a request, it would log as that request for life.
            self._timer = loop.create_task(self._run(), context=contextvars.Context())
        waiting = _Waiting(receive, loop.time(), loop)
        self._waiting[waiting] = None
        return waiting

    def remove(self, waiting: _Waiting) -> None:
        del self._waiting[waiting]
        if waiting.watcher is not None:
            waiting.watcher.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(DISCONNECT_WATCH_S)
            started_before = loop.time() - DISCONNECT_WATCH_S
            for waiting in self._waiting:
                if waiting.since > started_before:
                    break  # the rest are younger
                if waiting.watcher is None:
                    waiting.watch()


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidInput("the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:  # the HTTP protocol refuses it first (gateway/http_protocol.py); other servers may not
            raise TooLarge(f"the request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


@dataclass(slots=True)
class InferAnswer:
    """An infer request's response, before any protocol writes it: its status, headers (content-type first;
    no content-length, which the writer adds) and body, and the request's trace if it is traced. A long
    binary body is `Parts` (its JSON header and the outputs' buffers): a writer that can sends them as they
    are, one writev (gateway/infer_protocol.py)."""
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes | Parts
    trace: Trace | None


def _error(status: int, message: str, trace: Trace | None, retry_after_s: int | None = None) -> InferAnswer:
    headers = [(b"content-type", _JSON)]
    if retry_after_s is not None:
        headers.append((b"retry-after", b"%d" % retry_after_s))
    return InferAnswer(status, headers, json.dumps({"error": message}).encode(), trace)


class InferHandler:
    """POST /v2/models/NAME[/versions/V]/infer, whoever reads the HTTP: the ASGI middleware below, or the
    gateway's HTTP protocol itself (gateway/infer_protocol.py), which answers it without the ASGI layers.
    One per process: it holds the process's disconnect watch."""

    def __init__(self) -> None:
        self._watch = _DisconnectWatch()

    async def answer(self, state: Any, headers: list[tuple[bytes, bytes]], body: bytes | None, receive: Receive,
                     name: str, version: str | None) -> InferAnswer | None:
        """The response to one infer request; None if its client went away meanwhile (nobody to answer).
        `body`: the whole request body if the caller has it, else None and it is read through `receive`,
        which then also tells of a disconnect while the request waits for its reply."""
        accept = None
        # The trace extension: a request not traced pays this one attribute read (gateway/tracer.py).
        trace: Trace | None = state.tracer.sample(name, HTTP_RECV_START) if state.tracer.active else None
        try:
            version = parse_version(name, version)
            if body is None:
                body = await _read_body(receive, state.settings.max_input_bytes)
            if trace is not None:
                trace.stamp(HTTP_RECV_END)
            header_length = encoding = None
            for key, value in headers:
                if key == b"inference-header-content-length":
                    header_length = value.decode("latin-1")
                elif key == b"content-encoding":
                    encoding = value.decode("latin-1").strip().lower()
                elif key == b"accept-encoding":
                    accept = value.decode("latin-1")
            dataplane = state.dataplane
            dataplane.admit()  # Overloaded past max_in_flight, counted with the gRPC requests
            waiting = self._watch.add(receive)
            try:
                if encoding:
                    body = decompress(body, encoding, state.settings.max_input_bytes)
                result = await dataplane.infer(name, version, body, header_length, trace)
            except asyncio.CancelledError:
                if not waiting.disconnected:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()  # our own cancellation: the client is gone, there is nobody to answer
                if trace is not None:
                    trace.finish()  # what it got through, without a response
                return None
            finally:
                self._watch.remove(waiting)
                dataplane.release()
        except ServingError as exc:
            if log.isEnabledFor(logging.DEBUG):  # verbose only: a client's error is no server event
                log.debug("infer answered %d: %s", status_for(exc.code), exc.message)
            return _error(status_for(exc.code), exc.message, trace, exc.retry_after_s)
        except Exception as exc:  # never take the process down; answer 500 and log it
            log.exception("infer on '%s' failed", name)
            return _error(500, f"internal error: {exc}", trace)
        out = [(b"content-type", _JSON if result.header_length is None else b"application/octet-stream")]
        if result.header_length is not None:
            # Refers to the uncompressed JSON, as in Triton.
            out.append((b"inference-header-content-length", b"%d" % result.header_length))
        rendered = result.body
        out_encoding = response_encoding(accept)
        if out_encoding is not None:
            rendered = compress(joined(rendered), out_encoding)
            out.append((b"content-encoding", out_encoding.encode()))
        return InferAnswer(200, out, rendered, trace)


class InferFastPath:
    """The infer handler as bare ASGI middleware, in front of the app's routing."""

    def __init__(self, app: ASGIApp, handler: InferHandler) -> None:
        self.app = app
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _INFER.match(scope["path"])
            if match is not None:
                name = match.group(1)
                # What this request's task logs names it (the ids once the dataplane assigns them).
                token = log_context.bind(log_context.RequestLog(name, match.group(2)))
                try:
                    answer = await self.handler.answer(scope["app"].state.fleet, scope["headers"], None, receive,
                                                       name, match.group(2))
                    if answer is not None:
                        await _send(send, answer)
                finally:
                    log_context.unbind(token)
                return
        await self.app(scope, receive, send)


def answer_headers(answer: InferAnswer) -> list[tuple[bytes, bytes]]:
    """The answer's headers as both paths write them: content-type, content-length, the rest."""
    headers = answer.headers
    body = answer.body
    size = body.nbytes if isinstance(body, Parts) else len(body)
    return [headers[0], (b"content-length", b"%d" % size), *headers[1:]]


async def _send(send: Send, answer: InferAnswer) -> None:
    trace = answer.trace
    if trace is not None:
        trace.stamp(HTTP_SEND_START)
    await send({"type": "http.response.start", "status": answer.status, "headers": answer_headers(answer)})
    await send({"type": "http.response.body", "body": joined(answer.body)})
    if trace is not None:
        trace.stamp(HTTP_SEND_END)
        trace.finish()
