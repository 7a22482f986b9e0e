"""Every RPC of inference.GRPCInferenceService, as grpc.aio handlers around gateway/grpc/service.py.

Built from the service's descriptor in tritonclient's own generated module, so every RPC of the proto
is registered: the service's method where it has one, else UNIMPLEMENTED with not_yet.py's reason.
Around each: auth (the `authorization` metadata key, the same keys and scopes as HTTP: each RPC has
the scope of the HTTP route that does the same, gateway/auth.py), request parsing (requests arrive as
bytes, so a malformed message is our INVALID_ARGUMENT, not grpcio's INTERNAL "Exception deserializing
request!"), and the one mapping of ServingError to a status (gateway/errors.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from fleet.errors import ServingError, Unsupported
from gateway.auth import Access, scope_of
from gateway.errors import grpc_status_for
from gateway.grpc.codec import parse_message
from gateway.grpc.not_yet import NOT_YET
from gateway.grpc.service import InferenceService

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


def _authorization(context: Any) -> bytes | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else bytes(value)
    return None


def _not_yet(reason: str) -> Callable[[Any, Any], Awaitable[Any]]:
    async def unimplemented(request: Any, context: Any) -> Any:
        raise Unsupported(reason)
    return unimplemented


def _unary(name: str, impl: Callable[[Any, Any], Awaitable[Any]], request_type: Any, area: str | None,
           access: Access) -> Any:
    guarded = access.guards(area)

    async def behavior(raw: bytes, context: Any) -> bytes:
        try:
            if guarded:
                access.check(area, _authorization(context))
            response = await impl(parse_message(request_type, raw), context)
            return bytes(response.SerializeToString())
        except ServingError as exc:
            code, message = grpc_status_for(exc.code), exc.message
        except Exception as exc:  # never take the server down: INTERNAL, and the log says what
            log.exception("gRPC %s failed", name)
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
        await context.abort(code, message)
        raise AssertionError("context.abort raises")

    return grpc.unary_unary_rpc_method_handler(behavior)


def _bidi(impl: Callable[[AsyncIterator[bytes], Any], AsyncGenerator[bytes, None]], area: str | None,
          access: Access) -> Any:
    guarded = access.guards(area)

    async def behavior(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        if guarded:
            try:
                access.check(area, _authorization(context))
            except ServingError as exc:
                await context.abort(grpc_status_for(exc.code), exc.message)
        answers = impl(requests, context)
        try:
            async for answer in answers:
                yield answer
        finally:
            # Closed at once however the call ends (a client that went away included), so what the stream
            # still has in flight is cancelled now, not whenever the generator is collected.
            await answers.aclose()

    return grpc.stream_stream_rpc_method_handler(behavior)


def generic_handler(service: InferenceService, access: Access) -> Any:
    """The grpc.GenericRpcHandler serving every RPC of the proto over `service`."""
    handlers: dict[str, Any] = {}
    for method in SERVICE.methods:
        area = scope_of(HTTP_TWIN[method.name])
        impl = getattr(service, method.name, None)
        if method.client_streaming or method.server_streaming:
            assert impl is not None, f"{method.name}: only ModelStreamInfer streams, and it is served"
            handlers[method.name] = _bidi(impl, area, access)
            continue
        if impl is None:
            impl = _not_yet(NOT_YET[method.name])
        handlers[method.name] = _unary(method.name, impl, getattr(pb, method.input_type.name), area, access)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
