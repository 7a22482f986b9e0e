"""Bulk jobs end to end against `fleet up` (real Redis, gateway, worker and RQ job worker processes):
a 10k-item job on mlp equal to direct computation, bad lines, idempotent ids, cancel (which deletes the
partial output), resume after the job worker is killed with SIGKILL mid-job, numeric job fields out of
range, a job whose lines all fail (it fails fast; `fleet submit` exits 1), one with some failed lines
(`fleet submit` exits 3 and lists the most common errors), and compressed uploads."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.procs import children, running
from fleet.job_client import JobsClient, JobsClientError
from tests.e2e.conftest import RunningSystem
from tests.support.mlp_direct import MLP, mlp_direct

pytestmark = pytest.mark.e2e

def write_jsonl(path: Path, x: np.ndarray, bad: dict[int, str] | None = None) -> None:
    """One v2 request per row; `bad` maps an item position to a raw line inserted before that row."""
    bad = bad or {}
    with path.open("w") as f:
        for i, row in enumerate(x):
            if i in bad:
                f.write(bad[i] + "\n")
            f.write(json.dumps({"id": f"r{i}", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 256],
                                                          "data": row.tolist()}]}) + "\n")


def wait_for(client: JobsClient, job_id: str, done: Callable[[dict[str, Any]], bool],
             timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        record = client.get(job_id)
        if done(record):
            return record
        assert time.monotonic() < deadline, f"job {job_id} stuck: {record}"
        time.sleep(0.1)


def finished(record: dict[str, Any]) -> bool:
    return record["state"] in ("completed", "failed", "cancelled")


@pytest.fixture
def jobs(system: RunningSystem) -> JobsClient:
    with JobsClient(f"http://{system.url}") as client:
        yield client  # type: ignore[misc]


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((20_000, 256)).astype(np.float32)


@pytest.fixture(scope="module")
def reference(rows: np.ndarray) -> np.ndarray:
    return mlp_direct(rows)


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_outputs(lines: list[dict[str, Any]], reference: np.ndarray, expected_lines: list[int]) -> None:
    """Exactly one output per input line, in input order, each equal to direct computation."""
    assert [d["line"] for d in lines] == expected_lines
    got = np.array([d["outputs"][0]["data"] for d in lines if "outputs" in d], dtype=np.float32)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_a_10k_job_equals_direct_computation_and_records_bad_lines(
        jobs: JobsClient, rows: np.ndarray, reference: np.ndarray, tmp_path: Path) -> None:
    n = 10_000
    source = tmp_path / "in.jsonl"
    write_jsonl(source, rows[:n], bad={10: "{not json", 500: json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]})})
    record = jobs.create({"model": "mlp", "input": {"upload": jobs.upload(source)}})
    # The answer is the record read after the job was queued: an idle job worker may have started it already.
    assert record["state"] in ("queued", "running") and record["model"] == "mlp"
    record = wait_for(jobs, record["id"], finished)
    assert record["state"] == "completed", record
    assert record["total"] == n + 2 and record["done"] == n + 2 and record["failed"] == 2
    assert [e["line"] for e in record["errors"]] == [11, 502]
    assert "JSON" in record["errors"][0]["error"] and "shape" in record["errors"][1]["error"]
    out = tmp_path / "out.jsonl"
    jobs.download(record["id"], out)
    lines = read_output(out)
    assert [d["line"] for d in lines if "error" in d] == [11, 502]
    good = [d for d in lines if "error" not in d]
    assert [d["id"] for d in good] == [f"r{i}" for i in range(n)]
    check_outputs(good, reference[:n], [i + 1 + (i >= 10) + (i >= 500) for i in range(n)])


def test_packed_requests_run_in_parts_of_max_batch_size_and_equal_direct_computation(
        jobs: JobsClient, system: RunningSystem, rows: np.ndarray, reference: np.ndarray, tmp_path: Path) -> None:
    """pack_batches 4: 2,000 rows go as 8 requests of up to 256 rows (7 full, one of 208), each run by the
    worker as batches of at most mlp's max_batch_size 64 (32 executions, the last of 16 rows)."""
    source = tmp_path / "packed.npy"
    np.save(source, rows[:2000])

    def stats() -> dict[str, Any]:
        return httpx.get(f"http://{system.url}/v2/models/mlp/stats").json()["model_stats"][0]  # type: ignore[no-any-return]
    before = stats()
    record = jobs.create({"model": "mlp", "input": str(source), "output": {"format": "npy"}, "pack_batches": 4})
    assert record["pack_batches"] == 4
    record = wait_for(jobs, record["id"], finished)
    assert record["state"] == "completed" and record["done"] == 2000 and record["failed"] == 0, record
    out = tmp_path / "packed.out.npy"
    jobs.download(record["id"], out)
    np.testing.assert_allclose(np.load(out), reference[:2000], rtol=1e-5, atol=1e-5)
    jobs.download(record["id"], mask := tmp_path / "packed.failed.npy", mask=True)
    np.testing.assert_array_equal(np.load(mask), np.zeros(2000, bool))
    after = stats()
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 8
    assert after["execution_count"] - before["execution_count"] == 32
    assert after["inference_count"] - before["inference_count"] == 2000
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    old = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    assert max(sizes) <= 64 and sizes[64] - old.get(64, 0) == 31 and sizes[16] - old.get(16, 0) == 1


def test_a_packed_job_gives_way_to_online_requests_and_loses_no_row(
        jobs: JobsClient, system: RunningSystem, rows: np.ndarray, reference: np.ndarray, tmp_path: Path) -> None:
    """Online requests sent while a packed job runs: each packed request may stop between its parts for them and
    run its rest later. Every online answer and every job row equals direct computation, each row once."""
    import tritonclient.http as httpclient  # (as Triton's users call fleet)

    source = tmp_path / "busy.npy"
    np.save(source, rows[:8000])
    record = jobs.create({"model": "mlp", "input": str(source), "output": {"format": "npy"}, "pack_batches": 4})
    client = httpclient.InferenceServerClient(system.url)
    answered = 0
    try:
        deadline = time.monotonic() + 120
        while not finished(jobs.get(record["id"])) and time.monotonic() < deadline:
            i = answered % 1000
            inp = httpclient.InferInput("INPUT0", [1, 256], "FP32")
            inp.set_data_from_numpy(rows[10_000 + i:10_001 + i])
            got = client.infer("mlp", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_allclose(got, reference[10_000 + i:10_001 + i], rtol=1e-5, atol=1e-5)
            answered += 1
    finally:
        client.close()
    record = wait_for(jobs, record["id"], finished)
    assert record["state"] == "completed" and record["done"] == 8000 and record["failed"] == 0, record
    assert answered > 0
    out = tmp_path / "busy.out.npy"
    jobs.download(record["id"], out)
    np.testing.assert_allclose(np.load(out), reference[:8000], rtol=1e-5, atol=1e-5)


def test_a_job_on_a_priority_level_is_not_packed(jobs: JobsClient, rows: np.ndarray, tmp_path: Path) -> None:
    """A level's lane keeps its read-ahead bound in rows: its job's requests are one batch each, as it says."""
    source = tmp_path / "level.npy"
    np.save(source, rows[:100])
    record = jobs.create({"model": "mlp", "input": str(source), "priority": 1, "pack_batches": 4})
    assert record["pack_batches"] == 1
    assert wait_for(jobs, record["id"], finished)["state"] == "completed"


@pytest.mark.parametrize("value", [0, 17, "4", 2.0, True])
def test_pack_batches_out_of_range_is_refused(jobs: JobsClient, rows: np.ndarray, tmp_path: Path,
                                             value: object) -> None:
    source = tmp_path / "ok.npy"
    np.save(source, rows[:10])
    with pytest.raises(JobsClientError) as exc:
        jobs.create({"model": "mlp", "input": str(source), "pack_batches": value})
    assert exc.value.status == 400 and "'pack_batches' must be an integer from 1 to 16" in exc.value.message


def test_resubmitting_an_id_returns_the_first_job(jobs: JobsClient, rows: np.ndarray, tmp_path: Path) -> None:
    source = tmp_path / "small.npy"
    np.save(source, rows[:100])
    first = jobs.create({"model": "mlp", "input": str(source), "id": "same-id"})
    again = jobs.create({"model": "mlp", "input": str(source), "id": "same-id", "priority": 1})
    assert again["id"] == first["id"] == "same-id" and again["created_at"] == first["created_at"]
    assert first["pack_batches"] == 4  # FLEET_JOB_PACK_BATCHES's default
    assert again["priority"] == 0
    assert wait_for(jobs, "same-id", finished)["state"] == "completed"
    assert sum(1 for j in jobs.list() if j["id"] == "same-id") == 1


def test_server_paths_outside_the_input_dirs_are_refused(jobs: JobsClient, tmp_path: Path) -> None:
    """FLEET_JOB_INPUT_DIRS is this session's temp dir (conftest): nothing else on the server is readable,
    neither by `..` nor through a symlink that points out of it."""
    link = tmp_path / "escape.npy"
    link.symlink_to(MLP)
    for candidate in ("/etc/passwd", str(tmp_path / ".." / ".." / ".." / "etc" / "passwd"), str(link), str(MLP)):
        with pytest.raises(JobsClientError) as exc:
            jobs.create({"model": "mlp", "input": candidate})
        assert exc.value.status == 400 and "outside the directories jobs may read" in exc.value.message


def jobs_dir(system: RunningSystem) -> Path:
    """Where `fleet up --data-dir DATA` keeps job uploads and outputs: DATA/jobs (tests/e2e/conftest.py)."""
    return system.log.parent / "data" / "jobs"


def pending_on(system: RunningSystem, model: str) -> float:
    import urllib.request

    with urllib.request.urlopen(system.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("nv_inference_pending_request_count") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no pending-count metric")


def mlp_executions(system: RunningSystem) -> int:
    """mlp's execution count (the statistics extension, summed over workers in Redis and over versions)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{system.url}/v2/models/mlp/stats", timeout=5) as r:
        return sum(int(s["execution_count"]) for s in json.loads(r.read())["model_stats"])


def executions_settle(system: RunningSystem, quiet_s: float, within_s: float) -> int:
    """mlp's execution count once it has not changed for `quiet_s`; fails if that takes over `within_s`."""
    deadline = time.monotonic() + within_s
    count, since = mlp_executions(system), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"mlp still executing {within_s} s after the cancel ({count})"
        time.sleep(0.05)
        now = mlp_executions(system)
        if now != count:
            count, since = now, time.monotonic()
    return count


def test_cancel_stops_feeding_and_drops_queued_items(jobs: JobsClient, system: RunningSystem,
                                                     tmp_path: Path) -> None:
    source = tmp_path / "big.npy"
    np.save(source, np.zeros((400_000, 256), dtype=np.float32))
    before = mlp_executions(system)
    record = jobs.create({"model": "mlp", "input": str(source), "output": {"format": "npy"}})
    wait_for(jobs, record["id"], lambda r: r["done"] >= 10_000)  # running at full speed, not stalled
    assert mlp_executions(system) > before  # the job's batches are what this count sees
    cancelled = jobs.cancel(record["id"])
    assert cancelled["state"] == "cancelled"
    # The runner sees the cancel within a fraction of a second and deletes its queued requests; what a
    # worker already holds (a batch or two) still runs. Uncancelled, this job keeps mlp busy for ~16 s
    # more (400k rows at the ~24k rows/s of bench/RESULTS.md), so executions would not stop within 8 s.
    # Quiet for 1.5 s, not less: a loaded host can pause that long between the batches a worker still holds.
    settled = executions_settle(system, quiet_s=1.5, within_s=8.0)
    # Its partial output is deleted (nobody can download a cancelled job's results).
    job_dir = jobs_dir(system) / record["id"]
    deadline = time.monotonic() + 5
    while job_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not job_dir.exists(), sorted(p.name for p in job_dir.iterdir())
    # Its queued requests were deleted, not left to compute (the workers' part of the count comes with their
    # next heartbeat: one taken just before the cancel may still say 1).
    deadline = time.monotonic() + 3
    while pending_on(system, "mlp") != 0:
        assert time.monotonic() < deadline, pending_on(system, "mlp")
        time.sleep(0.1)
    done = jobs.get(record["id"])["done"]
    assert done < 400_000
    time.sleep(1.0)
    assert mlp_executions(system) == settled, "mlp executed again after the cancel had taken effect"
    after = jobs.get(record["id"])
    assert after["state"] == "cancelled" and after["done"] == done


def children_of(pid: int) -> list[int]:
    """Running processes whose parent is `pid` (a job worker's line parsers, fleet/jobs/parse_pool.py)."""
    return [child for child, _ in children(pid) if running(child)]


def gone(pids: list[int], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(running(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_killed_job_worker_resumes_without_loss_or_duplicates(
        jobs: JobsClient, system: RunningSystem, rows: np.ndarray, reference: np.ndarray, tmp_path: Path) -> None:
    source = tmp_path / "resume.jsonl"
    write_jsonl(source, rows)
    record = jobs.create({"model": "mlp", "input": {"upload": jobs.upload(source)}})
    wait_for(jobs, record["id"], lambda r: r["done"] >= 2_000)
    victims = system.children("jobs-worker")
    assert len(victims) == 1
    parsers = children_of(victims[0])
    assert len(parsers) == 2, parsers  # a 33 MB JSONL job, FLEET_JOB_PARSE_PROCESSES=2 (tests/e2e/conftest.py)
    os.kill(victims[0], signal.SIGKILL)  # mid-job, no chance to save anything
    assert gone(parsers), "a line parser outlived its SIGKILLed job worker"
    at_kill = jobs.get(record["id"])
    assert at_kill["state"] == "running" and at_kill["done"] < len(rows), "the job finished before the kill"
    record = wait_for(jobs, record["id"], finished)
    assert record["state"] == "completed" and record["attempts"] >= 2, record
    assert record["done"] == len(rows) and record["failed"] == 0
    out = tmp_path / "resume.out.jsonl"
    jobs.download(record["id"], out)
    check_outputs(read_output(out), reference, list(range(1, len(rows) + 1)))


def test_max_failures_fails_the_job(jobs: JobsClient, rows: np.ndarray, tmp_path: Path) -> None:
    source = tmp_path / "bad.jsonl"
    write_jsonl(source, rows[:200], bad={5: "{nope", 6: "[]"})
    record = jobs.create({"model": "mlp", "input": str(source), "max_failures": 1})
    record = wait_for(jobs, record["id"], finished)
    assert record["state"] == "failed" and "max_failures 1" in record["error"], record
    assert "most common error (1 items): failed to parse the request JSON" in record["error"], record
    assert record["failed"] == 2


def test_fleet_submit_cli_uploads_waits_and_downloads(system: RunningSystem, rows: np.ndarray,
                                                     reference: np.ndarray, tmp_path: Path) -> None:
    source, out = tmp_path / "cli.npy", tmp_path / "cli.out.npy"
    np.save(source, rows[:3000])
    done = subprocess.run([sys.executable, "-m", "fleet", "submit", str(source), "--model", "mlp", "-o", str(out),
                           "--format", "npy", "--url", f"http://{system.url}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed" in done.stdout
    np.testing.assert_allclose(np.load(out), reference[:3000], rtol=1e-5, atol=1e-5)
    # Its failed-row mask came beside it (an .npy holds one array; GET .../results/failed serves the mask).
    np.testing.assert_array_equal(np.load(f"{out}.failed.npy"), np.zeros(3000, bool))


def test_sigterm_on_the_job_worker_saves_progress_and_the_job_resumes(
        jobs: JobsClient, system: RunningSystem, rows: np.ndarray, reference: np.ndarray, tmp_path: Path) -> None:
    source = tmp_path / "term.jsonl"
    write_jsonl(source, rows[:15_000])
    record = jobs.create({"model": "mlp", "input": {"upload": jobs.upload(source)}})
    wait_for(jobs, record["id"], lambda r: r["done"] >= 1_000)
    (victim,) = system.children("jobs-worker")
    parsers = children_of(victim)
    assert len(parsers) == 2, parsers
    started = time.monotonic()
    os.kill(victim, signal.SIGTERM)  # a stop, not a crash: the runner saves its progress and returns
    while Path(f"/proc/{victim}").exists() and time.monotonic() - started < 20:
        time.sleep(0.05)
    assert not Path(f"/proc/{victim}").exists() or Path(f"/proc/{victim}/stat").read_text().split()[2] == "Z"
    # Promptly: well under RQ's own 60 s pub/sub read (tests/integration/test_jobs_worker_stop.py), with room
    # for a loaded host.
    assert time.monotonic() - started < 15, "the job worker did not stop promptly mid-job"
    assert gone(parsers, 1), "its line parsers were not stopped with it"
    record = wait_for(jobs, record["id"], finished)  # `fleet up` restarts it; the job is resumed
    assert record["state"] == "completed" and record["attempts"] >= 2 and record["done"] == 15_000, record
    out = tmp_path / "term.out.jsonl"
    jobs.download(record["id"], out)
    check_outputs(read_output(out), reference[:15_000], list(range(1, 15_001)))


def submit_cli(system: RunningSystem, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet", "submit", *argv, "--url", f"http://{system.url}"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("field", "value"), [("priority", 2**63), ("priority", 2**64 + 1), ("priority", -1),
                                              ("priority", 1.5), ("priority", "1"), ("max_failures", 2**63),
                                              ("max_failures", -(2**63) - 1)])
def test_numeric_job_fields_out_of_range_are_refused_at_submission(
        jobs: JobsClient, rows: np.ndarray, tmp_path: Path, field: str, value: object) -> None:
    source = tmp_path / "ok.npy"
    np.save(source, rows[:10])
    before = {j["id"] for j in jobs.list()}
    with pytest.raises(JobsClientError) as exc:
        jobs.create({"model": "mlp", "input": str(source), field: value, "id": "refused"})
    assert exc.value.status == 400 and f"'{field}' must be an integer from 0 to {2**63 - 1}" in exc.value.message
    assert {j["id"] for j in jobs.list()} == before  # refused: nothing was created to fail later


def test_numbers_too_long_for_python_are_client_errors_without_python_advice(system: RunningSystem) -> None:
    url = f"http://{system.url}/v2/jobs"
    huge = "9" * 5000
    for body, status in ((f'{{"model": "mlp", "priority": {huge}}}', 400),
                         (f'{{"model": "mlp", "version": "{huge}", "input": "x"}}', 404),
                         ('{"model": "mlp", "version": "\u00b2", "input": "x"}', 404)):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        assert "sys.set_int_max_str_digits" not in response.text and "Traceback" not in response.text


def test_a_job_whose_every_line_has_the_wrong_shape_fails_fast_and_submit_exits_1(
        jobs: JobsClient, system: RunningSystem, tmp_path: Path) -> None:
    """The issue's reproduction: 60,000 lines with shape [256] for mlp, whose input is [-1, 256]."""
    source = tmp_path / "flat.jsonl"
    line = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [256], "data": [0.5] * 256}]})
    source.write_text((line + "\n") * 60_000)
    done = submit_cli(system, str(source), "--model", "mlp", "--server-path", "-o", str(tmp_path / "out.jsonl"))
    assert done.returncode == 1, done.stdout + done.stderr
    shape = ("unexpected shape for input 'INPUT0' for model 'mlp'. Expected [-1,256], got "
             "[256]. NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
             "prepended to each input shape. If you want to specify the full shape including the batch dim in your "
             "input dims config, try setting max_batch_size to zero. See the model configuration docs for more info "
             "on max_batch_size.")
    assert f"the first 100 lines all failed; most common error (100 lines): {shape}" in done.stdout, done.stdout
    record = jobs.get(done.stdout.splitlines()[0].strip())
    assert record["state"] == "failed" and record["done"] == record["failed"] < 60_000, record
    assert record["common_errors"] == [{"error": shape, "count": record["failed"]}]
    assert f"{record['failed']}  {shape}" in done.stdout  # the summary's error table


def test_submit_exits_3_when_some_lines_failed_and_lists_the_most_common_errors(
        system: RunningSystem, rows: np.ndarray, reference: np.ndarray, tmp_path: Path) -> None:
    source, out = tmp_path / "some-bad.jsonl", tmp_path / "some-bad.out.jsonl"
    wrong = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]})
    array = json.dumps([{"inputs": []}])  # a JSON array, not a request object
    write_jsonl(source, rows[:300], bad={3: wrong, 100: wrong, 200: array})
    done = submit_cli(system, str(source), "--model", "mlp", "-o", str(out))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "completed: 303 done, 3 failed" in done.stdout
    table = done.stdout[done.stdout.index("failed items by error, most common first:"):].splitlines()
    count, error = table[1].split(None, 1)
    assert count == "2" and error.startswith("unexpected shape for input 'INPUT0' for model 'mlp'. Expected "
                                             "[-1,256], got [1,3]. NOTE: ")
    assert table[2].split(None, 1)[0] == "1" and "must be an object" in table[2]
    lines = read_output(out)
    errors = [d["error"] for d in lines if "error" in d]
    assert len(lines) == 303 and not any("attribute" in e or "Error" in e for e in errors), errors
    check_outputs([d for d in lines if "error" not in d], reference[:300],
                  [i + 1 + (i >= 3) + (i >= 100) + (i >= 200) for i in range(300)])


def test_compressed_uploads_are_stored_decompressed(jobs: JobsClient, system: RunningSystem, rows: np.ndarray,
                                                    reference: np.ndarray, tmp_path: Path) -> None:
    source = tmp_path / "z.jsonl"
    write_jsonl(source, rows[:500])
    data = source.read_bytes()
    # Content-Encoding: gzip on the upload (what an HTTP client's compression sends)
    response = httpx.post(f"http://{system.url}/v2/jobs/uploads", params={"name": "z.jsonl"},
                          content=gzip.compress(data), headers={"content-encoding": "gzip"})
    assert response.status_code == 201 and response.json()["bytes"] == len(data), response.text
    tokens = [response.json()["upload"]]
    # a .jsonl.gz file, uploaded as it is (`fleet submit z.jsonl.gz` does this)
    packed = tmp_path / "z.jsonl.gz"
    packed.write_bytes(gzip.compress(data))
    tokens.append(jobs.upload(packed))
    for token in tokens:
        record = wait_for(jobs, jobs.create({"model": "mlp", "input": {"upload": token}})["id"], finished)
        assert record["state"] == "completed" and record["failed"] == 0, record
        out = tmp_path / f"{token}.jsonl"
        jobs.download(record["id"], out)
        check_outputs(read_output(out), reference[:500], list(range(1, 501)))
    uploads = jobs_dir(system) / "uploads"
    assert not list(uploads.glob("*.gz")) and not list(uploads.glob("*.part"))
