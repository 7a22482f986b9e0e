"""ModelStreamInfer: a bidirectional stream of ModelInferRequests, each answered as it completes.

Every request read from a stream starts at once, so many are in flight on one stream; answers go back
in the order they complete, each with its request's id (Triton's decoupled-free streaming). A request
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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from fleet.errors import ServingError
from gateway.dataplane import DataPlane
from gateway.grpc.codec import parse_message

log = logging.getLogger(__name__)


class _Stream:
    """One open stream: answers waiting to be written, and what is still being computed."""

    __slots__ = ("answers", "computing", "tasks")

    def __init__(self) -> None:
        self.answers: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: no more requests will be read
        self.computing = 0  # requests read and not yet answered
        self.tasks: set[asyncio.Task[None]] = set()


class StreamSessions:
    """The open ModelStreamInfer streams of one server. `infer(request, timeout_s)` answers one
    ModelInferRequest with its ModelInferResponse, or raises a ServingError."""

    def __init__(self, infer: Callable[[Any, float | None], Awaitable[Any]], dataplane: DataPlane) -> None:
        self._infer = infer
        self._dataplane = dataplane
        self._readers: set[asyncio.Task[None]] = set()
        self._draining = False

    def drain(self) -> None:
        self._draining = True
        for reader in list(self._readers):
            reader.cancel()

    async def serve(self, requests: AsyncIterator[bytes], context: Any) -> AsyncGenerator[bytes, None]:
        """The serialized ModelStreamInferResponses of one stream, as its requests complete."""
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
                else:
                    yield answer
        finally:
            # Normally nothing is left; when the client went away, what it still waits for is cancelled.
            self._readers.discard(reader)
            reader.cancel()
            for task in list(stream.tasks):
                task.cancel()

    async def _read(self, requests: AsyncIterator[bytes], context: Any, stream: _Stream) -> None:
        try:
            async for raw in requests:
                stream.computing += 1
                task = asyncio.ensure_future(self._answer(raw, context.time_remaining(), stream))
                stream.tasks.add(task)
                task.add_done_callback(stream.tasks.discard)
        except Exception as exc:  # the client's side failed (reset, cancelled): the stream ends
            log.debug("ModelStreamInfer: reading requests stopped: %r", exc)

    async def _answer(self, raw: bytes, timeout_s: float | None, stream: _Stream) -> None:
        try:
            answer = await self._respond(raw, timeout_s)
        finally:
            stream.computing -= 1  # before the answer is queued, so the writer never waits for nothing
        stream.answers.put_nowait(answer)

    async def _respond(self, raw: bytes, timeout_s: float | None) -> bytes:
        request_id = ""
        try:
            request = parse_message(pb.ModelInferRequest, raw)
            request_id = request.id
            self._dataplane.admit()
            try:
                response = await self._infer(request, timeout_s)
            finally:
                self._dataplane.release()
            return bytes(pb.ModelStreamInferResponse(infer_response=response).SerializeToString())
        except ServingError as exc:
            message = exc.message
        except Exception as exc:  # one request's failure must not end the stream
            log.exception("a ModelStreamInfer request failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
        error = pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(id=request_id))
        return bytes(error.SerializeToString())
