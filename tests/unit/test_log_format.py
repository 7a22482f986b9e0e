"""Log lines (fleet/log_format.py) and what they are about (fleet/log_context.py): one JSON object per
line with the request's model, version and id, text with the same after the message; fleet up's
wrapping of a child's raw output; the format selected by FLEET_LOG_FORMAT or --log-format."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from fleet import log_context
from fleet.cli import build_parser, settings_from_args
from fleet.log_context import BatchLog, IdsOnly, RequestLog
from fleet.log_format import JsonFormatter, TextFormatter, as_json_line
from fleet.settings import Settings

CREATED = 1_767_323_045.678  # 2026-01-02T03:04:05.678Z


def record(msg: str = "hello %s", args: tuple[object, ...] = ("world",), level: int = logging.INFO,
           exc: bool = False, **extra: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("workers.execute", level, __file__, 1, msg, args, exc_info)
    rec.created = CREATED
    rec.process = 4242
    rec.__dict__.update(extra)
    return rec


@pytest.fixture(autouse=True)
def unbound() -> Iterator[None]:
    token = log_context.bind(None)
    yield
    log_context.unbind(token)


def test_a_json_line_has_the_fields_a_collector_needs() -> None:
    line = JsonFormatter("worker").format(record())
    assert json.loads(line) == {"ts": "2026-01-02T03:04:05.678Z", "level": "INFO", "logger": "workers.execute",
                                "role": "worker", "pid": 4242, "msg": "hello world"}


def test_a_bound_request_names_its_model_version_and_id() -> None:
    token = log_context.bind(RequestLog("resnet", "2"))
    try:
        before = json.loads(JsonFormatter("gateway").format(record()))
        log_context.name_request("other_step", 7, "step-id")  # an ensemble's step: not this request
        log_context.name_request("resnet", 2, "req-1")
        log_context.name_request("resnet", 2, "req-2")  # the first id stays
        after = json.loads(JsonFormatter("gateway").format(record()))
    finally:
        log_context.unbind(token)
    assert (before["model"], before["version"], "request_id" in before) == ("resnet", 2, False)
    assert (after["model"], after["version"], after["request_id"]) == ("resnet", 2, "req-1")
    assert "model" not in json.loads(JsonFormatter("gateway").format(record()))


def test_a_batch_names_every_request() -> None:
    token = log_context.bind(BatchLog("doubler", 1, [IdsOnly("a"), IdsOnly("b")]))
    try:
        doc = json.loads(JsonFormatter("stub").format(record()))
        text = TextFormatter().format(record())
    finally:
        log_context.unbind(token)
    assert (doc["model"], doc["version"], doc["request_ids"]) == ("doubler", 1, ["a", "b"])
    assert text.endswith("hello world [model=doubler version=1 request_ids=a,b]")


def test_extra_names_a_request_the_context_does_not() -> None:
    token = log_context.bind(RequestLog("bound", 1, "x"))
    try:
        doc = json.loads(JsonFormatter("gateway").format(record(model="named", version=3, request_id="y")))
    finally:
        log_context.unbind(token)
    assert (doc["model"], doc["version"], doc["request_id"]) == ("named", 3, "y")


def test_an_exception_and_newlines_stay_on_one_line() -> None:
    line = JsonFormatter("worker").format(record("two\nlines", (), logging.ERROR, exc=True))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["msg"] == "two\nlines" and doc["level"] == "ERROR"
    assert doc["exc"].startswith("Traceback") and doc["exc"].endswith("ValueError: boom")


def test_text_lines_put_the_context_after_the_message_and_before_a_traceback() -> None:
    token = log_context.bind(RequestLog("m", None, "r1"))
    try:
        text = TextFormatter(iso8601=True).format(record("failed", (), logging.ERROR, exc=True))
    finally:
        log_context.unbind(token)
    first, *rest = text.splitlines()
    assert first == "2026-01-02T03:04:05.678Z ERROR workers.execute: failed [model=m request_id=r1]"
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: boom"
    assert TextFormatter().format(record()).endswith("INFO workers.execute: hello world")


def test_a_binding_stays_in_its_task() -> None:
    seen: dict[str, dict[str, object]] = {}

    async def handle(model: str) -> None:
        log_context.bind(RequestLog(model))  # as the gRPC service does: not unbound, the task ends
        await asyncio.sleep(0)
        seen[model] = log_context.current_fields()

    async def requests() -> dict[str, object]:
        await asyncio.gather(handle("a"), handle("b"))
        return log_context.current_fields()

    assert asyncio.run(requests()) == {}
    assert seen == {"a": {"model": "a"}, "b": {"model": "b"}}


def test_fleet_up_passes_json_through_and_wraps_anything_else() -> None:
    own = '{"ts": "t", "msg": "from a child"}'
    assert as_json_line(own, "worker-0", 7, CREATED) == own
    for raw in ("Traceback (most recent call last):", "{not json", "[1, 2]", ""):
        doc = json.loads(as_json_line(raw, "worker-0", 7, CREATED))
        assert doc == {"ts": "2026-01-02T03:04:05.678Z", "level": "INFO", "logger": "output", "role": "worker-0",
                       "pid": 7, "msg": raw}


def test_the_format_comes_from_the_environment_or_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().log_format == "text"
    monkeypatch.setenv("FLEET_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    assert settings_from_args(build_parser().parse_args(["worker"])).log_format == "json"
    assert settings_from_args(build_parser().parse_args(["worker", "--log-format", "text"])).log_format == "text"
    monkeypatch.setenv("FLEET_LOG_FORMAT", "yaml")
    with pytest.raises(ValidationError):
        Settings()
