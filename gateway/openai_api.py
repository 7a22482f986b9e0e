"""OpenAI-compatible routes for generative models (`backend: "llm"`): `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions`, with and without `stream`, because that is what
LLM users' clients speak (the official `openai` package is the test).

Each request becomes an ordinary request to the model (its vLLM-style inputs: `text_input`,
`sampling_parameters` JSON; chat messages as the `chat_messages` parameter, rendered with the model's chat
template by the worker) and goes through the same data plane as /generate: lanes, timeouts, auth (the
`infer` scope), cancellation when the client goes away. Streams are OpenAI's server-sent events, ending
with `data: [DONE]`; errors are OpenAI's `{"error": {"message", "type", "code"}}`.

Defaults differ from OpenAI's in one place: sampling is greedy unless `temperature` is given (fleet's
rule for every generation route), so the same request gives the same text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleet import tensors
from fleet.envelope import ReplyEnvelope
from fleet.errors import InvalidInput, ModelNotFound, ModelUnloaded, ServingError, from_code
from fleet.generate_body import parse_generate_doc
from fleet.llm_spec import is_llm
from gateway.errors import status_for
from gateway.state import GatewayState

# OpenAI request fields passed on to the model's sampling; the others are refused unless listed as ignored.
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty", "ignore_eos")
_IGNORED = ("user", "logit_bias", "stream_options", "n", "presence_penalty", "frequency_penalty", "echo",
            "suffix", "best_of", "logprobs", "max_completion_tokens", "response_format", "tools", "tool_choice",
            "parallel_tool_calls", "top_logprobs", "metadata", "store", "service_tier")


def _state(request: Request) -> GatewayState:
    return request.app.state.fleet  # type: ignore[no-any-return]


def openai_error(exc: ServingError) -> Response:
    status = status_for(exc.code)
    code: str | int = status
    if isinstance(exc, (ModelNotFound, ModelUnloaded)):  # 404 as Triton's; OpenAI's clients read this code
        code = "model_not_found"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": exc.message, "type": kind, "param": "model" if status == 404 else None,
                                   "code": code}}, status_code=status)


async def list_models(request: Request) -> Response:
    catalog = _state(request).catalog
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "fleet"}
            for name, view in sorted(catalog.views.items())
            if is_llm(view.entry.spec) and catalog.ready_versions(name)]
    return JSONResponse({"object": "list", "data": data})


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


def _body(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise InvalidInput("the request body must be UTF-8 JSON") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the request body must be a JSON object")
    return doc


def _checked(doc: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The model request's generate body (gateway/generate.py maps it onto the model's inputs)."""
    if doc.get("n", 1) != 1 or doc.get("best_of", 1) not in (1, None):
        raise InvalidInput("only n = 1 is supported")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if doc.get(penalty) not in (None, 0, 0.0):
            raise InvalidInput(f"{penalty} is not supported (use repetition_penalty)")
    if doc.get("logprobs") not in (None, False, 0):
        raise InvalidInput("logprobs are not supported")
    known = {"model", "prompt", "messages", "stream", *_SAMPLING, *_IGNORED}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise InvalidInput(f"unsupported field(s): {', '.join(unknown)}")
    sampling = {k: doc[k] for k in _SAMPLING if doc.get(k) is not None}
    if doc.get("max_completion_tokens") is not None and "max_tokens" not in sampling:
        sampling["max_tokens"] = doc["max_completion_tokens"]
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidInput("'stream' must be a boolean")
    echo = bool(doc.get("echo", False)) and not chat
    sampling.update(stream=stream, exclude_input_in_output=not echo or stream)
    body: dict[str, Any] = {"sampling_parameters": json.dumps(sampling)}
    if chat:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("'messages' must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidInput("each message needs a 'role'")
            if isinstance(m.get("content"), list):  # content parts: the text ones, joined
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        body["parameters"] = {"chat_messages": json.dumps(messages)}
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            body["INPUT_IDS"] = prompt
        elif isinstance(prompt, str) and prompt:
            body["text_input"] = prompt
        else:
            raise InvalidInput("'prompt' must be a non-empty string or a list of token ids (one prompt)")
    return body


async def _complete(request: Request, chat: bool) -> Response:
    st = _state(request)
    try:
        doc = _body(await request.body())
        name = doc.get("model")
        if not isinstance(name, str) or not name:
            raise InvalidInput("'model' must name a model (GET /v1/models lists them)")
        view, v = st.catalog.resolve(name, None)
        spec = view.entry.spec
        if not is_llm(spec):
            raise ModelNotFound(name)
        req = parse_generate_doc(_checked(doc, chat), spec)
    except ServingError as exc:
        return openai_error(exc)
    stream = bool(doc.get("stream", False))
    usage_wanted = isinstance(doc.get("stream_options"), dict) and doc["stream_options"].get("include_usage")
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    try:
        st.dataplane.admit()
    except ServingError as exc:
        return openai_error(exc)
    replies = st.dataplane.replies(name, v, spec, req, gen=view.gen)
    if not stream:
        try:
            text, params = await _collect(replies)
        except ServingError as exc:
            return openai_error(exc)
        finally:
            st.dataplane.release()
        return JSONResponse(_document(ident, created, name, chat, text, params))
    try:
        first = await anext(replies)
        if not first.ok:
            raise from_code(first.error_code, first.error_message)
    except BaseException as exc:
        await replies.aclose()
        st.dataplane.release()
        if isinstance(exc, ServingError):
            return openai_error(exc)
        if isinstance(exc, StopAsyncIteration):
            return openai_error(InvalidInput("the model sent no response"))
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in _chunks(ident, created, name, chat, first, replies, bool(usage_wanted)):
                yield chunk
        finally:
            await replies.aclose()  # the client went away: the request is cancelled
            st.dataplane.release()

    return StreamingResponse(body(), media_type="text/event-stream; charset=utf-8")


def _text(reply: ReplyEnvelope) -> str:
    for t in reply.outputs or []:
        if t.name == "text_output":
            array = tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape)
            return "".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                           for v in np.asarray(array).reshape(-1).tolist())
    return ""


async def _collect(replies: AsyncGenerator[ReplyEnvelope, None]) -> tuple[str, dict[str, Any]]:
    parts: list[str] = []
    params: dict[str, Any] = {}
    async with aclosing(replies) as responses:
        async for reply in responses:
            if not reply.ok:
                raise from_code(reply.error_code, reply.error_message)
            parts.append(_text(reply))
            params.update(reply.parameters)
    return "".join(parts), params


def _usage(params: dict[str, Any]) -> dict[str, int]:
    prompt, completion = int(params.get("prompt_tokens", 0)), int(params.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(params: dict[str, Any]) -> str | None:
    reason = params.get("finish_reason")
    return reason if reason in ("stop", "length") else ("stop" if reason else None)


def _document(ident: str, created: int, model: str, chat: bool, text: str, params: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(params), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": _usage(params)}


async def _chunks(ident: str, created: int, model: str, chat: bool, first: ReplyEnvelope,
                  rest: AsyncIterator[ReplyEnvelope], usage_wanted: bool) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(doc: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        doc = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
        if usage_wanted:
            doc["usage"] = None
        return event(doc)

    if chat:
        yield chunk("", None, role=True)
    reply: ReplyEnvelope | None = first
    params: dict[str, Any] = {}
    try:
        while reply is not None:
            if not reply.ok:
                raise from_code(reply.error_code, reply.error_message)
            text = _text(reply)
            params.update(reply.parameters)
            if text:
                yield chunk(text, None)
            if reply.final:
                break
            reply = await anext(rest, None)
    except ServingError as exc:  # the stream has started: the error is an event
        yield event({"error": {"message": exc.message, "type": "server_error", "code": status_for(exc.code)}})
        yield b"data: [DONE]\n\n"
        return
    yield chunk(None if chat else "", _finish(params) or "stop")
    if usage_wanted:
        yield event({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                     "usage": _usage(params)})
    yield b"data: [DONE]\n\n"


ROUTES: list[Route] = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
