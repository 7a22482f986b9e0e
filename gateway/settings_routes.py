"""HTTP routes of Triton's logging and trace extensions; the work is in gateway/runtime_settings.py."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet.errors import InvalidInput
from gateway.routes import json_response, state_of


async def _body(request: Request) -> Any:
    """The POST body as JSON (an empty body changes nothing), or None for GET."""
    if request.method != "POST":
        return None
    body = await request.body()
    if not body.strip():
        return {}
    try:
        return json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise InvalidInput("failed to parse the request JSON buffer: it is not UTF-8 JSON") from None


async def logging_settings(request: Request) -> Response:
    return json_response(await state_of(request).runtime.log_settings(await _body(request)))


async def trace_settings(request: Request) -> Response:
    model = request.path_params.get("name")
    return json_response(await state_of(request).runtime.trace_settings(model, await _body(request)))


async def versioned_trace_settings(request: Request) -> Response:
    raise InvalidInput("trace settings apply to a model, not to one of its versions: use "
                       f"/v2/models/{request.path_params['name']}/trace/setting")


ROUTES: list[Route] = [
    Route("/v2/logging", logging_settings, methods=["GET", "POST"]),
    Route("/v2/trace/setting", trace_settings, methods=["GET", "POST"]),
    Route("/v2/models/{name}/trace/setting", trace_settings, methods=["GET", "POST"]),
    Route("/v2/models/{name}/versions/{version}/trace/setting", versioned_trace_settings, methods=["GET", "POST"]),
]
