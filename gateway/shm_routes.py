"""Triton's shared-memory routes (system and CUDA) over HTTP: decoding only, the registry is
gateway/shared_memory.py. Status is GET, register and unregister are POST, as in Triton's http_server.cc;
a region name in the URL selects one region, none selects all. They sit in the auth scope `infer`
(gateway/auth.py): they only serve inference requests."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet.errors import InvalidInput
from gateway.routes import json_response, state_of
from gateway.shared_memory import SharedMemoryRegistry


def _registry(request: Request) -> SharedMemoryRegistry:
    return state_of(request).shared_memory


def _region(request: Request) -> str:
    return str(request.path_params.get("name", ""))


def _uint(doc: dict[str, Any], key: str) -> int:
    value = doc[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"Shared memory register request: '{key}' must be a non-negative integer")
    return value


async def _register_body(request: Request) -> tuple[str, int, int]:
    """(key, offset, byte_size) of a register request: {"key": str, "offset": uint (default 0),
    "byte_size": uint}, with Triton's texts for a missing field."""
    try:
        doc = json.loads((await request.body()).decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise InvalidInput("failed to parse the request JSON buffer: it is not UTF-8 JSON") from None
    if not isinstance(doc, dict):
        raise InvalidInput('a shared memory register request is a JSON object: {"key", "offset", "byte_size"}')
    if "key" not in doc:
        raise InvalidInput("Shared memory register request has no 'key' field")
    if not isinstance(doc["key"], str):
        raise InvalidInput("Shared memory register request: 'key' must be a string")
    if "byte_size" not in doc:
        raise InvalidInput("Shared memory register request has no 'byte_size' field")
    offset = _uint(doc, "offset") if "offset" in doc else 0
    return doc["key"], offset, _uint(doc, "byte_size")


async def system_status(request: Request) -> Response:
    return json_response(_registry(request).status(_region(request)))


async def system_register(request: Request) -> Response:
    name = _region(request)
    if not name:
        raise InvalidInput("'region name' is necessary to register system shared memory region")
    key, offset, byte_size = await _register_body(request)
    _registry(request).register(name, key, offset, byte_size)
    return Response(status_code=200, media_type="application/json")


async def system_unregister(request: Request) -> Response:
    _registry(request).unregister(_region(request))
    return Response(status_code=200, media_type="application/json")


async def cuda_status(request: Request) -> Response:
    return json_response(_registry(request).cuda_status(_region(request)))


async def cuda_register(request: Request) -> Response:
    name = _region(request)
    if not name:
        raise InvalidInput("'region name' is necessary to register cuda shared memory region")
    _registry(request).cuda_register(name)
    return Response(status_code=200, media_type="application/json")  # not reached: registering is refused


async def cuda_unregister(request: Request) -> Response:
    _registry(request).cuda_unregister(_region(request))
    return Response(status_code=200, media_type="application/json")


def _routes(kind: str, status: Any, register: Any, unregister: Any) -> list[Route]:
    base = f"/v2/{kind}sharedmemory"
    return [
        Route(f"{base}/status", status, methods=["GET"]),
        Route(f"{base}/region/{{name}}/status", status, methods=["GET"]),
        Route(f"{base}/register", register, methods=["POST"]),
        Route(f"{base}/region/{{name}}/register", register, methods=["POST"]),
        Route(f"{base}/unregister", unregister, methods=["POST"]),
        Route(f"{base}/region/{{name}}/unregister", unregister, methods=["POST"]),
    ]


ROUTES: list[Route] = [*_routes("system", system_status, system_register, system_unregister),
                       *_routes("cuda", cuda_status, cuda_register, cuda_unregister)]
