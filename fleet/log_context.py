"""What a log line is about: the request (or batch of requests) the code that logs it is handling.

One contextvar per thread / asyncio task. The gateway binds a `RequestLog` where it starts handling an
infer request (each request is its own task, so the binding ends with it); a worker binds a `BatchLog`
around each batch it executes (an instance thread), and a Python model's stub around each execute().
The formatters (fleet/log_format.py) read it only when a line is written, so a request that logs
nothing pays for one small object and one `ContextVar.set`, and a batch's request ids are listed only
for a line that is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar, Token
from typing import Protocol

# The names a line's context takes in a JSON line and after a text line; also the `extra=` keys a call
# site may pass to name a request the context does not.
FIELDS = ("model", "version", "request_id", "request_ids")


class RequestLog:
    """One request: its model, the version asked for (a string from the URL until resolved, then the
    version number), and fleet's request id once the gateway assigned one (the id the worker's lines and
    traces carry too)."""

    __slots__ = ("model", "version", "request_id")

    def __init__(self, model: str, version: str | int | None = None, request_id: str | None = None) -> None:
        self.model = model
        self.version = version
        self.request_id = request_id

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"model": self.model}
        v = self.version
        if v is not None and v != "":
            out["version"] = int(v) if isinstance(v, str) and v.isdigit() else v
        if self.request_id is not None:
            out["request_id"] = self.request_id
        return out


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


class BatchLog:
    """A batch of one model version's requests; `requests` are anything with an `id` (envelopes), read
    only when a line is written."""

    __slots__ = ("model", "version", "requests")

    def __init__(self, model: str, version: int, requests: Sequence[_HasId]) -> None:
        self.model = model
        self.version = version
        self.requests = requests

    def fields(self) -> dict[str, object]:
        return {"model": self.model, "version": self.version, "request_ids": [r.id for r in self.requests]}


class IdsOnly:
    """A request id where only ids are at hand (a stub's execute() gets the worker's keys)."""

    __slots__ = ("id",)

    def __init__(self, request_id: str) -> None:
        self.id = request_id


_CURRENT: ContextVar[RequestLog | BatchLog | None] = ContextVar("fleet_log_context", default=None)


def bind(context: RequestLog | BatchLog | None) -> Token[RequestLog | BatchLog | None]:
    """Lines logged from here on in this thread / task (and tasks it starts) are about `context`."""
    return _CURRENT.set(context)


def unbind(token: Token[RequestLog | BatchLog | None]) -> None:
    _CURRENT.reset(token)


def name_request(model: str, version: int, request_id: str) -> None:
    """The request being handled got its fleet id and resolved version. Only the request the task was
    bound for is named: an ensemble's steps, submitted from the same task, are requests of other models."""
    current = _CURRENT.get()
    if isinstance(current, RequestLog) and current.model == model and current.request_id is None:
        current.version = version
        current.request_id = request_id


def current_fields() -> dict[str, object]:
    """The fields of what is bound now; empty when nothing is."""
    current = _CURRENT.get()
    return {} if current is None else current.fields()
