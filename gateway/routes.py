"""KServe v2 REST routes with Triton's extensions. HTTP only: everything else is in dataplane/catalog.

Every route is a plain Starlette endpoint (no FastAPI dependency layer): the infer route is the hot
path, and design.md measured FastAPI's per-route layer at up to 2x the cost of a bare handler.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleet.errors import InvalidInput, ModelNotReady, Unsupported, VersionNotFound
from gateway.state import GatewayState

SERVER_VERSION = "2.51.0"
EXTENSIONS = ["model_repository", "schedule_policy", "model_configuration", "binary_tensor_data",
              "parameters", "statistics"]


def state_of(request: Request) -> GatewayState:
    return request.app.state.fleet  # type: ignore[no-any-return]


def _version(request: Request) -> str | None:
    version = request.path_params.get("version")
    if version is None or version == "":
        return None
    if not version.isdigit():
        raise VersionNotFound(request.path_params["name"], version)
    return str(version)


def json_response(doc: Any, status: int = 200) -> Response:
    return Response(json.dumps(doc, separators=(",", ":")), status_code=status, media_type="application/json")


async def live(request: Request) -> Response:
    return json_response({"live": True})


async def ready(request: Request) -> Response:
    st = state_of(request)
    try:
        await st.broker.ping()
    except Exception:
        return json_response({"ready": False, "error": "Redis is not reachable"}, 400)
    if not st.catalog.all_ready():
        return json_response({"ready": False, "error": "not every model has a ready worker"}, 400)
    return json_response({"ready": True})


async def server_metadata(request: Request) -> Response:
    return json_response({"name": "triton", "version": SERVER_VERSION, "extensions": EXTENSIONS,
                  "server": "fleet"})


async def model_metadata(request: Request) -> Response:
    st = state_of(request)
    name = request.path_params["name"]
    version = _version(request)
    view = st.catalog.view(name)
    if version is not None:
        if int(version) not in view.entry.versions:
            raise VersionNotFound(name, version)
        versions = [version]
    else:
        ready = st.catalog.ready_versions(name) or list(view.entry.versions)
        versions = [str(v) for v in ready]
    return json_response({
        "name": name,
        "versions": versions,
        "platform": view.entry.spec.metadata_platform,
        "inputs": view.metadata_inputs,
        "outputs": view.metadata_outputs,
    })


async def model_ready(request: Request) -> Response:
    st = state_of(request)
    try:
        st.catalog.resolve(request.path_params["name"], _version(request))
    except ModelNotReady:
        return JSONResponse({"error": "Model version not ready"}, status_code=400)
    return json_response({"name": request.path_params["name"], "ready": True})


async def model_config(request: Request) -> Response:
    st = state_of(request)
    name = request.path_params["name"]
    view = st.catalog.view(name)
    version = _version(request)
    if version is not None and int(version) not in view.entry.versions:
        raise VersionNotFound(name, version)
    return json_response(view.config_json)


async def model_stats(request: Request) -> Response:
    st = state_of(request)
    name = request.path_params.get("name")
    doc = await st.statistics(name, _version(request) if name else None)
    return json_response(doc)


async def infer(request: Request) -> Response:
    """Never reached for POST: gateway.fastpath answers every infer request before routing. The route
    exists so other methods on an infer URL get Triton's 405."""
    raise InvalidInput("infer requests are served by the fast path")


async def repository_index(request: Request) -> Response:
    st = state_of(request)
    body = await request.body()
    only_ready = False
    if body.strip():
        try:
            only_ready = bool(json.loads(body).get("ready", False))
        except (ValueError, AttributeError) as exc:
            raise InvalidInput(f"failed to parse the request JSON buffer: {exc}") from exc
    items: list[dict[str, Any]] = []
    for name in sorted(st.catalog.views):
        versions = st.catalog.view(name).entry.versions
        for v in versions:
            is_ready = (name, v) in st.catalog.ready
            if only_ready and not is_ready:
                continue
            item: dict[str, Any] = {"name": name, "version": str(v), "state": "READY" if is_ready else "UNAVAILABLE"}
            reason = st.catalog.failures.get(name)
            if not is_ready and reason:
                item["reason"] = reason
            items.append(item)
    if not only_ready:
        items.extend({"name": n, "state": "UNAVAILABLE", "reason": why}
                     for n, why in sorted(st.catalog.repository.errors.items()))
    return json_response(items)


async def repository_control(request: Request) -> Response:
    raise Unsupported("explicit model control (load/unload) is not enabled on this server yet")


def model_routes(suffix: str, endpoint: Any, methods: list[str]) -> list[Route]:
    return [
        Route(f"/v2/models/{{name}}{suffix}", endpoint, methods=methods),
        Route(f"/v2/models/{{name}}/versions/{{version}}{suffix}", endpoint, methods=methods),
    ]


ROUTES: list[Route] = [
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/models/stats", model_stats, methods=["GET"]),
    *model_routes("/infer", infer, ["POST"]),
    *model_routes("/ready", model_ready, ["GET"]),
    *model_routes("/config", model_config, ["GET"]),
    *model_routes("/stats", model_stats, ["GET"]),
    *model_routes("", model_metadata, ["GET"]),
    Route("/v2/repository/index", repository_index, methods=["POST"]),
    Route("/v2/repository/models/{name}/load", repository_control, methods=["POST"]),
    Route("/v2/repository/models/{name}/unload", repository_control, methods=["POST"]),
]
