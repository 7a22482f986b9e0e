"""ModelStreamInfer: a bidirectional stream of ModelInferRequests.

Every request read from a stream starts at once, so many are in flight on one stream. As in tritonserver,
a request's one response (a model that is not decoupled, or an error before its model is known) goes back
in the order the requests came, after those of the requests before it; a decoupled model's request gets
each of its responses as it comes (service.py's infer_stream), waiting for no one. A request
that fails is answered with `error_message` (and its id, as tritonserver fills it in) and the stream
stays open. Each request takes one of the gateway's `max_in_flight` places like any other.

The stream ends when the client closes its side and every request read is answered; when the client
cancels (or its deadline passes), the requests still in flight are cancelled as an HTTP disconnect
cancels one (deleted from their queue, never computed if not started). When the server stops, streams
read no more requests and end once what they read is answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fleet.errors import ServingError
from gateway.dataplane import DataPlane
from gateway.grpc.codec import parse_message
from gateway.grpc.service_proto import service_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    """One answer to a request of a stream: a ModelInferResponse or an error message, or neither (a
    decoupled model's final flag that sends nothing); `last` once the request is complete."""

    response: Any
    error: str | None
    last: bool
    in_order: bool = True  # False: a decoupled model's, written as it comes


Answers = Callable[[Any, float | None], AsyncIterator[StreamAnswer]]


class _Stream:
    """One open stream: answers waiting to be written, and what is still being computed."""

    __slots__ = ("answers", "computing", "tasks", "turn")

    def __init__(self) -> None:
        # None: no more requests will be read; b"": nothing to write, look again whether the stream is done.
        self.answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.computing = 0  # requests read and not yet answered
        self.tasks: set[asyncio.Task[None]] = set()
        # Done once the last request read has queued its in-order answer (or needs none): the next waits on it.
        self.turn: asyncio.Future[None] | None = None


class StreamSessions:
    """The open ModelStreamInfer streams of one server. `answers(request, timeout_s)` yields the answers
    to one ModelInferRequest (one, or a decoupled model's many), or raises a ServingError."""

    def __init__(self, answers: Answers, dataplane: DataPlane) -> None:
        self._answers = answers
        self._dataplane = dataplane
        self._readers: set[asyncio.Task[None]] = set()
        self._draining = False

    def drain(self) -> None:
        self._draining = True
        for reader in list(self._readers):
            reader.cancel()

    async def serve(self, requests: AsyncIterator[bytes], context: Any) -> AsyncGenerator[bytes, None]:
        """The serialized ModelStreamInferResponses of one stream: one-response requests' in the order they
        came, a decoupled model's as they come."""
        if self._draining:
            return  # the server is stopping: a stream opened now reads nothing
        stream = _Stream()
        reader = asyncio.ensure_future(self._read(requests, context, stream))
        # However reading ends (the client's side closed or failed, the server drains: a cancel that
        # may come before the reader ever ran), the writer below learns it.
        reader.add_done_callback(lambda _: stream.answers.put_nowait(None))
        self._readers.add(reader)
        try:
            reading = True
            while reading or stream.computing or not stream.answers.empty():
                answer = await stream.answers.get()
                if answer is None:
                    reading = False
                elif answer:
                    yield answer
        finally:
            # Normally nothing is left; when the client went away, what it still waits for is cancelled.
            self._readers.discard(reader)
            reader.cancel()
            for task in list(stream.tasks):
                task.cancel()

    async def _read(self, requests: AsyncIterator[bytes], context: Any, stream: _Stream) -> None:
        try:
            loop = asyncio.get_running_loop()
            async for raw in requests:
                stream.computing += 1
                after, stream.turn = stream.turn, loop.create_future()
                task = asyncio.ensure_future(self._answer(raw, context.time_remaining(), stream, after, stream.turn))
                stream.tasks.add(task)
                task.add_done_callback(stream.tasks.discard)
        except Exception as exc:  # the client's side failed (reset, cancelled): the stream ends
            log.debug("ModelStreamInfer: reading requests stopped: %r", exc)

    async def _answer(self, raw: bytes, timeout_s: float | None, stream: _Stream, after: asyncio.Future[None] | None,
                      turn: asyncio.Future[None]) -> None:
        """Queue the answers to one request; `after` is the turn of the request before it, `turn` its own."""
        counted = True
        try:
            async for answer, last, in_order in self._respond(raw, timeout_s):
                if not in_order:
                    _pass_on(after, turn)  # a decoupled model's: the next waits for the one before it, not this
                elif after is not None and not after.done():
                    await asyncio.wait([after])  # (a wait, not an await: a cancel here must not cancel it)
                if last:
                    stream.computing -= 1  # before the answer is queued, so the writer never waits for nothing
                    counted = False
                if answer is not None:
                    stream.answers.put_nowait(answer)
                elif last:
                    # A final flag that sends nothing: the writer, waiting for an answer, must still look
                    # again whether the stream is done (the client may have closed its side already).
                    stream.answers.put_nowait(b"")
        finally:
            _pass_on(after, turn)
            if counted:
                stream.computing -= 1
                stream.answers.put_nowait(b"")

    async def _respond(self, raw: bytes, timeout_s: float | None
                       ) -> AsyncGenerator[tuple[bytes | None, bool, bool], None]:
        request_id = ""
        try:
            request = parse_message(pb.ModelInferRequest, raw)
            request_id = request.id
            self._dataplane.admit()
            released = False
            try:
                async for answer in self._answers(request, timeout_s):
                    if answer.last:  # done: its place is free while its answer may wait for its turn
                        self._dataplane.release()
                        released = True
                    if answer.error is not None:
                        error = pb.ModelStreamInferResponse(error_message=answer.error,
                                                            infer_response=pb.ModelInferResponse(id=request_id))
                        yield bytes(error.SerializeToString()), answer.last, answer.in_order
                    elif answer.response is None:
                        yield None, answer.last, answer.in_order
                    else:
                        response = pb.ModelStreamInferResponse(infer_response=answer.response)
                        yield bytes(response.SerializeToString()), answer.last, answer.in_order
            finally:
                if not released:
                    self._dataplane.release()
            return
        except ServingError as exc:
            message = exc.message
        except Exception as exc:  # one request's failure must not end the stream
            log.exception("a ModelStreamInfer request failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
        error = pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(id=request_id))
        yield bytes(error.SerializeToString()), True, True


def _pass_on(after: asyncio.Future[None] | None, turn: asyncio.Future[None]) -> None:
    """`turn` done once `after` is (at once if it is): what comes next waits for what came before."""
    if turn.done():
        return
    if after is None or after.done():
        turn.set_result(None)
    else:
        after.add_done_callback(lambda _: _pass_on(None, turn))
