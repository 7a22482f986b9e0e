"""/v2/jobs: bulk jobs over HTTP (design.md "Bulk jobs"). The operations are in gateway/jobs/service.py;
they are synchronous (RQ is), so each runs in a worker thread, off the event loop that serves inference."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from fleet.errors import InvalidInput, TooLarge, VersionNotFound
from gateway.jobs import service
from gateway.jobs.uploads import UploadDecoder
from gateway.routes import json_response, state_of

MEDIA_TYPES = {"jsonl": "application/x-ndjson", "npy": "application/octet-stream", "npz": "application/octet-stream"}
MAX_JOB_REQUEST_BYTES = 1 << 20  # a job's description (its input is uploaded, or named by path)


async def upload(request: Request) -> Response:
    """The raw request body becomes a file the next POST /v2/jobs can name as {"upload": token}.

    Stored decompressed (Content-Encoding gzip/deflate, a `.gz` name) and at most max_upload_bytes, as
    received and as stored: past it, 413 and the partial file is deleted. Chunked bodies announce no
    length, so the bound is counted here as the body streams in."""
    st = state_of(request)
    name = request.query_params.get("name", "")
    token, path, gzipped = service.upload_path(st.jobs, name)
    decoder = UploadDecoder(st.settings.max_upload_bytes, request.headers.get("content-encoding"),
                            name if gzipped else None)
    partial = path.with_name(path.name + ".part")
    try:
        with partial.open("wb") as f:
            async for chunk in request.stream():
                for piece in decoder.feed(chunk):
                    f.write(piece)
            decoder.finish()
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)  # refused, failed or abandoned mid-body: nothing is left behind
    return json_response({"upload": token, "bytes": decoder.stored, "received": decoder.received}, 201)


async def _job_request_body(request: Request) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_JOB_REQUEST_BYTES:
            raise TooLarge(f"the job request is over {MAX_JOB_REQUEST_BYTES} bytes: upload the input "
                           "(POST /v2/jobs/uploads) and name it by its token")
        parts.append(chunk)
    return b"".join(parts)


def _load_job_request(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        if "int_max_str_digits" in str(exc):  # Python's own advice would be no use to the client
            raise InvalidInput("the job request holds a number with too many digits") from None
        raise InvalidInput(f"the job request is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("the job request is not valid JSON: nested too deeply") from None


async def create(request: Request) -> Response:
    st = state_of(request)
    doc = _load_job_request(await _job_request_body(request))
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise InvalidInput("a job needs at least {\"model\": ..., \"input\": ...}")
    view = st.catalog.view(doc["model"])  # unknown model: 404, as for inference
    versions = view.entry.versions
    raw_version = str(doc.get("version") or "")
    if raw_version:
        # ASCII digits only ("²".isdigit() is true) and short enough to be a version at all
        digits = raw_version.isascii() and raw_version.isdigit() and len(raw_version) <= 18
        if not digits or int(raw_version) not in versions:
            raise VersionNotFound(doc["model"], raw_version[:40])
        version = int(raw_version)
    else:  # the version unversioned inference goes to now (the highest ready), else the latest there is
        ready = st.catalog.ready_versions(doc["model"])
        if not ready and not versions:
            raise VersionNotFound(doc["model"], "(latest)")
        version = ready[-1] if ready else max(versions)
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


async def failed_mask(request: Request) -> Response:
    job_id = request.path_params["id"]
    path = await asyncio.to_thread(service.failed_mask_path, state_of(request).jobs, job_id)
    return FileResponse(path, media_type=MEDIA_TYPES["npy"], filename=f"{job_id}.failed.npy")


ROUTES = [
    Route("/v2/jobs/uploads", upload, methods=["POST"]),
    Route("/v2/jobs", create, methods=["POST"]),
    Route("/v2/jobs", list_all, methods=["GET"]),
    Route("/v2/jobs/{id}", get, methods=["GET"]),
    Route("/v2/jobs/{id}", cancel, methods=["DELETE"]),
    Route("/v2/jobs/{id}/results", results, methods=["GET"]),
    Route("/v2/jobs/{id}/results/failed", failed_mask, methods=["GET"]),
]
