"""The bulk job runner against a real Redis: the window bounds rows from submission until written (a stuck
head cannot make answered rows pile up), a lost reply never stalls a job (its request is sent again
once its lane entry is gone; one still queued is left alone; one that cannot be decoded is dropped and its
request sent again), a job whose first lines all fail fails
fast with its most common error, a line the envelope cannot carry fails alone, and a cancelled job
leaves no output behind.

The test plays the model worker over the real streams (tests/support/lane_worker.py), so it decides which
request is answered when; faults are real deletions of lane and reply entries."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from fleet.admission import bulk_lane
from fleet.envelope import RequestEnvelope
from fleet.jobs.records import CANCELLED, COMPLETED, FAILED, QUEUED, RUNNING, JobStore, view
from fleet.jobs.runner import JobOptions, JobRunner
from fleet.keys import Keys
from fleet.redis_server import LocalServer
from fleet.repository import scan
from tests.support.lane_worker import ANSWER, FAIL, GARBLE_REPLY, HOLD, LOSE_REPLY, LOSE_REQUEST, LaneWorker, answer_all
from tests.support.model_repo import python_config, write_model

MODEL = "quad"
MAX_BATCH = 4  # rows per request: the runner packs 4 one-row items into each
ROWS = 4  # elements per item


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_model(tmp_path / "repo", MODEL, python_config(max_batch_size=MAX_BATCH))
    return tmp_path / "repo"


def inputs(n: int) -> np.ndarray:
    return np.arange(n * ROWS, dtype=np.float32).reshape(n, ROWS)


def write_jsonl(path: Path, x: np.ndarray) -> None:
    with path.open("w") as f:
        for row in x:
            f.write(json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, ROWS],
                                            "data": row.tolist()}]}) + "\n")


class Job:
    """One job record and a runner for it on a thread, as an RQ job worker would run it."""

    def __init__(self, url: str, key_prefix: str, repo: Path, tmp: Path, items: np.ndarray | list[str],
                 window_rows: int, reply_timeout_s: float, max_failures: int = -1, pack_batches: int = 1,
                 npy: bool = False) -> None:
        self.client = redis.Redis.from_url(url, protocol=2)
        self.keys = Keys(key_prefix)
        self.store = JobStore(self.client, self.keys)
        self.id = "job1"
        kind = "npy" if npy else "jsonl"  # .npy: the rows as one array, read and written in blocks
        self.output = tmp / f"out.{kind}"
        source = tmp / f"in.{kind}"
        if isinstance(items, list):
            source.write_text("".join(line + "\n" for line in items))
        elif npy:
            np.save(source, items)
        else:
            write_jsonl(source, items)
        self.store.create(self.id, {"model": MODEL, "version": 1, "priority": 0, "input": str(source),
                                    "input_kind": kind, "output": str(self.output), "output_format": kind,
                                    "max_failures": max_failures, "pack_batches": pack_batches})
        options = JobOptions(key_prefix, [str(repo)], window_rows, lease_ms=5000, reply_timeout_s=reply_timeout_s)
        self.runner = JobRunner(redis.Redis.from_url(url, protocol=2), self.id, options)
        self.outcome: list[str] = []
        self.thread = threading.Thread(target=lambda: self.outcome.append(self.runner.run()), daemon=True)
        self.lane = self.keys.queue(MODEL, bulk_lane(scan([repo]).models[MODEL].spec), version=1)

    def state(self) -> str:
        return str(self.record()["state"])

    def record(self) -> dict[str, Any]:
        record = self.store.get(self.id)
        assert record is not None
        return view(record, self.store.errors(self.id))

    def run_alone(self, timeout_s: float = 20.0) -> str:
        """Run the job with nothing answering its lane (for jobs whose items never reach it)."""
        self.thread.start()
        self.thread.join(timeout_s)
        assert self.outcome, f"job still {self.state()}"
        return self.outcome[0]

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.output.read_text().splitlines()]

    def stop(self) -> None:
        """Cancel the job (if it still runs) so its runner returns, and wait for it."""
        self.store.transition(self.id, CANCELLED, (QUEUED, RUNNING))
        self.thread.join(10)


@pytest.fixture
def make_job(redis_server: LocalServer, key_prefix: str, repo: Path, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def make(items: np.ndarray | list[str], window_rows: int, reply_timeout_s: float, max_failures: int = -1,
             pack_batches: int = 1, npy: bool = False) -> Job:
        job = Job(redis_server.url, key_prefix, repo, tmp_path, items, window_rows, reply_timeout_s, max_failures,
                  pack_batches, npy)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


def serve_until(job: Job, worker: LaneWorker, decide: Callable[[RequestEnvelope, int], str],
                done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"job state {job.state()}, submissions {dict(worker.sent)}"
        worker.poll(decide)
        time.sleep(0.005)


def check_output(job: Job, items: np.ndarray) -> None:
    """One line per item, in input order, each 2 * its input."""
    lines = [json.loads(line) for line in job.output.read_text().splitlines()]
    assert [d["line"] for d in lines] == list(range(1, len(items) + 1))
    got = np.array([d["outputs"][0]["data"] for d in lines], dtype=np.float32)
    np.testing.assert_array_equal(got, items * 2)


def test_packed_requests_hold_several_batches_and_a_failed_one_goes_again_unpacked(
        make_job: Callable[..., Job]) -> None:
    """pack_batches 4: 40 one-row lines go as requests of 16, 16 and 8 rows. Each of those fails here (as a model
    might); its lines are sent again as they would have gone unpacked, 4 to a request, not one by one."""
    items = inputs(40)
    job = make_job(items, window_rows=64, reply_timeout_s=3600, pack_batches=4)
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()

    def decide(env: RequestEnvelope, sends: int) -> str:
        return FAIL if env.batch_rows(True) > MAX_BATCH else ANSWER

    serve_until(job, worker, decide, lambda: bool(job.outcome))
    assert job.outcome == [COMPLETED] and job.record()["failed"] == 0
    assert sorted(worker.sent) == sorted([f"{job.id}:0+16", f"{job.id}:16+16", f"{job.id}:32+8"]
                                         + [f"{job.id}:{i}+4" for i in range(0, 40, 4)])
    assert set(worker.sent.values()) == {1} and worker.rows == 80
    check_output(job, items)


def test_an_item_failing_in_a_request_split_twice_fails_alone(make_job: Callable[..., Job]) -> None:
    """pack_batches 4: the request of rows 0-15 fails, and so does the one of rows 4-7 it is sent again as;
    rows 4-7 then go one by one, and only row 5's own request fails: its line is its error, every other line
    its result, in order."""
    items = inputs(40)
    job = make_job(items, window_rows=64, reply_timeout_s=3600, pack_batches=4)
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()

    def decide(env: RequestEnvelope, sends: int) -> str:
        start, count = (int(v) for v in env.id.rsplit(":", 1)[1].split("+"))
        return FAIL if start <= 5 < start + count else ANSWER

    serve_until(job, worker, decide, lambda: bool(job.outcome))
    assert job.outcome == [COMPLETED] and job.record()["failed"] == 1
    assert {f"{job.id}:0+16", f"{job.id}:4+4", f"{job.id}:5+1", f"{job.id}:4+1", f"{job.id}:7+1"} <= set(worker.sent)
    lines = [json.loads(line) for line in job.output.read_text().splitlines()]
    assert [d["line"] for d in lines] == list(range(1, 41))
    assert lines[5] == {"line": 6, "error": "the model failed"}
    got = np.array([d["outputs"][0]["data"] for k, d in enumerate(lines) if k != 5], dtype=np.float32)
    np.testing.assert_array_equal(got, np.delete(items, 5, axis=0) * 2)


def test_a_row_failing_in_an_arrays_block_fails_alone(make_job: Callable[..., Job]) -> None:
    """An .npy job's rows go as blocks of a batch (one item of 4 rows each). The block of rows 4-7 fails, as
    a model might on one bad row: its rows go again one by one, under ids of their own, and only row 5 fails
    (flagged in the mask, zero); before, all four of the block's rows failed."""
    items = inputs(12)
    job = make_job(items, window_rows=64, reply_timeout_s=3600, npy=True)
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()

    def decide(env: RequestEnvelope, sends: int) -> str:
        start = int(env.id.rsplit(":", 1)[1].split("+")[0])  # a block's id counts its item, not its rows
        return FAIL if start <= 5 < start + env.batch_rows(True) else ANSWER

    serve_until(job, worker, decide, lambda: bool(job.outcome))
    assert job.outcome == [COMPLETED] and job.record()["failed"] == 1
    assert set(worker.sent) == {f"{job.id}:{i}+1" for i in (0, 4, 8)} | {f"{job.id}:{i}+1/r" for i in range(4, 8)}
    np.testing.assert_array_equal(np.load(f"{job.output}.failed.npy"), [k == 5 for k in range(12)])
    want = items * 2
    want[5] = 0
    np.testing.assert_array_equal(np.load(job.output), want)


def test_a_stuck_head_never_lets_the_runner_hold_more_than_the_window(make_job: Callable[..., Job]) -> None:
    items = inputs(400)
    window = 16
    job = make_job(items, window_rows=window, reply_timeout_s=3600)  # the head is queued: never resent
    head = f"{job.id}:0+{MAX_BATCH}"
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()

    def decide(env: RequestEnvelope, sends: int) -> str:
        return HOLD if env.id == head else ANSWER

    # Everything behind the head is answered at once; none of it can be written before the head is.
    serve_until(job, worker, decide, lambda: worker.rows >= window)
    quiet_until = time.monotonic() + 1.0
    while time.monotonic() < quiet_until:
        worker.poll(decide)
        time.sleep(0.005)
    assert worker.rows == window, f"{worker.rows} rows submitted while the head was unanswered (window {window})"
    assert list(worker.held) == [head] and job.state() == RUNNING

    worker.release(head)
    serve_until(job, worker, decide, lambda: bool(job.outcome))
    assert job.outcome == [COMPLETED] and job.state() == COMPLETED
    assert set(worker.sent.values()) == {1} and worker.rows == len(items)
    check_output(job, items)


def test_a_lost_reply_is_sent_again_and_the_job_completes(make_job: Callable[..., Job]) -> None:
    items = inputs(40)
    timeout_s = 0.3
    job = make_job(items, window_rows=16, reply_timeout_s=timeout_s)
    lost_reply, lost_request, slow = (f"{job.id}:{i}+{MAX_BATCH}" for i in (4, 8, 12))
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()

    def decide(env: RequestEnvelope, sends: int) -> str:
        if sends > 1:
            return ANSWER
        return {lost_reply: LOSE_REPLY, lost_request: LOSE_REQUEST, slow: HOLD}.get(env.id, ANSWER)

    # The slow one stays queued for several reply timeouts: its entry exists, so it is not sent again.
    serve_until(job, worker, decide, lambda: slow in worker.held)
    held_since = time.monotonic()
    serve_until(job, worker, decide, lambda: time.monotonic() - held_since > 4 * timeout_s)
    worker.release(slow)
    serve_until(job, worker, decide, lambda: bool(job.outcome))

    assert job.outcome == [COMPLETED] and job.state() == COMPLETED
    assert worker.sent[lost_reply] == 2 and worker.sent[lost_request] == 2, dict(worker.sent)
    assert worker.sent[slow] == 1
    assert sum(worker.sent.values()) == len(items) // MAX_BATCH + 2
    check_output(job, items)
    record = job.store.get(job.id)
    assert record is not None and record["done"] == len(items) and record["failed"] == 0


def test_a_results_stream_that_went_back_is_read_again_and_the_job_completes(make_job: Callable[..., Job]) -> None:
    """Redis lost the job's results stream (a restart or failover that did not keep it) and its clock is an
    hour behind: new replies get ids below the last one the runner read. At its reply timeout the runner
    finds the stream went back and reads it from the start, where those replies still are (it deletes only
    what it has read): no request is sent twice. Before, the job waited for the clock (an hour)."""
    items = inputs(40)
    job = make_job(items, window_rows=16, reply_timeout_s=0.3)
    worker = LaneWorker(job.client, job.lane)
    results = job.runner.results
    job.thread.start()
    # Replies read (the runner trims what it has read) before the stream is lost.
    serve_until(job, worker, answer_all, lambda: sum(worker.sent.values()) >= 4 and job.client.xlen(results) <= 1)
    assert not job.outcome
    job.client.delete(results)
    worker.clock_behind_ms = 3_600_000
    serve_until(job, worker, answer_all, lambda: bool(job.outcome))
    assert job.outcome == [COMPLETED], dict(worker.sent)
    assert set(worker.sent.values()) == {1}, dict(worker.sent)
    check_output(job, items)


def test_a_reply_that_cannot_be_decoded_is_dropped_and_its_request_sent_again(make_job: Callable[..., Job]) -> None:
    items = inputs(12)
    job = make_job(items, window_rows=16, reply_timeout_s=0.3)
    garbled = f"{job.id}:4+{MAX_BATCH}"
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()
    serve_until(job, worker, lambda env, sends: GARBLE_REPLY if env.id == garbled and sends == 1 else ANSWER,
                lambda: bool(job.outcome))
    assert job.outcome == [COMPLETED] and worker.sent[garbled] == 2, dict(worker.sent)
    check_output(job, items)


def line(values: list[float], **extra: Any) -> str:
    return json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, len(values)], "data": values}],
                       **extra})


GOOD = line([1.0, 2.0, 3.0, 4.0])
WRONG_SHAPE = line([1.0, 2.0, 3.0])  # IN is [-1, 4]: every line like this fails the same way
# A line's error is what the online route answers for the same body (tritonserver's words), without its
# "[request id: ...]" prefix.
SHAPE_ERROR = (f"unexpected shape for input 'IN' for model '{MODEL}'. Expected [-1,4], got "
               f"[1,3]. NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
               f"prepended to each input shape. If you want to specify the full shape including the batch dim in your "
               f"input dims config, try setting max_batch_size to zero. See the model configuration docs for more info "
               f"on max_batch_size.")


def test_a_job_whose_first_lines_all_fail_fails_fast_with_its_most_common_error(
        make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.jobs.jsonl_output import JsonlOutput

    job = make_job([WRONG_SHAPE] * 300, window_rows=16, reply_timeout_s=3600)
    finish, states = JsonlOutput.finish, []

    def finishing(self: JsonlOutput, partial: bool = False) -> None:
        states.append(job.state())  # its output is finished before the job says it failed (a download follows)
        finish(self, partial)

    monkeypatch.setattr(JsonlOutput, "finish", finishing)
    assert job.run_alone() == FAILED
    assert states == [RUNNING]
    record = job.record()
    assert record["state"] == FAILED and record["total"] == 300
    assert record["error"] == f"the first 100 lines all failed; most common error (100 lines): {SHAPE_ERROR}"
    # It stops within a window of the 100th line, and says what went wrong with every line it read.
    assert 100 <= record["done"] == record["failed"] < 100 + 16
    assert record["common_errors"] == [{"error": SHAPE_ERROR, "count": record["done"]}]
    assert len(record["errors"]) == 20 and record["errors"][0] == {"line": 1, "error": SHAPE_ERROR}
    # A failed job keeps what it wrote: here one error line per line read.
    assert [d["line"] for d in job.lines()] == list(range(1, record["done"] + 1))


def test_a_small_job_whose_lines_all_fail_is_failed_not_completed(make_job: Callable[..., Job]) -> None:
    job = make_job([WRONG_SHAPE] * 3 + ["{not json"] * 2, window_rows=16, reply_timeout_s=3600)
    assert job.run_alone() == FAILED
    record = job.record()
    assert record["error"] == f"all 5 lines failed; most common error (3 lines): {SHAPE_ERROR}"
    assert [c["count"] for c in record["common_errors"]] == [3, 2]


def test_one_success_among_the_first_lines_lets_the_job_run_on(make_job: Callable[..., Job]) -> None:
    lines = [WRONG_SHAPE] * 300
    lines[60] = GOOD
    job = make_job(lines, window_rows=16, reply_timeout_s=3600)
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()
    serve_until(job, worker, answer_all, lambda: bool(job.outcome))
    record = job.record()
    assert job.outcome == [COMPLETED] and record["done"] == 300 and record["failed"] == 299
    assert record["common_errors"] == [{"error": SHAPE_ERROR, "count": 299}]


def test_max_failures_replaces_the_fail_fast_rule(make_job: Callable[..., Job]) -> None:
    job = make_job([WRONG_SHAPE] * 300, window_rows=16, reply_timeout_s=3600, max_failures=1000)
    assert job.run_alone() == COMPLETED
    record = job.record()
    assert record["failed"] == 300 and record["common_errors"] == [{"error": SHAPE_ERROR, "count": 300}]


@pytest.mark.parametrize("parameters", [{"big": 2**64}, {"big": -(2**63) - 1}, {"big": 10**30}])
def test_a_parameter_the_envelope_cannot_carry_fails_its_line_not_the_job(make_job: Callable[..., Job],
                                                                           parameters: dict[str, int]) -> None:
    items = inputs(8)
    lines = [line(row.tolist()) for row in items]
    lines[3] = line(items[3].tolist(), parameters=parameters)
    job = make_job(lines, window_rows=16, reply_timeout_s=3600)
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()
    serve_until(job, worker, answer_all, lambda: bool(job.outcome))
    record = job.record()
    assert job.outcome == [COMPLETED] and record["done"] == 8 and record["failed"] == 1, record
    (sample,) = record["errors"]
    assert sample["line"] == 4 and "'big'" in sample["error"] and "64-bit" in sample["error"], sample
    out = job.lines()
    assert [d["line"] for d in out] == list(range(1, 9)) and out[3] == {"line": 4, "error": sample["error"]}
    good = [d["outputs"][0]["data"] for d in out if "outputs" in d]
    np.testing.assert_array_equal(np.array(good, dtype=np.float32), np.delete(items, 3, axis=0) * 2)


def test_an_output_json_cannot_carry_fails_its_line_not_the_job(make_job: Callable[..., Job]) -> None:
    items = inputs(8)
    items[5, 0] = 3e38  # finite in FP32; doubled by the model, it is infinity
    job = make_job([line(row.tolist()) for row in items], window_rows=16, reply_timeout_s=3600)
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()
    with np.errstate(over="ignore"):  # the model's overflow is the point here
        serve_until(job, worker, answer_all, lambda: bool(job.outcome))
    assert job.outcome == [COMPLETED] and job.record()["failed"] == 1
    out = job.lines()  # every line valid JSON, the bad one an error line in its place
    assert [d["line"] for d in out] == list(range(1, 9)) and "NaN or infinity" in out[5]["error"]


def test_a_cancelled_job_deletes_its_partial_output(make_job: Callable[..., Job]) -> None:
    job = make_job(inputs(400), window_rows=16, reply_timeout_s=3600)
    head = f"{job.id}:8+{MAX_BATCH}"  # two requests are answered and written, then the job waits on this one
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()

    def decide(env: RequestEnvelope, sends: int) -> str:
        return HOLD if env.id == head else ANSWER

    serve_until(job, worker, decide, lambda: job.output.exists() and job.record()["done"] >= 8)
    assert job.output.stat().st_size > 0
    job.store.transition(job.id, CANCELLED, (QUEUED, RUNNING))
    serve_until(job, worker, decide, lambda: bool(job.outcome))
    assert job.outcome == [CANCELLED] and not job.output.exists()
    assert job.output.parent.exists()  # only the output goes: the directory still holds the input


def test_a_job_failing_on_a_fault_of_ours_flags_the_rows_it_never_wrote(make_job: Callable[..., Job],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner fault (an exception of no kind the feed expects, here from the output's write of rows 4-5) fails
    the job with an internal error, and its .npy keeps what it wrote with every row never written flagged,
    as a job failed by its lines' errors does, not left zero and unflagged as if results."""
    from fleet.jobs import outputs

    write = outputs._ArrayOutput.write

    def faulty(self: Any, item: Any, *args: Any) -> None:
        if item.index >= MAX_BATCH:  # the second block (rows 4-5)
            raise RuntimeError("a bug")
        write(self, item, *args)

    monkeypatch.setattr(outputs._ArrayOutput, "write", faulty)
    items = inputs(6)
    job = make_job(items, window_rows=64, reply_timeout_s=3600, npy=True)
    worker = LaneWorker(job.client, job.lane)
    job.thread.start()
    serve_until(job, worker, answer_all, lambda: bool(job.outcome))
    assert job.outcome[0].startswith("failed: internal error in the job runner (RuntimeError)")
    assert job.record()["state"] == FAILED
    mask = np.load(f"{job.output}.failed.npy")
    assert not mask[:MAX_BATCH].any() and mask[MAX_BATCH:].all(), mask
