"""Triton's generate extension (protocol.md §1.11): `POST /v2/models/{m}/generate` and `.../generate_stream`.

Exact mapping, as Triton's: each top-level key of the JSON body (and each key of its `parameters`)
named like a model input becomes that input, its datatype from the config and its shape from the
config's dims with the wildcard dimensions filled from the element count (a batching model's batch
dimension is 1); every other key is a request parameter. A response is one JSON object: `model_name`,
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

import numpy as np

from fleet import tensors
from fleet.envelope import ReplyEnvelope, WireTensor
from fleet.errors import InferenceFailed, InvalidInput, ServingError, from_code
from fleet.kserve import ParsedInfer, check_input, check_input_set, check_parameters, sequence_flags
from fleet.model_config import ModelSpec, TensorSpec


def parse_generate(body: bytes, spec: ModelSpec) -> ParsedInfer:
    try:
        doc = json.loads(body.decode("utf-8")) if body.strip() else {}
    except (ValueError, RecursionError):
        raise InvalidInput("failed to parse the request JSON buffer: it is not UTF-8 JSON") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the generate request must be a JSON object")
    client_id = doc.pop("id", "")
    if not isinstance(client_id, str):
        raise InvalidInput("'id' must be a string")
    nested = doc.pop("parameters", {})
    if not isinstance(nested, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    inputs: list[WireTensor] = []
    params: dict[str, Any] = {}
    batch: int | None = None
    for key, value in [*doc.items(), *nested.items()]:
        ts = spec.input(key)
        if ts is None:
            params[key] = value
            continue
        tensor = _tensor(spec, ts, value)
        _, _, batch = check_input(spec, inputs, key, tensor.datatype, list(tensor.shape), batch)
        inputs.append(tensor)
    check_input_set(spec, inputs, batch)
    passthrough, priority, timeout_us, _ = check_parameters(params, spec)
    return ParsedInfer(client_id, inputs, None, frozenset(), False, passthrough, priority, timeout_us,
                       sequence=sequence_flags(params, spec, inputs))


def _tensor(spec: ModelSpec, ts: TensorSpec, value: Any) -> WireTensor:
    dt = ts.datatype
    try:
        if dt.name == "BYTES":
            flat = np.array(value, dtype=object).reshape(-1)
            if not all(isinstance(v, str) for v in flat):
                raise InvalidInput(f"input '{ts.name}' is BYTES: give text")
            array = np.array([v.encode() for v in flat] or [], dtype=object)
        else:
            array = np.array(value, dtype=dt.numpy).reshape(-1)
    except (ValueError, TypeError, OverflowError):
        raise InvalidInput(f"input '{ts.name}' cannot be read as {dt.name}: {value!r:.80}") from None
    shape = _shape(spec.metadata_shape(ts), array.size)
    if shape is None:
        raise InvalidInput(f"input '{ts.name}': {array.size} elements do not fit its shape "
                           f"{spec.metadata_shape(ts)}")
    return WireTensor(ts.name, dt.name, tuple(shape), tensors.to_bytes(array.reshape(shape), dt))


def _shape(dims: list[int], count: int) -> list[int] | None:
    """The metadata dims with each -1 filled: a leading batch dimension gets 1, the first other wildcard
    what the element count leaves, any further ones 1."""
    shape = list(dims)
    batched = bool(shape) and shape[0] == -1 and len(shape) > 1
    if batched:
        shape[0] = 1
    known = int(np.prod([d for d in shape if d != -1])) if shape else 1
    wild = [i for i, d in enumerate(shape) if d == -1]
    for n, i in enumerate(wild):
        shape[i] = (count // known if known and count % known == 0 else -1) if n == 0 else 1
    if any(d < 0 for d in shape) or int(np.prod(shape)) != count:
        return None
    return shape


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
