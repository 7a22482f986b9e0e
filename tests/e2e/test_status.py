"""The status view against `fleet up` (real Redis, gateway, worker and job worker processes): after real
inferences and a bulk job, the JSON (`/v2/fleet/status`) agrees with the statistics extension and the
worker processes, its throughput counts exactly the requests sent in its window, `fleet status --once`
prints the same figures, and the page (`/`) renders in a real headless Chromium, whose screenshot is kept
at .fleet/artifacts/status-page.png (git-ignored) for people to look at."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.job_client import JobsClient
from tests.e2e.conftest import ROOT, RunningSystem

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = ROOT / ".fleet" / "artifacts" / "status-page.png"
MODEL = "simple"  # Triton's example: INT32 add/sub, max_batch_size 8
N = 12


def infer(client: httpx.Client, n: int) -> None:
    body = {"inputs": [{"name": f"INPUT{i}", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
                       for i in (0, 1)]}
    for _ in range(n):
        r = client.post(f"/v2/models/{MODEL}/infer", json=body)
        assert r.status_code == 200, r.text


def status(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/v2/fleet/status")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
    return r.json()  # type: ignore[no-any-return]


def model_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in doc["models"] if m["name"] == name)


@pytest.fixture(scope="module")
def client(system: RunningSystem) -> Any:
    with httpx.Client(base_url=f"http://{system.url}", timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def job_id(system: RunningSystem, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A finished 10-item job on mlp, so the jobs table has a row of known progress."""
    source = tmp_path_factory.mktemp("status-job") / "in.jsonl"
    source.write_text("".join(json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 256],
                                                      "data": [0.5] * 256}]}) + "\n" for _ in range(10)))
    with JobsClient(f"http://{system.url}") as jobs:
        record = jobs.create({"model": "mlp", "input": str(source), "id": f"status-{uuid.uuid4().hex[:8]}"})
        deadline = time.monotonic() + 120
        while record["state"] not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, record
            time.sleep(0.1)
            record = jobs.get(record["id"])
    assert record["state"] == "completed" and record["done"] == 10, record
    return str(record["id"])


def test_the_json_reports_real_workers_models_counts_and_jobs(system: RunningSystem, client: httpx.Client,
                                                               job_id: str) -> None:
    infer(client, N)
    doc = status(client)
    stats = client.get(f"/v2/models/{MODEL}/stats").json()["model_stats"]
    simple = model_of(doc, MODEL)
    assert simple["ready"] and simple["ready_versions"] == [1]
    assert simple["counters"]["success"] == sum(s["inference_stats"]["success"]["count"] for s in stats) >= N
    assert simple["counters"]["executions"] == sum(s["execution_count"] for s in stats)
    assert simple["mean_batch_size"] == pytest.approx(sum(s["inference_count"] for s in stats) /
                                                      sum(s["execution_count"] for s in stats))
    assert [lane["lane"] for lane in simple["lanes"]] == ["online", "bulk"]
    # Every request sent has been answered; a worker acknowledges just after replying, so the last
    # one may still count as in flight for a moment.
    deadline = time.monotonic() + 10
    while (simple["waiting"], simple["in_flight"]) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
        simple = model_of(status(client), MODEL)
    assert (simple["waiting"], simple["in_flight"]) == (0, 0)

    workers = [w for w in doc["workers"] if w["state"] != "gone"]
    assert {w["pid"] for w in workers} == set(system.children("worker"))
    worker = workers[0]
    assert worker["state"] == "ready" and worker["device"] == "cpu" and worker["host"]
    assert {"model": MODEL, "version": 1, "state": "READY"} in worker["units"]
    assert 0 <= worker["heartbeat_age_s"] < 5

    job = next(j for j in doc["jobs"] if j["id"] == job_id)
    assert (job["model"], job["state"], job["done"], job["total"], job["failed"]) == ("mlp", "completed", 10, 10, 0)
    assert doc["totals"]["workers"] == len(workers) and doc["totals"]["models_ready"] >= 1


def test_throughput_counts_the_requests_sent_in_its_window(client: httpx.Client) -> None:
    status(client)  # the sample the next one is measured against
    started = time.monotonic()
    infer(client, N)
    time.sleep(max(0.0, 1.2 - (time.monotonic() - started)))
    doc = status(client)
    rate = model_of(doc, MODEL)["rate"]
    assert doc["window_s"] >= 1.0 and rate is not None
    assert rate["requests_per_s"] * doc["window_s"] == pytest.approx(N)
    assert rate["inferences_per_s"] * doc["window_s"] == pytest.approx(N)  # one row each


def test_fleet_status_once_prints_the_worker_and_the_models_counts(system: RunningSystem, client: httpx.Client,
                                                                    job_id: str) -> None:
    infer(client, 2)
    env = {**os.environ, "COLUMNS": "260"}  # rich sizes a console that is not a terminal by COLUMNS
    out = subprocess.run([sys.executable, "-m", "fleet", "status", "--once", "--url", f"http://{system.url}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    doc = status(client)
    worker = next(w for w in doc["workers"] if w["state"] != "gone")
    assert worker["id"] in out.stdout and job_id in out.stdout
    rows = {cells[0]: cells for line in out.stdout.splitlines()
            if (cells := [c.strip() for c in line.strip("│ ").split("│")]) and len(cells) == 13}
    simple = model_of(doc, MODEL)
    assert rows[MODEL][1] == "v1" and rows[MODEL][2] == "online 0 · bulk 0"
    assert rows[MODEL][10] == f"{simple['counters']['success']:,}"
    assert rows[MODEL][8] == f"{simple['mean_batch_size']:,.2f}"


def chromium(url: str, *args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    profile = tmp / f"chromium-{uuid.uuid4().hex[:6]}"
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,900", *args, url],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium package (/usr/bin/chromium): "
                                                  "apt-get install chromium")
def test_the_page_renders_in_headless_chromium(system: RunningSystem, client: httpx.Client, job_id: str,
                                               tmp_path: Path) -> None:
    infer(client, 2)
    url = f"http://{system.url}/"
    dom = chromium(url, "--dump-dom", tmp=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    doc = status(client)
    worker = next(w for w in doc["workers"] if w["state"] != "gone")
    for text in (worker["id"], MODEL, "mlp", "add_sub", job_id, "Workers", "Models", "Bulk jobs",
                 f"{model_of(doc, MODEL)['counters']['success']:,}"):
        assert text in dom.stdout, text
    assert '<meta http-equiv="refresh" content="2">' in dom.stdout
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    shot = chromium(url, f"--screenshot={tmp_path / 'page.png'}", tmp=tmp_path)
    assert shot.returncode == 0, shot.stderr[-2000:]
    png = (tmp_path / "page.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # a blank page compresses to far less
    shutil.copyfile(tmp_path / "page.png", SCREENSHOT)
    print(f"status page screenshot: {SCREENSHOT}")
