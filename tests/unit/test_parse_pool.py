"""A JSONL job's lines parsed by forked processes (fleet/jobs/parse_pool.py): the same items, in the same order,
as parsing in process, whatever the chunking, and whatever happens to the helpers."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest

from fleet.jobs import jsonl_input, parse_child, parse_pool
from fleet.jobs.formats import InputItem, open_input
from fleet.jobs.items import RawLine
from fleet.jobs.line_heads import item_parser
from fleet.jobs.parse_child import parse_chunk
from fleet.jobs.parse_pool import ParsePool, auto_processes
from fleet.jobs.parse_wire import decode_item, encode_item
from fleet.model_spec import ModelSpec
from tests.unit.test_job_formats import BATCHED, TEXT, padded, request, spec_of, write_jsonl

LIMIT = 400


def varied_lines(copies: int) -> list[str]:
    """Good and bad lines of every kind the reader meets, `copies` times over."""
    one = [
        json.dumps(request(id="a")),
        "",
        "{not json",
        json.dumps(request(2, 2.0, outputs=[{"name": "OUT"}], parameters={"k": 1, "s": "x", "f": 0.5, "b": True})),
        json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}),
        "   ",
        padded(LIMIT + 1),  # over the limit: an item the reader makes itself, never sent to a helper
        json.dumps(request(3, 1e-7)),
        json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [1, True, 3, 4]}]}),
        json.dumps(request(value=7.0, id="é\u2603")),
    ]
    return one * copies


def in_process(path: Path, spec: ModelSpec = BATCHED, limit: int = LIMIT) -> list[InputItem]:
    return list(open_input(path, spec, max_line_bytes=limit, parse_processes=0).read())


@pytest.fixture
def pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file worth a pool, and small chunks: many chunks through few helpers."""
    monkeypatch.setattr(jsonl_input, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(parse_pool, "CHUNK_LINES", 3)


@pytest.fixture
def parsers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The job's parser, wrapped: each line's parsing process is appended to the returned file, and a line
    holding DIE (HANG) makes a helper exit at once (sleep for ever); in the job worker they parse as usual."""
    log = tmp_path / "parsed-by"
    me = os.getpid()

    real = jsonl_input.item_parser

    def item_parser(spec: ModelSpec, source: str = "") -> Callable[[RawLine], InputItem]:
        items = real(spec, source)

        def parse(raw: RawLine) -> InputItem:
            if os.getpid() != me and b"DIE" in raw.body:
                os._exit(3)
            if os.getpid() != me and b"HANG" in raw.body:
                time.sleep(3600)
            with log.open("a") as f:
                f.write(f"{os.getpid()}\n")
            return items(raw)

        return parse

    monkeypatch.setattr(jsonl_input, "item_parser", item_parser)
    return log


def parsed_by(log: Path) -> list[int]:
    return [int(pid) for pid in log.read_text().split()]


def reaped(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
            return False
        except ChildProcessError:
            pass
    return True


@pytest.mark.usefixtures("pooled")
@pytest.mark.parametrize("processes", [1, 3])
def test_helpers_give_the_items_parsing_in_process_gives(tmp_path: Path, processes: int, parsers: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(7))
    expected = in_process(path)
    assert len(expected) == 7 * 8 and any(i.error for i in expected) and any(i.inputs for i in expected)
    parsers.unlink()
    src = open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=processes)
    assert list(src.read()) == expected
    by = parsed_by(parsers)
    assert len(by) == 7 * 7 and os.getpid() not in by and len(set(by)) == processes  # every line, by the helpers
    # resumed from anywhere, the same rest
    for k in (1, 9, 30, len(expected) - 1):
        assert list(src.read(k, expected[k - 1].end_offset)) == expected[k:]
    src.close()


@pytest.mark.usefixtures("pooled")
def test_bytes_inputs_and_a_chunk_cut_by_its_byte_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse_pool, "CHUNK_BYTES", 100)  # a chunk per line or two
    spec = spec_of(TEXT)
    lines = [json.dumps({"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1, 1], "data": [f"s{i} ü"]}]})
             for i in range(20)] + [json.dumps({"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1, 1],
                                                            "data": [3]}]})]
    path = write_jsonl(tmp_path / "text.jsonl", lines)
    expected = in_process(path, spec)
    assert list(open_input(path, spec, max_line_bytes=LIMIT, parse_processes=2).read()) == expected
    assert expected[-1].error is not None and expected[0].inputs is not None


@pytest.mark.usefixtures("pooled")
def test_lines_bigger_than_a_pipe_with_pipes_at_the_default_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parsers: Path) -> None:
    monkeypatch.setattr(parse_pool, "PIPE_BYTES", 1 << 16)  # Linux's default size: many writes a chunk
    limit = 4 << 20
    lines = [padded(3 << 20), json.dumps(request()), padded(1 << 20), padded(200_000), json.dumps(request(2))] * 2
    path = write_jsonl(tmp_path / "big.jsonl", lines)
    expected = in_process(path, limit=limit)
    parsers.unlink()
    assert list(open_input(path, BATCHED, max_line_bytes=limit, parse_processes=2).read()) == expected
    assert os.getpid() not in parsed_by(parsers)


@pytest.mark.usefixtures("pooled")
def test_a_helper_that_dies_mid_chunk_costs_nothing_but_speed(
        tmp_path: Path, parsers: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = varied_lines(5)
    lines[23] = json.dumps(request(id="DIE"))
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    expected = in_process(path)
    src = open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=2)
    assert isinstance(src, jsonl_input.JsonlInput)
    reader = src.read()
    with caplog.at_level(logging.WARNING, logger="fleet.jobs.parse_pool"):
        got = [next(reader)]
        (pool,) = src._pools
        pids = pool.pids
        got += list(reader)
    assert got == expected
    # (its death is seen reading its result, or writing it its next chunk, whichever comes first)
    assert "dropped: it exited" in caplog.text or "dropped: cannot write to it" in caplog.text
    assert os.getpid() in parsed_by(parsers)  # its chunk, parsed in process
    assert reaped(pids)


@pytest.mark.usefixtures("pooled")
def test_a_helper_that_stops_answering_is_dropped(
        tmp_path: Path, parsers: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(parse_pool, "RESULT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(parse_pool, "_STOP_WAIT_S", 0.2)
    lines = varied_lines(3)
    lines[4] = json.dumps(request(id="HANG"))
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    expected = in_process(path)
    with caplog.at_level(logging.WARNING, logger="fleet.jobs.parse_pool"):
        assert list(open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=1).read()) == expected
    assert "TimeoutError" in caplog.text


@pytest.mark.usefixtures("pooled")
def test_a_stopped_helper_whose_pipe_stays_full_is_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(parse_pool, "RESULT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(parse_pool, "_STOP_WAIT_S", 0.2)
    monkeypatch.setattr(parse_pool, "PIPE_BYTES", 1 << 16)  # 64 KiB pipes: a 200 KB line overfills one
    limit = 1 << 20
    path = write_jsonl(tmp_path / "big.jsonl", [padded(200_000), json.dumps(request())] * 4)
    expected = in_process(path, limit=limit)
    src = open_input(path, BATCHED, max_line_bytes=limit)
    assert isinstance(src, jsonl_input.JsonlInput)
    pool = ParsePool(item_parser(BATCHED), 1)
    (pid,) = pool.pids
    os.kill(pid, signal.SIGSTOP)  # neither reads its pipe nor answers; SIGKILL still ends it
    with caplog.at_level(logging.WARNING, logger="fleet.jobs.parse_pool"):
        assert list(pool.items(src._lines(0, 0))) == expected
    assert "could not write" in caplog.text and reaped([pid])


@pytest.mark.usefixtures("pooled")
def test_a_result_that_cannot_be_read_drops_its_helper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(parse_child, "parse_chunk", lambda lines, parse: b"\xc1 not msgpack")  # in the children
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(3))
    with caplog.at_level(logging.WARNING, logger="fleet.jobs.parse_pool"):
        assert list(open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=2).read()) == in_process(path)
    assert caplog.text.count("does not match the chunk") == 2


@pytest.mark.usefixtures("pooled")
def test_an_error_reading_the_input_is_the_jobs(tmp_path: Path) -> None:
    """Not a helper's failure: the read fails as it would in process (the job fails, nothing is skipped)."""
    body = json.dumps(request()).encode()

    def entries() -> Iterator[RawLine]:
        for i in range(30):  # past what the first round of chunks takes: the failing read is a refill's
            yield RawLine(i, i + 1, (i + 1) * 100, body)
        raise OSError(5, "Input/output error")

    pool = ParsePool(item_parser(BATCHED), 2)
    pids = pool.pids
    items = pool.items(entries())
    got = []
    with pytest.raises(OSError, match="Input/output"):
        for item in items:
            got.append(item)
    assert 3 <= len(got) < 30 and all(i.error is None for i in got)
    assert reaped(pids)


@pytest.mark.usefixtures("pooled")
def test_a_chunk_of_lines_over_the_limit_only_passes_through(tmp_path: Path, parsers: Path) -> None:
    lines = [json.dumps(request(id=str(i))) for i in range(6)] + [padded(LIMIT + 1)] * 7 + [json.dumps(request())]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    expected = in_process(path)
    assert sum(i.error is not None for i in expected) == 7
    parsers.unlink()
    assert list(open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=1).read()) == expected
    assert os.getpid() not in parsed_by(parsers) and len(parsed_by(parsers)) == 7


@pytest.mark.usefixtures("pooled")
def test_a_read_left_early_stops_its_helpers(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(5))
    src = open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=2)
    assert isinstance(src, jsonl_input.JsonlInput)
    reader = src.read()
    next(reader)
    (pool,) = src._pools
    pids = pool.pids
    assert len(pids) == 2
    src.close()  # what the runner does when a job stops (failed, cancelled, interrupted)
    assert reaped(pids)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_small_files_and_zero_processes_parse_in_process(tmp_path: Path, parsers: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(2))
    expected = in_process(path)
    parsers.unlink()
    assert list(open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=4).read()) == expected
    assert set(parsed_by(parsers)) == {os.getpid()}


def test_a_value_msgpack_cannot_carry_fails_its_line_only() -> None:
    good = InputItem(0, 1, 10, None, parameters={"k": 1}, error="bad line")
    odd = InputItem(1, 2, 20, None, parameters={"k": object()}, error="x")
    items = iter([good, odd])
    packed = parse_chunk([[0, 1, 10, b"a"], [1, 2, 20, b"b"]], lambda raw: next(items))
    first, second = (decode_item(f) for f in msgpack.unpackb(packed, raw=False))
    assert first == good
    assert (second.index, second.line, second.end_offset, second.inputs) == (1, 2, 20, None)
    assert second.error == "the request cannot be encoded for the model's queue"


def test_items_cross_the_pipe_unchanged() -> None:
    item = InputItem(3, 4, 99, None, ["OUT"], "id", {"a": 1.5}, None, 2, 1)
    assert decode_item(msgpack.unpackb(msgpack.packb(encode_item(item), use_bin_type=True), raw=False)) == item
    raw = RawLine(0, 1, 5, json.dumps(request(2)).encode())
    parsed = item_parser(BATCHED)(raw)
    wire = decode_item(msgpack.unpackb(msgpack.packb(encode_item(parsed), use_bin_type=True), raw=False))
    assert wire == parsed and wire.inputs is not None and isinstance(wire.inputs[0].shape, tuple)


@pytest.mark.parametrize(("cpus", "helpers"), [(None, 0), (1, 0), (2, 0), (3, 0), (4, 2), (64, 2)])
def test_auto_helpers_by_cores(cpus: int | None, helpers: int) -> None:
    assert auto_processes(cpus) == helpers
