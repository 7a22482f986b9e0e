"""Every RPC of inference.GRPCInferenceService, as handlers of gateway/grpc/calls.py around
gateway/grpc/service.py.

Built from the service's descriptor in tritonclient's own generated module, so every RPC of the proto
is registered: the service's method where it has one, else UNIMPLEMENTED with not_yet.py's reason.
Around each: auth (the `authorization` metadata key, the same keys and scopes as HTTP: each RPC has
the scope of the HTTP route that does the same, gateway/auth.py), request parsing (a malformed message is
INVALID_ARGUMENT), and the one mapping of ServingError to a status (gateway/errors.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.errors import ServingError, Unsupported
from gateway.auth import Access, scope_of
from gateway.errors import grpc_status_for
from gateway.grpc.codec import parse_message
from gateway.grpc.not_yet import NOT_YET
from gateway.grpc.service import InferenceService
from gateway.grpc.service_proto import service_pb2 as pb
from gateway.grpc.status_codes import StatusCode

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME = SERVICE.full_name  # "inference.GRPCInferenceService"

# Each RPC's HTTP twin, whose auth scope it shares (gateway/auth.py scope_of): health stays open.
HTTP_TWIN: dict[str, str] = {
    "ServerLive": "/v2/health/live",
    "ServerReady": "/v2/health/ready",
    "ModelReady": "/v2/models/NAME/ready",
    "ServerMetadata": "/v2",
    "ModelMetadata": "/v2/models/NAME",
    "ModelInfer": "/v2/models/NAME/infer",
    "ModelStreamInfer": "/v2/models/NAME/infer",
    "ModelConfig": "/v2/models/NAME/config",
    "ModelStatistics": "/v2/models/stats",
    "RepositoryIndex": "/v2/repository/index",
    "RepositoryModelLoad": "/v2/repository/models/NAME/load",
    "RepositoryModelUnload": "/v2/repository/models/NAME/unload",
    "SystemSharedMemoryStatus": "/v2/systemsharedmemory/status",
    "SystemSharedMemoryRegister": "/v2/systemsharedmemory/region/NAME/register",
    "SystemSharedMemoryUnregister": "/v2/systemsharedmemory/unregister",
    "CudaSharedMemoryStatus": "/v2/cudasharedmemory/status",
    "CudaSharedMemoryRegister": "/v2/cudasharedmemory/region/NAME/register",
    "CudaSharedMemoryUnregister": "/v2/cudasharedmemory/unregister",
    "TraceSetting": "/v2/trace/setting",
    "LogSettings": "/v2/logging",
}


class RpcError(Exception):
    """The status a call ends with (gRPC's numeric code and its message)."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CallContext(Protocol):
    """What a handler reads of its call (gateway/grpc/calls.py provides it)."""

    def time_remaining(self) -> float | None: ...

    def invocation_metadata(self) -> list[tuple[str, str]]: ...

    @property
    def authorization(self) -> bytes | None: ...


Unary = Callable[[bytes, CallContext], Awaitable[bytes]]
Streaming = Callable[[AsyncIterator[bytes], CallContext], AsyncGenerator[bytes, None]]


@dataclass(frozen=True)
class Method:
    """One RPC: exactly one of `unary` (request bytes -> response bytes) or `streaming` (request bytes
    as they come -> response bytes as they are ready)."""

    name: str
    unary: Unary | None = None
    streaming: Streaming | None = None


def _not_yet(reason: str) -> Callable[[Any, Any], Awaitable[Any]]:
    async def unimplemented(request: Any, context: Any) -> Any:
        raise Unsupported(reason)
    return unimplemented


def _unary(impl: Callable[[Any, Any], Awaitable[Any]], request_type: Any, area: str | None,
           access: Access) -> Unary:
    guarded = access.guards(area)

    async def behavior(raw: bytes, context: CallContext) -> bytes:
        try:
            if guarded:
                access.check(area, context.authorization)
            response = await impl(parse_message(request_type, raw), context)
            # (ModelInfer may answer with the response serialized already: gateway/grpc/response_heads.py)
            return response if type(response) is bytes else bytes(response.SerializeToString())
        except ServingError as exc:
            raise RpcError(grpc_status_for(exc.code), exc.message) from None

    return behavior


def _bidi(impl: Callable[[AsyncIterator[bytes], Any], AsyncGenerator[bytes, None]], area: str | None,
          access: Access) -> Streaming:
    guarded = access.guards(area)

    async def behavior(requests: AsyncIterator[bytes], context: CallContext) -> AsyncGenerator[bytes, None]:
        if guarded:
            try:
                access.check(area, context.authorization)
            except ServingError as exc:
                raise RpcError(grpc_status_for(exc.code), exc.message) from None
        answers = impl(requests, context)
        try:
            async for answer in answers:
                yield answer
        finally:
            # Closed at once however the call ends (a client that went away included), so what the stream
            # still has in flight is cancelled now, not whenever the generator is collected.
            await answers.aclose()

    return behavior


def methods(service: InferenceService, access: Access) -> dict[str, Method]:
    """Every RPC of the proto over `service`, by its HTTP/2 path (/inference.GRPCInferenceService/NAME)."""
    table: dict[str, Method] = {}
    for method in SERVICE.methods:
        area = scope_of(HTTP_TWIN[method.name])
        impl = getattr(service, method.name, None)
        path = f"/{SERVICE_NAME}/{method.name}"
        if method.client_streaming or method.server_streaming:
            assert impl is not None, f"{method.name}: only ModelStreamInfer streams, and it is served"
            table[path] = Method(method.name, streaming=_bidi(impl, area, access))
            continue
        if impl is None:
            impl = _not_yet(NOT_YET[method.name])
        table[path] = Method(method.name, unary=_unary(impl, getattr(pb, method.input_type.name), area, access))
    return table
