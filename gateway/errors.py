"""THE ErrorCode -> status tables, HTTP and gRPC side by side, and the single HTTP handler that writes
`{"error": "..."}`. Where the protocols differ, Triton's own front ends differ the same way."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.errors import ErrorCode, ServingError
from gateway.grpc.status_codes import StatusCode

STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.INTERNAL: 500,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.FAILED_PRECONDITION: 409,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.UNKNOWN_MODEL: 404,  # tritonserver 2.51: 404 for metadata, config and infer (ready: 400)
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.UNKNOWN: 400,
}

# Triton maps its codes to gRPC's one to one (server src/grpc/grpc_utils.cc, protocol.md §7): a full
# queue, overload and a queue-policy timeout are UNAVAILABLE, an unsupported feature UNIMPLEMENTED.
GRPC_STATUS: dict[ErrorCode, StatusCode] = {
    ErrorCode.INVALID_ARG: StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: StatusCode.UNIMPLEMENTED,
    ErrorCode.INTERNAL: StatusCode.INTERNAL,
    ErrorCode.ALREADY_EXISTS: StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: StatusCode.CANCELLED,
    ErrorCode.DEADLINE_EXCEEDED: StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.FAILED_PRECONDITION: StatusCode.FAILED_PRECONDITION,
    # gRPC's own answer for a message over the size limit.
    ErrorCode.TOO_LARGE: StatusCode.RESOURCE_EXHAUSTED,
    # tritonserver 2.51 over gRPC: NOT_FOUND "Request for unknown model: 'x' is not found".
    ErrorCode.UNKNOWN_MODEL: StatusCode.NOT_FOUND,
    ErrorCode.UNAUTHENTICATED: StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: StatusCode.PERMISSION_DENIED,
    ErrorCode.UNKNOWN: StatusCode.UNKNOWN,
}


def status_for(code: ErrorCode) -> int:
    return STATUS.get(code, 500)


def grpc_status_for(code: ErrorCode) -> StatusCode:
    return GRPC_STATUS.get(code, StatusCode.INTERNAL)


def error_response(status: int, message: str, retry_after_s: int | None = None) -> Response:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def serving_error_response(exc: ServingError) -> Response:
    return error_response(status_for(exc.code), exc.message, exc.retry_after_s)


async def handle_serving_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServingError)
    return serving_error_response(exc)
