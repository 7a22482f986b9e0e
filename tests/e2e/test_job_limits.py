"""Bulk-job size limits against real processes (Redis, a gateway, a worker and a job worker), set small:
FLEET_MAX_UPLOAD_BYTES holds for a chunked upload (no Content-Length to refuse it by) and after
decompression (a gzip bomb), and a refused upload leaves no file behind; FLEET_MAX_JOB_LINE_BYTES makes
a 40 MB JSONL line that line's error while the job goes on, and the job worker reads past it in bounded
chunks: its memory grows by far less than the line."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from fleet.job_client import JobsClient
from tests.support.processes import ROOT, Cluster

pytestmark = pytest.mark.e2e

UPLOAD_LIMIT = 2 << 20
LINE_LIMIT = 1 << 20
PIECE = 64 << 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("job-limits")
    repo = tmp / "repo"
    shutil.copytree(ROOT / "tests" / "models" / "doubler", repo / "doubler")  # OUT = 2 * IN, IN is [-1, -1]
    env = {"FLEET_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT), "FLEET_MAX_JOB_LINE_BYTES": str(LINE_LIMIT),
           "FLEET_JOB_INPUT_DIRS": json.dumps([str(tmp)])}
    c = Cluster(tmp, repo, env)
    try:
        c.start_redis()
        c.start_gateway()
        c.start_worker()
        c.start_jobs_worker()
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture
def jobs(cluster: Cluster) -> Iterator[JobsClient]:
    with JobsClient(cluster.base_url) as client:
        yield client


def uploads(cluster: Cluster) -> set[str]:
    directory = cluster.tmp / "jobs" / "uploads"
    return {p.name for p in directory.iterdir()} if directory.exists() else set()


def settles(check: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the response body"
        body += chunk
    return int(lines[0].split()[1]), json.loads(body[:length])


def post_chunked(cluster: Cluster, name: str, pieces: Iterable[bytes], *, end: bool) -> tuple[int, dict[str, Any]]:
    """POST an upload with Transfer-Encoding: chunked (so no Content-Length says how big it is). Without
    `end` the body is left unfinished: the server must answer on what it has read."""
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=30) as sock:
        sock.sendall(f"POST /v2/jobs/uploads?name={name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        for piece in pieces:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        if end:
            sock.sendall(b"0\r\n\r\n")
        return read_response(sock)


def test_a_chunked_upload_is_refused_past_the_limit_and_leaves_no_file(cluster: Cluster) -> None:
    before = uploads(cluster)
    at_limit = [b"\n" * PIECE] * (UPLOAD_LIMIT // PIECE)
    status, body = post_chunked(cluster, "fits.jsonl", at_limit, end=True)
    assert status == 201 and body["bytes"] == UPLOAD_LIMIT, body
    assert uploads(cluster) - before == {f"{body['upload']}.jsonl"}
    before = uploads(cluster)
    status, body = post_chunked(cluster, "over.jsonl", [*at_limit, b"\n"], end=False)
    # Refused by the HTTP layer's body count or by the upload route's: either way, this status and limit.
    assert status == 413 and f"limit of {UPLOAD_LIMIT} bytes" in body["error"], body
    # The partial file goes once the route sees the refusal (the HTTP layer may answer first, and the
    # route then learns it from the closed connection).
    assert settles(lambda: uploads(cluster) == before, within_s=10), uploads(cluster) - before


@pytest.mark.parametrize(("name", "headers"), [("bomb.jsonl", {"content-encoding": "gzip"}),
                                               ("bomb.jsonl.gz", {})])
def test_a_gzip_bomb_is_refused_once_inflated_past_the_limit(cluster: Cluster, name: str,
                                                             headers: dict[str, str]) -> None:
    before = uploads(cluster)
    bomb = gzip.compress(b"\n" * (8 * UPLOAD_LIMIT), compresslevel=9)
    assert len(bomb) < UPLOAD_LIMIT // 50
    response = httpx.post(f"{cluster.base_url}/v2/jobs/uploads", params={"name": name}, content=bomb,
                          headers=headers)
    assert response.status_code == 413, response.text
    assert "once decompressed" in response.json()["error"]
    assert uploads(cluster) == before


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def run_job(jobs: JobsClient, source: Path) -> dict[str, Any]:
    job_id = jobs.create({"model": "doubler", "input": str(source)})["id"]
    deadline = time.monotonic() + 120
    while (record := jobs.get(job_id))["state"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, record
        time.sleep(0.1)
    return record


def test_a_40_mb_line_is_its_own_error_read_in_bounded_memory(cluster: Cluster, jobs: JobsClient) -> None:
    good = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
    warm = cluster.tmp / "warm.jsonl"
    warm.write_text(good + "\n")
    assert run_job(jobs, warm)["state"] == "completed"  # imports and caches: not the line's cost
    n = 10_000_000  # "0.5," is 4 bytes: a 40 MB line, a valid request the old reader would parse whole
    big = (f'{{"inputs": [{{"name": "IN", "datatype": "FP32", "shape": [1, {n}], "data": ['
           + ",".join(["0.5"] * n) + "]}]}")
    source = cluster.tmp / "long.jsonl"
    source.write_text(f"{good}\n{big}\n{good}\n")
    (pid,) = [p.pid for p in cluster.job_workers]
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    baseline_kb = status_kb(pid, "VmRSS")
    record = run_job(jobs, source)
    growth_mb = (status_kb(pid, "VmHWM") - baseline_kb) / 1024
    print(f"job worker: peak RSS {growth_mb:.1f} MB over its {baseline_kb / 1024:.0f} MB for a "
          f"{len(big) / 1e6:.0f} MB line")
    assert record["state"] == "completed" and record["done"] == 3 and record["failed"] == 1, record
    assert record["errors"] == [{"line": 2, "error": f"line 2 is {len(big)} bytes, over the limit of {LINE_LIMIT} "
                                                     "bytes per line"}]
    assert growth_mb < 12, f"the job worker grew by {growth_mb:.0f} MB for a {len(big) >> 20} MB line"
    out = cluster.tmp / "long.out.jsonl"
    jobs.download(record["id"], out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [d["line"] for d in lines] == [1, 2, 3] and "error" in lines[1]
    for d in (lines[0], lines[2]):
        np.testing.assert_array_equal(d["outputs"][0]["data"], [2, 4, 6, 8])
