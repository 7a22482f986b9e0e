"""/v2/jobs: bulk jobs over HTTP (design.md "Bulk jobs"). The operations are in gateway/jobs/service.py;
they are synchronous (RQ is), so each runs in a worker thread, off the event loop that serves inference."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from fleet.errors import InvalidInput, VersionNotFound
from gateway.jobs import service
from gateway.routes import json_response, state_of

MEDIA_TYPES = {"jsonl": "application/x-ndjson", "npy": "application/octet-stream", "npz": "application/octet-stream"}


async def upload(request: Request) -> Response:
    """The raw request body becomes a file the next POST /v2/jobs can name as {"upload": token}."""
    name = request.query_params.get("name", "")
    token, path = service.upload_path(state_of(request).jobs, name)
    size = 0
    partial = path.with_name(path.name + ".part")
    try:
        with partial.open("wb") as f:
            async for chunk in request.stream():
                f.write(chunk)
                size += len(chunk)
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    return json_response({"upload": token, "bytes": size}, 201)


async def create(request: Request) -> Response:
    st = state_of(request)
    try:
        doc = json.loads(await request.body())
    except ValueError as exc:
        raise InvalidInput(f"the job request is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise InvalidInput("a job needs at least {\"model\": ..., \"input\": ...}")
    view = st.catalog.view(doc["model"])  # unknown model: 400, as for inference
    versions = view.entry.versions
    raw_version = str(doc.get("version") or "")
    if raw_version:
        if not raw_version.isdigit() or int(raw_version) not in versions:
            raise VersionNotFound(doc["model"], raw_version)
        version = int(raw_version)
    else:
        if not versions:
            raise VersionNotFound(doc["model"], "(latest)")
        version = max(versions)
    record, created = await asyncio.to_thread(service.create_job, st.jobs, doc, view.entry.spec, version)
    return json_response(record, 201 if created else 200)


async def list_all(request: Request) -> Response:
    return json_response({"jobs": await asyncio.to_thread(service.list_jobs, state_of(request).jobs)})


async def get(request: Request) -> Response:
    return json_response(await asyncio.to_thread(service.get_job, state_of(request).jobs, request.path_params["id"]))


async def cancel(request: Request) -> Response:
    return json_response(await asyncio.to_thread(service.cancel_job, state_of(request).jobs, request.path_params["id"]))


async def results(request: Request) -> Response:
    job_id = request.path_params["id"]
    path, fmt = await asyncio.to_thread(service.results_path, state_of(request).jobs, job_id)
    return FileResponse(path, media_type=MEDIA_TYPES.get(fmt, "application/octet-stream"),
                        filename=f"{job_id}{path.suffix}")


ROUTES = [
    Route("/v2/jobs/uploads", upload, methods=["POST"]),
    Route("/v2/jobs", create, methods=["POST"]),
    Route("/v2/jobs", list_all, methods=["GET"]),
    Route("/v2/jobs/{id}", get, methods=["GET"]),
    Route("/v2/jobs/{id}", cancel, methods=["DELETE"]),
    Route("/v2/jobs/{id}/results", results, methods=["GET"]),
]
