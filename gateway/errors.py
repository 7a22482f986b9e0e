"""THE ErrorCode -> HTTP status table and the single handler that writes `{"error": "..."}`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.errors import ErrorCode, ServingError

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
    ErrorCode.UNKNOWN: 400,
}


def status_for(code: ErrorCode) -> int:
    return STATUS.get(code, 500)


def error_response(status: int, message: str, retry_after_s: int | None = None) -> Response:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def serving_error_response(exc: ServingError) -> Response:
    return error_response(status_for(exc.code), exc.message, exc.retry_after_s)


async def handle_serving_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServingError)
    return serving_error_response(exc)
