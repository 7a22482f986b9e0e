"""The status page's HTML (gateway/status_page.py), the terminal frame and `fleet status` (fleet/status_cli.py),
both from fleet/status_format.py's tables. The CLI's gateway is an httpx.MockTransport: what it sends and
how it maps errors; nothing sleeps, nothing opens a socket."""

from __future__ import annotations

import io
import json
import re
from html.parser import HTMLParser

import httpx
import pytest
from rich.console import Console
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from fleet.cli import build_parser
from fleet.settings import Settings
from fleet.status_cli import STATUS_PATH, StatusFetchError, fetch, render, run
from fleet.status_format import Tone, tables
from fleet.status_snapshot import (
    Counters,
    JobStatus,
    LaneDepth,
    ModelStatus,
    Rate,
    Snapshot,
    WorkerStatus,
    WorkerUnit,
    to_json,
)
from gateway.auth import AuthGate
from gateway.status_page import render_page

NASTY = "<script>alert('x')</script>&"
SNAPSHOT = Snapshot(
    at_ms=1_800_000_000_000,
    workers=(WorkerStatus("host-1-abc", "host", 77, "cpu", "ready", 0.4,
                          (WorkerUnit("add_sub", 1, "READY"), WorkerUnit("mlp", 1, "LOADING")), queued=2),
             WorkerStatus("old-worker", "", None, "", "gone", 12.0)),
    models=(ModelStatus("add_sub", (1,), (1,), lanes=(LaneDepth("online", 3), LaneDepth("bulk", 0)), held=1,
                        in_flight=2, counters=Counters(success=1234, failed=5, inferences=40, executions=10,
                                                       success_ns=2_500_000 * 1234), rate=Rate(12.5, 25.0, 2.0)),
            ModelStatus(NASTY, (1,), (), reason="unloaded"),
            ModelStatus("broken", (1,), (), reason="no GPU here", dead_letters=3)),
    jobs=(JobStatus(f"job-{NASTY}", "add_sub", "running", 50, 200, 1, 9.5),),
    window_s=2.0)


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parsed(page: str) -> _Text:
    parser = _Text()
    parser.feed(page)
    return parser


def test_tables_hold_the_figures_with_tones() -> None:
    workers, models, jobs = tables(SNAPSHOT)
    assert [c.text for c in workers.rows[0]] == ["host-1-abc", "host", "77", "cpu", "ready", "0.4 s ago",
                                                 "add_sub v1, mlp v1 (loading)", "2"]
    assert workers.rows[1][4].tone is Tone.BAD
    row = [c.text for c in models.rows[0]]
    assert row == ["add_sub", "v1", "online 3 · bulk 0", "1", "2", "12.5", "25.0", "2.00", "4.00", "2.50", "1,234", "5",
                   "0"]
    assert models.rows[1][1].tone is Tone.MUTED and models.rows[2][1].text == "no GPU here"
    assert [c.text for c in jobs.rows[0]][2:] == ["running", "50/200 (25%)", "1", "9.5"]
    assert models.title == "Models (rates over the last 2.0 s)"


def test_the_page_escapes_what_comes_from_the_fleet_and_refreshes_itself() -> None:
    page = render_page(SNAPSHOT, "gw-<1>")
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;" in page
    doc = parsed(page)
    assert "script" not in doc.tags
    text = "".join(doc.text)
    assert NASTY in text and f"job-{NASTY}" in text and "gw-<1>" in text  # shown as text, never as markup
    assert '<meta http-equiv="refresh" content="2">' in page
    for figure in ("host-1-abc", "add_sub", "1,234", "online 3 · bulk 0", "12.5", "no GPU here", "50/200 (25%)"):
        assert figure in text


def test_the_page_says_what_is_empty_and_what_failed() -> None:
    text = "".join(parsed(render_page(Snapshot(at_ms=0), "gw")).text)
    assert "no worker has sent a heartbeat" in text and "no bulk job" in text and "no model" in text
    error = render_page(None, "gw", error="Redis is not reachable <x>")
    assert "Redis is not reachable &lt;x&gt;" in error and "<table" not in error


def frame_text(snapshot: Snapshot) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render(snapshot, "http://gw:8000"))
    return console.export_text()


def test_the_terminal_frame_shows_every_table() -> None:
    text = frame_text(SNAPSHOT)
    for figure in ("fleet status", "http://gw:8000", "workers 1", "models ready 1/3", "req/s 12.5", "host-1-abc",
                   "add_sub v1, mlp v1 (loading)", "online 3 · bulk 0", "1,234", NASTY, "50/200 (25%)",
                   "2027-01-15 08:00:00 UTC"):
        assert figure in text, figure
    assert "no bulk job" in frame_text(Snapshot(at_ms=0))


def gateway(handler: httpx.MockTransport) -> httpx.Client:
    return httpx.Client(transport=handler)


def serve(doc: object, status: int = 200, seen: list[httpx.Request] | None = None) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status, content=json.dumps(doc).encode())
    return gateway(httpx.MockTransport(handle))


def test_once_prints_one_frame_from_the_gateway_with_the_key() -> None:
    seen: list[httpx.Request] = []
    console = Console(record=True, width=200, file=io.StringIO())
    args = build_parser().parse_args(["status", "--once", "--url", "http://gw:9000/", "--api-key", "k1"])
    assert run(args, environ={}, client=serve(to_json(SNAPSHOT), seen=seen), console=console) == 0
    assert [str(r.url) for r in seen] == [f"http://gw:9000{STATUS_PATH}"]
    assert seen[0].headers["authorization"] == "Bearer k1"
    assert "host-1-abc" in console.export_text()


def test_the_url_and_key_default_from_the_environment() -> None:
    seen: list[httpx.Request] = []
    args = build_parser().parse_args(["status", "--once"])
    run(args, environ={"FLEET_URL": "http://env:1", "FLEET_API_KEY": "k2"}, client=serve(to_json(SNAPSHOT), seen=seen),
        console=Console(file=io.StringIO()))
    assert str(seen[0].url) == f"http://env:1{STATUS_PATH}" and seen[0].headers["authorization"] == "Bearer k2"


@pytest.mark.parametrize(("doc", "status", "message"), [
    ({"error": "missing or invalid API key"}, 401, "HTTP 401"),
    ({"not": "a status"}, 200, "no status document"),
])
def test_fetch_errors_say_what_went_wrong(doc: object, status: int, message: str) -> None:
    with pytest.raises(StatusFetchError, match=message):
        fetch(serve(doc, status), "http://gw", {})


def test_an_unreachable_gateway_is_exit_2_with_once(capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)
    args = build_parser().parse_args(["status", "--once", "--url", "http://gw:1"])
    assert run(args, environ={}, client=gateway(httpx.MockTransport(refuse))) == 2
    assert re.search(r"error: cannot reach the gateway at http://gw:1", capsys.readouterr().err)


def test_the_live_view_polls_until_interrupted_and_rides_out_errors() -> None:
    answers = [httpx.Response(503, content=b'{"error": "Redis down"}'),
               httpx.Response(200, content=json.dumps(to_json(SNAPSHOT)).encode())]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    console = Console(record=True, width=200, file=io.StringIO(), force_terminal=True)
    args = build_parser().parse_args(["status", "--interval", "0.5", "--url", "http://gw"])
    client = gateway(httpx.MockTransport(lambda request: answers.pop(0)))
    assert run(args, environ={}, client=client, sleep=sleep, console=console) == 0
    text = console.export_text()
    assert sleeps == [0.5, 0.5] and "HTTP 503" in text and "host-1-abc" in text


@pytest.mark.parametrize("path", ["/", STATUS_PATH, "/metrics"])
def test_with_api_keys_the_page_and_its_json_need_the_key_as_the_metrics_do(path: str) -> None:
    async def ok(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = AuthGate(Starlette(routes=[Route(path, ok)]), settings=Settings(api_keys="k1"))
    with TestClient(app) as client:
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer k1"}).text == "ok"
