"""Triton's generate extension (protocol.md §1.11): `POST /v2/models/{m}/generate` and `.../generate_stream`.

The body becomes a request as fleet/generate_body.py says. A response is one JSON object: `model_name`,
`model_version`, the request's `id` if it had one, one key per output (a single element as a scalar,
else a flat list; BYTES as text) and one per response parameter.

/generate wants exactly one response from the model; /generate_stream sends each as a server-sent
event (`data: {...}\\n\\n`) as its worker writes it, an error as `data: {"error": "..."}` once the stream
has started, and ends after the final response. A client that goes away cancels the request
(DataPlane.responses: dropped if still queued, `request.is_cancelled()` in the model).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fleet import tensors
from fleet.envelope import ReplyEnvelope
from fleet.errors import InferenceFailed, ServingError, from_code


def render_generate(model: str, version: int, client_id: str, reply: ReplyEnvelope) -> dict[str, Any]:
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    if client_id:
        doc["id"] = client_id
    for t in reply.outputs or []:
        array = tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape)
        flat = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        doc[t.name] = flat[0] if len(flat) == 1 else flat
    doc.update(reply.parameters)
    return doc


async def single(responses: AsyncGenerator[ReplyEnvelope, None]) -> ReplyEnvelope:
    """/generate: the model's one response, or why there is not exactly one."""
    got: list[ReplyEnvelope] = []
    async with aclosing(responses) as replies:  # an error reply ends the request at once
        async for reply in replies:
            if not reply.ok:
                raise_reply(reply)
            if not reply.empty:
                got.append(reply)
    if len(got) != 1:
        raise InferenceFailed("generate expects model to produce exactly 1 response")
    return got[0]


def raise_reply(reply: ReplyEnvelope) -> None:
    raise from_code(reply.error_code, reply.error_message)


async def events(model: str, version: int, client_id: str, first: ReplyEnvelope | None,
                 rest: AsyncIterator[ReplyEnvelope]) -> AsyncIterator[bytes]:
    """The SSE body: `first` (already read, to choose the status) then the rest, each as it comes."""

    def event(reply: ReplyEnvelope) -> bytes | None:
        if not reply.ok:
            doc: dict[str, Any] = {"error": reply.error_message}
        elif reply.empty:
            return None
        else:
            doc = render_generate(model, version, client_id, reply)
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    try:
        if first is not None:
            data = event(first)
            if data is not None:
                yield data
        async for reply in rest:
            data = event(reply)
            if data is not None:
                yield data
    except ServingError as exc:  # the stream has started: the error is an event
        yield b"data: " + json.dumps({"error": exc.message}).encode() + b"\n\n"
