"""BLS inside the stub: `pb_utils.InferenceRequest.exec()`, `async_exec()` and `stream_exec()` as calls
to the worker over the stub's pipe (workers/backends/stub_channel.py). The worker queues each on the
callee's stream, so it batches with the callee's other traffic on whichever worker has room
(workers/bls.py), and sends the reply back: one `bls_reply` frame, or one per response of a decoupled
callee, the last marked `final`.

A decoupled call returns an iterator over the responses as they arrive (from `await async_exec(
decoupled=True)` too, as in Triton). A final response that carries nothing (the callee sent the final
flag on its own) is not yielded, so a loop that reads an output of every response works as Triton's
examples expect.
"""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import Iterator
from typing import Any

import numpy as np

from fleet import tensors
from workers.backends.stub_channel import StubChannel

# fleet's error codes that pb_utils.TritonError has no name for.
_CODES = {"UNKNOWN_MODEL": "NOT_FOUND", "DEADLINE_EXCEEDED": "UNAVAILABLE", "TOO_LARGE": "INVALID_ARG",
          "FAILED_PRECONDITION": "UNAVAILABLE"}


def encode_request(request: Any) -> dict[str, Any]:
    inputs = []
    for t in request.inputs():
        arr = np.asarray(t.as_numpy())
        dt = tensors.lookup(t._datatype())
        inputs.append([t.name(), dt.name, list(arr.shape), tensors.to_bytes(arr, dt)])
    return {"model": request.model_name(), "version": int(request._model_version), "i": inputs,
            "o": list(request.requested_output_names()), "p": json.loads(request.parameters() or "{}"),
            "id": request.request_id(), "timeout_us": int(request.timeout() or 0)}


def decode_response(pb: Any, msg: dict[str, Any]) -> Any:
    if "e" in msg:
        name, text = msg["e"]
        code = getattr(pb.TritonError, _CODES.get(name, name), pb.TritonError.INTERNAL)
        return pb.InferenceResponse(error=pb.TritonError(text, code))
    outputs = []
    for name, datatype, shape, data in msg.get("o") or []:
        dt = tensors.lookup(datatype)
        array = tensors.from_bytes(data, dt, tuple(shape))
        if dt.name not in ("BYTES", "BF16"):
            array = array.copy()  # writable, as a model gets its inputs
        outputs.append(pb.Tensor(name, array, pb._FROM_NAME[dt.name]))
    params = msg.get("p")
    return pb.InferenceResponse(outputs, parameters=json.dumps(params) if params else None)


def _empty_final(msg: dict[str, Any]) -> bool:
    return bool(msg.get("final", True)) and "e" not in msg and not msg.get("o") and not msg.get("p")


class BlsCaller:
    """Installed as pb_utils' `_bls_executor` / `_bls_async_executor` by the stub."""

    def __init__(self, channel: StubChannel, pb: Any) -> None:
        self._channel = channel
        self._pb = pb

    def _frame(self, request: Any, decoupled: bool) -> dict[str, Any]:
        if not request.model_name():
            raise self._pb.TritonModelException("a BLS request needs a model_name")
        return {"op": "bls", "req": encode_request(request), "decoupled": decoupled}

    def exec(self, request: Any, decoupled: bool) -> Any:
        replies: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        n = self._channel.call(self._frame(request, decoupled), replies.put)
        if decoupled:
            return self._responses(n, replies)
        try:
            return decode_response(self._pb, replies.get())
        finally:
            self._channel.forget(n)

    def _responses(self, n: int, replies: queue.SimpleQueue[dict[str, Any]]) -> Iterator[Any]:
        try:
            while True:
                msg = replies.get()
                if not _empty_final(msg):
                    yield decode_response(self._pb, msg)
                if msg.get("final", True):
                    return
        finally:
            self._channel.forget(n)

    async def async_exec(self, request: Any, decoupled: bool) -> Any:
        if decoupled:  # Triton's async decoupled call also hands back a plain iterator
            return self.exec(request, True)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()

        def settle(msg: dict[str, Any]) -> None:
            if not future.done():
                future.set_result(msg)

        def arrived(msg: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(settle, msg)

        n = self._channel.call(self._frame(request, False), arrived)
        try:
            return decode_response(self._pb, await future)
        finally:
            self._channel.forget(n)
