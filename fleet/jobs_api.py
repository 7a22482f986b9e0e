"""The HTTP client of the gateway's /v2/jobs API (httpx): every failure becomes JobsClientError."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

JobRecord = dict[str, Any]
JobList = list[JobRecord]
OnChunk = Callable[[int], None]


class JobsClientError(Exception):
    """A gateway error (`status` is the HTTP status) or an unreachable gateway (`status` is None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message if self.status is None else f"{self.message} (HTTP {self.status})"


def _raise_for_error(response: httpx.Response) -> None:
    """Map a 4xx/5xx response to JobsClientError carrying the gateway's `{"error": ...}` message."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
        message = str(body["error"]) if isinstance(body, dict) and "error" in body else response.text
    except ValueError:
        message = response.text
    raise JobsClientError(message.strip() or response.reason_phrase, response.status_code)


class JobsClient:
    """Synchronous client of the gateway's /v2/jobs endpoints.

    `client` is injectable (tests pass one with httpx.MockTransport); when omitted the JobsClient owns one
    and `close()` closes it. All methods raise JobsClientError, never httpx exceptions.
    """

    def __init__(self, base_url: str, client: httpx.Client | None = None, *, timeout_s: float = 30.0,
                 chunk_bytes: int = 1 << 20, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        # Jobs are a protected scope where the gateway has API keys (FLEET_API_KEYS): sent with every call.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owned = client is None
        self._client = client if client is not None else httpx.Client(timeout=httpx.Timeout(timeout_s))
        self._timeout_s = timeout_s
        self._chunk_bytes = chunk_bytes

    def __enter__(self) -> JobsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self._client.close()

    def _url(self, *parts: str) -> str:
        return "/".join([self.base_url, "v2", "jobs", *(quote(p, safe="") for p in parts)])

    def _request(self, method: str, url: str, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, url, headers={**self._headers, **(headers or {})}, **kwargs)
        except httpx.HTTPError as exc:
            raise JobsClientError(f"cannot reach the gateway at {self.base_url}: {exc}") from exc
        _raise_for_error(response)
        try:
            return response.json()
        except ValueError as exc:
            raise JobsClientError(f"the gateway answered {method} {url} with non-JSON", response.status_code) from exc

    def upload(self, path: Path, on_chunk: OnChunk | None = None) -> str:
        """Stream the file at `path` (never read whole into memory) and return the upload token."""
        size = path.stat().st_size

        def chunks() -> Iterator[bytes]:
            with path.open("rb") as f:
                while chunk := f.read(self._chunk_bytes):
                    if on_chunk is not None:
                        on_chunk(len(chunk))
                    yield chunk

        # An explicit Content-Length keeps httpx from switching to chunked transfer encoding.
        # The gateway may scan the whole file before answering, hence no read timeout.
        body = self._request("POST", self._url("uploads"), params={"name": path.name}, content=chunks(),
                             headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
                             timeout=httpx.Timeout(self._timeout_s, read=None))
        return str(body["upload"])

    def create(self, spec: Mapping[str, Any]) -> JobRecord:
        """POST /v2/jobs; an existing `id` returns that job's record (idempotent resubmission)."""
        record: JobRecord = self._request("POST", self._url(), json=dict(spec))
        return record

    def get(self, job_id: str) -> JobRecord:
        record: JobRecord = self._request("GET", self._url(job_id))
        return record

    def list(self) -> JobList:
        """All jobs, newest first."""
        jobs: JobList = self._request("GET", self._url())["jobs"]
        return jobs

    def cancel(self, job_id: str) -> JobRecord:
        record: JobRecord = self._request("DELETE", self._url(job_id))
        return record

    def download(self, job_id: str, dest: Path, on_chunk: OnChunk | None = None, *, mask: bool = False) -> int:
        """Stream the results (`mask`: an .npy job's failed-row mask) to `dest` (via `dest.part`, renamed when
        complete); return the bytes written."""
        part = dest.with_name(dest.name + ".part")
        written = 0
        url = self._url(job_id, "results", *(("failed",) if mask else ()))
        try:
            with self._client.stream("GET", url, headers=self._headers) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_error(response)
                with part.open("wb") as f:
                    for chunk in response.iter_bytes(self._chunk_bytes):
                        f.write(chunk)
                        written += len(chunk)
                        if on_chunk is not None:
                            on_chunk(len(chunk))
        except httpx.HTTPError as exc:
            part.unlink(missing_ok=True)
            raise JobsClientError(f"download of job {job_id} failed: {exc}") from exc
        except BaseException:  # JobsClientError, a full disk, Ctrl-C: leave no half-written file behind
            part.unlink(missing_ok=True)
            raise
        part.replace(dest)
        return written
