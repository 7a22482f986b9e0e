"""fleet.job_client: CLI parsing, pure rendering, and JobsClient request construction over httpx.MockTransport.

The gateway's /v2/jobs API is stubbed by a handler here only to check what the client sends and how it maps
errors; nothing sleeps (the poll sleep is injected) and nothing opens a socket.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet import job_client
from fleet.cli import build_parser, main
from fleet.job_client import (
    JobsClient,
    JobsClientError,
    default_output_path,
    exit_code_for,
    format_duration_s,
    format_record,
    job_row,
    job_spec,
    progress_fields,
    resolve_url,
    run,
    summary_line,
)

BASE = "http://gw.test:8000"
Handler = Callable[[httpx.Request], httpx.Response]


def record(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "job-1", "model": "minilm", "version": "", "state": "running", "priority": 0, "total": 100,
        "done": 40, "failed": 2, "written": 38, "throughput": 12.345, "eta_s": 65.0, "errors": [],
        "error": "", "created_at": 0.0, "started_at": 10.0, "finished_at": None, "output": {"format": "jsonl"},
    }
    return base | overrides


def client_with(handler: Handler, **kwargs: Any) -> JobsClient:
    return JobsClient(BASE + "/", httpx.Client(transport=httpx.MockTransport(handler)), **kwargs)


# ---------------------------------------------------------------- argument parsing


def test_submit_parses_every_option() -> None:
    args = build_parser().parse_args([
        "submit", "data.jsonl", "--model", "m", "--model-version", "2", "-o", "out.jsonl", "--priority", "3",
        "--id", "nightly", "--max-failures", "5", "--format", "npz", "--no-wait", "--server-path",
        "--url", "http://x:1", "--pack-batches", "4",
    ])
    assert (args.command, args.input, args.model, args.model_version) == ("submit", "data.jsonl", "m", "2")
    assert (args.output, args.priority, args.job_id, args.max_failures) == (Path("out.jsonl"), 3, "nightly", 5)
    assert (args.format, args.no_wait, args.server_path, args.url) == ("npz", True, True, "http://x:1")
    assert args.pack_batches == 4


def test_submit_defaults_leave_options_to_the_gateway() -> None:
    args = build_parser().parse_args(["submit", "in.npy", "--model", "m"])
    assert args.output is args.priority is args.job_id is args.max_failures is args.format is args.url is None
    assert args.pack_batches is None
    assert not args.no_wait and not args.server_path
    assert job_spec(args, {"upload": "tok"}) == {"model": "m", "input": {"upload": "tok"}}


def test_job_spec_carries_set_options() -> None:
    args = build_parser().parse_args(["submit", "/srv/in.jsonl", "--model", "m", "--model-version", "1",
                                      "--priority", "0", "--id", "a", "--max-failures", "0", "--format", "npy",
                                      "--pack-batches", "2"])
    assert job_spec(args, "/srv/in.jsonl") == {
        "model": "m", "input": "/srv/in.jsonl", "version": "1", "priority": 0, "id": "a", "max_failures": 0,
        "pack_batches": 2, "output": {"format": "npy"},
    }


@pytest.mark.parametrize(("output", "fmt"), [("o.npy", "npy"), ("o.npz", "npz"), ("o.jsonl", "jsonl"), ("o.bin", None)])
def test_the_output_suffix_picks_the_format(output: str, fmt: str | None) -> None:
    args = build_parser().parse_args(["submit", "in.npy", "--model", "m", "-o", output])
    assert job_spec(args, "in.npy").get("output") == (None if fmt is None else {"format": fmt})


@pytest.mark.parametrize("argv", [["submit", "x"], ["submit", "x", "--model", "m", "--format", "csv"], ["job"],
                                  ["cancel"]])
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2


def test_job_jobs_cancel_parse() -> None:
    parser = build_parser()
    job = parser.parse_args(["job", "abc", "--json"])
    assert (job.command, job.job_id, job.json) == ("job", "abc", True)
    assert parser.parse_args(["jobs", "--url", "http://h"]).url == "http://h"
    assert parser.parse_args(["cancel", "abc"]).job_id == "abc"


def test_main_dispatches_job_commands_without_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def fake_run(args: Any) -> int:
        seen.append(args.command)
        return 7

    monkeypatch.setattr(job_client, "run", fake_run)
    monkeypatch.setattr("fleet.cli.settings_from_args", lambda args: pytest.fail("built Settings"))
    assert main(["jobs"]) == 7 and seen == ["jobs"]


def test_url_flag_then_env_then_default() -> None:
    assert resolve_url("http://flag", {"FLEET_URL": "http://env"}) == "http://flag"
    assert resolve_url(None, {"FLEET_URL": "http://env"}) == "http://env"
    assert resolve_url(None, {}) == "http://127.0.0.1:8000"


# ---------------------------------------------------------------- rendering


def test_job_row() -> None:
    assert job_row(record(), UTC) == ("job-1", "minilm", "running", "40/100", "2", "12.3", "1970-01-01 00:00:00")
    assert job_row(record(total=None, throughput=None, created_at=None), UTC)[3:] == ("40/?", "2", "0.0", "-")


def test_format_record_includes_error_samples() -> None:
    text = format_record(record(state="failed", version="3", error="too many failures", finished_at=20.0,
                                errors=[{"line": 7, "error": "bad json"}, {"line": 9, "error": "shape"}]), UTC)
    lines = text.splitlines()
    assert "model:      minilm (version 3)" in lines
    assert "progress:   40/100 done, 2 failed, 38 written" in lines
    assert "throughput: 12.3 items/s, ETA 0:01:05" in lines
    assert "finished:   1970-01-01 00:00:20" in lines
    assert "error:      too many failures" in lines
    assert lines[-3:] == ["errors (2 samples):", "  line 7: bad json", "  line 9: shape"]
    assert "error:" not in format_record(record(), UTC)
    counted = format_record(record(common_errors=[{"error": "shape", "count": 12}, {"error": "bad json", "count": 3}]))
    assert "failed items by error, most common first:\n  12  shape\n   3  bad json" in counted


def test_progress_fields_and_durations() -> None:
    assert progress_fields(record()) == {"rate": "12.3 items/s", "eta": "ETA 0:01:05", "failed": "2 failed"}
    assert progress_fields(record(eta_s=None))["eta"] == "ETA --"
    assert format_duration_s(3725.4) == "1:02:05"


def test_summary_line() -> None:
    done = record(state="completed", done=100, finished_at=22.0)
    assert summary_line(done, Path("a.out.jsonl")) == (
        "job job-1 completed: 100 done, 2 failed in 0:00:12, 12.3 items/s -> a.out.jsonl")
    assert summary_line(record(state="failed", error="boom", started_at=None)).endswith("items/s; boom")


@pytest.mark.parametrize(("src", "fmt", "server", "expected"), [
    ("data/in.jsonl", "jsonl", False, Path("data/in.out.jsonl")),
    ("data/x.npy", "npz", False, Path("data/x.out.npz")),
    ("/srv/big.jsonl", "npy", True, Path("big.out.npy")),
    ("data/in.jsonl.gz", "jsonl", False, Path("data/in.out.jsonl")),
])
def test_default_output_path(src: str, fmt: str, server: bool, expected: Path) -> None:
    assert default_output_path(src, fmt, server_path=server) == expected


def test_exit_codes() -> None:
    assert [exit_code_for(s) for s in ("completed", "failed", "cancelled")] == [0, 1, 1]
    assert [exit_code_for(s, failed=3) for s in ("completed", "failed", "cancelled")] == [3, 1, 1]


# ---------------------------------------------------------------- JobsClient requests


def test_upload_streams_the_file_with_content_length(tmp_path: Path) -> None:
    src = tmp_path / "in put.jsonl"
    src.write_bytes(b"x" * 2500)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json={"upload": "tok-1", "bytes": len(request.read())})

    chunks: list[int] = []
    assert client_with(handler, chunk_bytes=1000).upload(src, chunks.append) == "tok-1"
    (req,) = seen
    assert req.method == "POST" and req.url.path == "/v2/jobs/uploads" and req.url.params["name"] == "in put.jsonl"
    assert req.headers["content-length"] == "2500" and "transfer-encoding" not in req.headers
    assert req.content == src.read_bytes()
    assert chunks == [1000, 1000, 500]  # read from disk chunk by chunk, not all at once


def test_create_get_list_cancel_requests() -> None:
    seen: list[tuple[str, str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), request.read()))
        return httpx.Response(200, json={"jobs": [record()]} if request.url.path == "/v2/jobs" and
                              request.method == "GET" else record())

    c = client_with(handler)
    spec = {"model": "m", "input": {"upload": "t"}, "priority": 0}
    assert c.create(spec)["id"] == "job-1"
    assert c.get("a/b")["state"] == "running"
    assert [j["id"] for j in c.list()] == ["job-1"]
    c.cancel("job-1")
    assert [(m, u) for m, u, _ in seen] == [("POST", f"{BASE}/v2/jobs"), ("GET", f"{BASE}/v2/jobs/a%2Fb"),
                                           ("GET", f"{BASE}/v2/jobs"), ("DELETE", f"{BASE}/v2/jobs/job-1")]
    assert json.loads(seen[0][2]) == spec


def test_gateway_error_maps_to_jobs_client_error() -> None:
    c = client_with(lambda r: httpx.Response(404, json={"error": "unknown job 'x'"}))
    with pytest.raises(JobsClientError) as exc:
        c.get("x")
    assert (exc.value.message, exc.value.status, str(exc.value)) == ("unknown job 'x'", 404,
                                                                     "unknown job 'x' (HTTP 404)")
    with pytest.raises(JobsClientError) as exc:
        client_with(lambda r: httpx.Response(502, text="Bad Gateway")).list()
    assert (exc.value.message, exc.value.status) == ("Bad Gateway", 502)


def test_unreachable_gateway_has_no_status() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(JobsClientError) as exc:
        client_with(handler).list()
    assert exc.value.status is None and "cannot reach the gateway at http://gw.test:8000" in exc.value.message


def test_download_writes_dest_and_maps_409(tmp_path: Path) -> None:
    body = b'{"a": 1}\n' * 1000
    ok = client_with(lambda r: httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"}))
    dest = tmp_path / "out.jsonl"
    assert ok.download("j", dest) == len(body) and dest.read_bytes() == body
    busy = client_with(lambda r: httpx.Response(409, json={"error": "job j is running"}))
    with pytest.raises(JobsClientError) as exc:
        busy.download("j", tmp_path / "other.jsonl")
    assert (exc.value.message, exc.value.status) == ("job j is running", 409)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no .part left behind


# ---------------------------------------------------------------- the driver, end to end over MockTransport


class FakeGateway:
    """Answers the /v2/jobs calls of one `fleet submit`: the job walks through `states`, then serves results."""

    def __init__(self, states: list[dict[str, Any]], results_status: int = 200) -> None:
        self.states = states
        self.calls: list[str] = []
        self.created: dict[str, Any] = {}
        self.results_status = results_status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v2/jobs/uploads":
            return httpx.Response(201, json={"upload": "tok", "bytes": len(request.read())})
        if request.method == "POST":
            self.created = json.loads(request.read())
            return httpx.Response(201, json=record(state="queued", done=0))
        if request.url.path.endswith("/results"):
            if self.results_status != 200:
                return httpx.Response(self.results_status, json={"error": "job job-1 failed without an output"})
            return httpx.Response(200, content=b"RESULTS")
        return httpx.Response(200, json=self.states.pop(0) if len(self.states) > 1 else self.states[0])


def submit(argv: list[str], gateway: FakeGateway, sleep: Callable[[float], None] | None = None) -> int:
    naps: list[float] = []
    args = build_parser().parse_args(["submit", *argv])
    return run(args, client=client_with(gateway), environ={}, sleep=sleep or naps.append)


def test_submit_uploads_waits_and_downloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hi"}\n')
    gw = FakeGateway([record(), record(state="completed", done=100, failed=0, finished_at=20.0)])
    assert submit([str(src), "--model", "minilm", "--priority", "1"], gw) == 0
    assert gw.created == {"model": "minilm", "input": {"upload": "tok"}, "priority": 1}
    assert gw.calls == ["POST /v2/jobs/uploads", "POST /v2/jobs", "GET /v2/jobs/job-1", "GET /v2/jobs/job-1",
                        "GET /v2/jobs/job-1/results"]
    assert (tmp_path / "in.out.jsonl").read_bytes() == b"RESULTS"
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "job-1" and out[-1].startswith("job job-1 completed: 100 done") and "in.out.jsonl" in out[-1]


COMMON = [{"error": "unexpected shape for input 'IN'", "count": 1200}, {"error": "bad json", "count": 7}]


def test_submit_failed_job_exits_1_and_fetches_what_it_wrote(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    failed = record(state="failed", error="the first 100 lines all failed; most common error (100 lines): shape",
                    failed=100, common_errors=COMMON[:1])
    out = tmp_path / "partial.jsonl"
    gw = FakeGateway([failed])
    assert submit(["/srv/in.jsonl", "--model", "m", "--server-path", "-o", str(out)], gw) == 1
    assert gw.created["input"] == "/srv/in.jsonl" and out.read_bytes() == b"RESULTS"
    text = capsys.readouterr().out
    assert "the first 100 lines all failed" in text and f"-> {out}" in text
    assert "failed items by error, most common first:" in text and "1200  unexpected shape for input 'IN'" in text
    # A job that failed before writing anything has no output: nothing is fetched, still exit 1.
    gw = FakeGateway([record(state="failed", error="model 'm' is not in the model repository")], results_status=404)
    assert submit(["/srv/in.jsonl", "--model", "m", "--server-path", "-o", str(tmp_path / "none.jsonl")], gw) == 1
    assert not (tmp_path / "none.jsonl").exists() and "->" not in capsys.readouterr().out


def test_submit_completed_with_failed_items_exits_3_with_the_common_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gw = FakeGateway([record(state="completed", done=100, failed=1207, common_errors=COMMON, finished_at=20.0)])
    assert submit(["/srv/in.jsonl", "--model", "m", "--server-path", "-o", str(tmp_path / "o.jsonl")], gw) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == ["failed items by error, most common first:", "  1200  unexpected shape for input 'IN'",
                          "     7  bad json"]
    assert (tmp_path / "o.jsonl").read_bytes() == b"RESULTS"


def test_submit_no_wait_prints_id_only(capsys: pytest.CaptureFixture[str]) -> None:
    gw = FakeGateway([record()])
    assert submit(["/srv/in.jsonl", "--model", "m", "--server-path", "--no-wait"], gw) == 0
    assert capsys.readouterr().out == "job-1\n" and gw.calls == ["POST /v2/jobs"]


def test_submit_ctrl_c_leaves_job_running(capsys: pytest.CaptureFixture[str]) -> None:
    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    assert submit(["/srv/in.jsonl", "--model", "m", "--server-path"], FakeGateway([record()]), interrupt) == 130
    err = capsys.readouterr().err
    assert "job job-1 keeps running on the server" in err and f"fleet cancel job-1 --url {BASE}" in err


def test_http_errors_exit_2_with_the_gateway_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = client_with(lambda r: httpx.Response(400, json={"error": "unknown model 'nope'"}))
    assert run(build_parser().parse_args(["cancel", "x"]), client=c) == 2
    assert capsys.readouterr().err.strip() == "error: unknown model 'nope' (HTTP 400)"
    args = build_parser().parse_args(["submit", str(tmp_path / "missing.jsonl"), "--model", "m"])
    assert run(args, client=c) == 2 and "no such file" in capsys.readouterr().err


def test_jobs_table_and_job_json(capsys: pytest.CaptureFixture[str]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"jobs": [record(id="[b]"), record()]} if request.url.path == "/v2/jobs"
                              else record())

    assert run(build_parser().parse_args(["jobs"]), client=client_with(handler)) == 0
    table = capsys.readouterr().out
    assert "[b]" in table and "job-1" in table and "40/100" in table  # cells are text, not rich markup
    assert run(build_parser().parse_args(["job", "job-1", "--json"]), client=client_with(handler)) == 0
    assert json.loads(capsys.readouterr().out) == record()


def test_every_call_carries_the_api_key(tmp_path: Path) -> None:
    """A gateway with API keys (FLEET_API_KEYS) guards jobs: the key goes with every call, the upload and the
    download included (before, the job commands had no --api-key and sent nothing: 401 for each)."""
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((f"{request.method} {request.url.path}", request.headers.get("authorization")))
        if request.url.path.endswith("/uploads"):
            return httpx.Response(200, json={"upload": "t"})
        if request.url.path.endswith("/results"):
            return httpx.Response(200, content=b"out")
        if request.method == "GET" and request.url.path.endswith("/jobs"):
            return httpx.Response(200, json={"jobs": []})
        return httpx.Response(200, json=record())

    data = tmp_path / "in.jsonl"
    data.write_text("{}\n")
    client = client_with(handler, api_key="k1")
    client.upload(data)
    client.list()
    client.get("job-1")
    client.cancel("job-1")
    client.download("job-1", tmp_path / "out.jsonl")
    assert {key for _, key in seen} == {"Bearer k1"} and len(seen) == 5, seen
    args = build_parser().parse_args(["jobs", "--api-key", "k2", "--url", BASE])
    assert args.api_key == "k2"
    for command in (["submit", "x.jsonl", "--model", "m"], ["job", "j"], ["cancel", "j"]):
        assert build_parser().parse_args([*command, "--api-key", "k"]).api_key == "k"
