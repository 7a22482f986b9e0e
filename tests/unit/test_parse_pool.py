"""A JSONL job's lines parsed by forked processes (fleet/jobs/parse_pool.py): the same items, in the same order,
as parsing in process, whatever the chunking, and whatever happens to the helpers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import msgpack
import pytest

from fleet.jobs import jsonl_input, parse_pool
from fleet.jobs.formats import InputItem, open_input
from fleet.jobs.items import RawLine
from fleet.jobs.lines import line_parser, parse_item
from fleet.jobs.parse_pool import ParsePool, auto_processes, decode_item, encode_item, parse_chunk
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


def in_process(path: Path, start: int = 0, offset: int = 0, **kw: Any) -> list[InputItem]:
    return list(open_input(path, kw.pop("spec", BATCHED), max_line_bytes=LIMIT, parse_processes=0).read(start, offset))


@pytest.fixture
def pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file worth a pool, and small chunks: many chunks through few helpers."""
    monkeypatch.setattr(jsonl_input, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(parse_pool, "CHUNK_LINES", 3)


@pytest.mark.usefixtures("pooled")
@pytest.mark.parametrize("processes", [1, 3])
def test_helpers_give_the_items_parsing_in_process_gives(tmp_path: Path, processes: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(7))
    expected = in_process(path)
    assert len(expected) == 7 * 8 and any(i.error for i in expected) and any(i.inputs for i in expected)
    forked: list[int] = []
    fork = parse_pool.ParsePool._fork

    def counted(self: ParsePool) -> Any:
        helper = fork(self)
        forked.append(helper.pid if helper else 0)
        return helper

    monkeypatch.setattr(parse_pool.ParsePool, "_fork", counted)
    src = open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=processes)
    assert list(src.read()) == expected
    assert len(forked) == processes and all(forked)
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
    expected = in_process(path, spec=spec)
    assert list(open_input(path, spec, max_line_bytes=LIMIT, parse_processes=2).read()) == expected
    assert expected[-1].error is not None and expected[0].inputs is not None


@pytest.mark.usefixtures("pooled")
def test_a_helper_killed_mid_read_costs_nothing_but_speed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(6))
    expected = in_process(path)
    parse = open_input(path, BATCHED, max_line_bytes=LIMIT)
    assert isinstance(parse, jsonl_input.JsonlInput)
    pool = ParsePool(lambda raw: parse_item(raw, BATCHED, parse._parse, "in.jsonl"), 2)
    first, second = pool.pids
    items = pool.items(parse._lines(0, 0))
    got = [next(items)]
    os.kill(first, signal.SIGKILL)
    got += list(items)
    assert got == expected
    for pid in (first, second):  # both reaped: the killed one and the one stopped at the end
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@pytest.mark.usefixtures("pooled")
def test_every_helper_gone_reads_the_rest_in_process(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(4))
    expected = in_process(path)
    src = open_input(path, BATCHED, max_line_bytes=LIMIT)
    assert isinstance(src, jsonl_input.JsonlInput)
    pool = ParsePool(lambda raw: parse_item(raw, BATCHED, src._parse, "in.jsonl"), 1)
    items = pool.items(src._lines(0, 0))
    got = [next(items)]
    os.kill(pool.pids[0], signal.SIGKILL)
    got += list(items)
    assert got == expected and pool.pids == []


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
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_small_files_and_zero_processes_parse_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", varied_lines(2))
    forks: list[int] = []
    monkeypatch.setattr(parse_pool.ParsePool, "_fork", lambda self: forks.append(1))
    assert list(open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=4).read()) == in_process(path)
    monkeypatch.setattr(jsonl_input, "POOL_MIN_BYTES", 0)
    assert list(open_input(path, BATCHED, max_line_bytes=LIMIT, parse_processes=0).read()) == in_process(path)
    assert forks == []


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
    parsed = parse_item(raw, BATCHED, line_parser(BATCHED))
    wire = msgpack.unpackb(msgpack.packb(encode_item(parsed), use_bin_type=True), raw=False)
    assert decode_item(wire) == parsed and isinstance(decode_item(wire).inputs[0].shape, tuple)  # type: ignore[index]


@pytest.mark.parametrize(("cpus", "helpers"), [(None, 0), (1, 0), (2, 2), (3, 2), (64, 2)])
def test_auto_helpers_by_cores(cpus: int | None, helpers: int) -> None:
    assert auto_processes(cpus) == helpers
