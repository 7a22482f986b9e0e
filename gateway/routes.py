"""KServe v2 REST routes with Triton's extensions. HTTP only: everything else is in dataplane/catalog.

Every route is a plain Starlette endpoint (no FastAPI dependency layer): the infer route is the hot
path, and design.md measured FastAPI's per-route layer at up to 2x the cost of a bare handler.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleet.errors import InvalidInput, NotFound, VersionNotFound
from fleet.generate_body import parse_generate
from fleet.kserve import ParsedInfer
from gateway import model_info
from gateway.catalog import ModelView
from gateway.generate import events, raise_reply, render_generate, single
from gateway.state import GatewayState

SERVER_VERSION = "2.51.0"
# Triton 2.51's list, in its order, less cuda_shared_memory: its routes answer (nothing registered), but
# registering is refused.
EXTENSIONS = ["classification", "sequence", "model_repository", "model_repository(unload_dependents)",
              "schedule_policy", "model_configuration", "system_shared_memory", "binary_tensor_data", "parameters",
              "statistics", "trace", "logging"]


def state_of(request: Request) -> GatewayState:
    return request.app.state.fleet  # type: ignore[no-any-return]


def parse_version(name: str, version: str | None) -> str | None:
    """The version of a /v2/models/NAME[/versions/V]/... URL, for every route that takes one (the infer
    fast path included): None when the URL names none. Triton's routes take `[0-9]+` only, so an empty
    version matches no route there (404) and neither does a non-numeric one: both are 404s here too,
    never a silent fall back to the default version. ASCII digits only: str.isdigit() also accepts "²"."""
    if version is None:
        return None
    if version == "":
        raise NotFound(f"the model version in the URL is empty: give a version number, or leave out "
                       f"'/versions/' to use the default version of model '{name}'")
    if not (version.isascii() and version.isdigit()):
        raise VersionNotFound(name, version)
    return version


def _version(request: Request) -> str | None:
    return parse_version(request.path_params["name"], request.path_params.get("version"))


def json_response(doc: Any, status: int = 200) -> Response:
    return Response(json.dumps(doc, separators=(",", ":")), status_code=status, media_type="application/json")


async def live(request: Request) -> Response:
    return json_response({"live": True})


async def ready(request: Request) -> Response:
    st = state_of(request)
    reason = await model_info.not_ready_reason(st.catalog, st.broker)
    if reason is not None:
        return json_response({"ready": False, "error": reason}, 400)
    return json_response({"ready": True})


async def server_metadata(request: Request) -> Response:
    return json_response({"name": "triton", "version": SERVER_VERSION, "extensions": EXTENSIONS,
                  "server": "fleet"})


async def model_metadata(request: Request) -> Response:
    return json_response(model_info.model_metadata(state_of(request).catalog, request.path_params["name"],
                                                   _version(request)))


async def model_ready(request: Request) -> Response:
    st = state_of(request)
    version = _version(request)  # a malformed version is the 404 of every model route, before the lookup
    if not st.catalog.is_ready(request.path_params["name"], version):
        return JSONResponse({"error": "Model version not ready"}, status_code=400)  # Triton's answer to each
    return json_response({"name": request.path_params["name"], "ready": True})


async def model_config(request: Request) -> Response:
    view = model_info.model_view(state_of(request).catalog, request.path_params["name"], _version(request))
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


async def _generate_request(request: Request) -> tuple[str, int, ModelView, ParsedInfer]:
    """A generate body for the model of the URL: (name, version, its view, the request)."""
    name = request.path_params["name"]
    view, v = state_of(request).catalog.resolve(name, _version(request))
    return name, v, view, parse_generate(await _identity_body(request), view.entry.spec)


async def generate(request: Request) -> Response:
    """Triton's generate extension (gateway/generate.py): one JSON response."""
    st = state_of(request)
    name, v, view, req = await _generate_request(request)
    spec = view.entry.spec
    st.dataplane.admit()
    try:
        reply = await single(st.dataplane.replies(name, v, spec, req, gen=view.gen))
    finally:
        st.dataplane.release()
    return json_response(render_generate(name, v, req.client_id, reply))


async def generate_stream(request: Request) -> Response:
    """Each response of the model as a server-sent event, as it comes; the status is the first one's."""
    st = state_of(request)
    name, v, view, req = await _generate_request(request)
    spec = view.entry.spec
    st.dataplane.admit()
    rest = st.dataplane.replies(name, v, spec, req, gen=view.gen)
    try:
        first = await anext(rest)
        if not first.ok:
            raise_reply(first)
    except BaseException:
        await rest.aclose()
        st.dataplane.release()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in events(name, v, req.client_id, first, rest):
                yield chunk
        finally:
            await rest.aclose()  # the client went away: the request is cancelled
            st.dataplane.release()

    return StreamingResponse(body(), media_type="text/event-stream; charset=utf-8")


async def _identity_body(request: Request) -> bytes:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidInput(f"generate requests do not support Content-Encoding '{encoding}'")
    return await request.body()


async def repository_index(request: Request) -> Response:
    st = state_of(request)
    body = await request.body()
    only_ready = False
    if body.strip():
        try:
            doc = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise InvalidInput("failed to parse the request JSON buffer: it is not UTF-8 JSON") from None
        if not isinstance(doc, dict):
            raise InvalidInput("the repository index request must be a JSON object, e.g. {\"ready\": true}")
        only_ready = doc.get("ready", False)
        if not isinstance(only_ready, bool):
            raise InvalidInput("'ready' must be a boolean")
    await st.control.rescan_for_index()
    return json_response(model_info.repository_index(st.catalog, only_ready))


async def repository_control(request: Request) -> Response:
    """Triton's load and unload: `{"parameters": {...}}` (config and `file:` overrides, or
    unload_dependents); gateway/model_control.py does the rest."""
    st = state_of(request)
    body = await request.body()
    parameters: dict[str, Any] = {}
    if body.strip():
        try:
            doc = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError):
            raise InvalidInput("failed to parse the request JSON buffer: it is not UTF-8 JSON") from None
        raw = doc.get("parameters", {}) if isinstance(doc, dict) else None
        if not isinstance(raw, dict):
            raise InvalidInput("the request must be a JSON object whose 'parameters' is an object")
        parameters = raw
    name = request.path_params["name"]
    if request.url.path.endswith("/load"):
        await st.control.load(name, parameters)
    else:
        await st.control.unload(name, parameters)
    return Response(status_code=200)


async def empty_version(request: Request) -> Response:
    """`/versions//...`: Starlette's `{version}` never matches an empty segment, so these URLs get a route
    of their own, to answer what the infer fast path answers (parse_version), not a bare "Not Found"."""
    parse_version(request.path_params["name"], "")
    raise AssertionError("parse_version refuses an empty version")


def model_routes(suffix: str, endpoint: Any, methods: list[str]) -> list[Route]:
    return [
        Route(f"/v2/models/{{name}}{suffix}", endpoint, methods=methods),
        Route(f"/v2/models/{{name}}/versions/{{version}}{suffix}", endpoint, methods=methods),
        Route(f"/v2/models/{{name}}/versions/{suffix}", empty_version, methods=methods),
    ]


ROUTES: list[Route] = [
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/models/stats", model_stats, methods=["GET"]),
    *model_routes("/infer", infer, ["POST"]),
    *model_routes("/generate", generate, ["POST"]),
    *model_routes("/generate_stream", generate_stream, ["POST"]),
    *model_routes("/ready", model_ready, ["GET"]),
    *model_routes("/config", model_config, ["GET"]),
    *model_routes("/stats", model_stats, ["GET"]),
    *model_routes("", model_metadata, ["GET"]),
    Route("/v2/repository/index", repository_index, methods=["POST"]),
    Route("/v2/repository/models/{name}/load", repository_control, methods=["POST"]),
    Route("/v2/repository/models/{name}/unload", repository_control, methods=["POST"]),
]
