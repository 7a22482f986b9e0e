"""Bulk-job file formats: JSONL/.npy/.npz readers with resume cursors, packing, and the writers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet import tensors
from fleet.datatypes import BY_NAME
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.jobs import jsonl_input as jsonl_module
from fleet.jobs.formats import (
    InputItem,
    check_rows,
    explode,
    group_items,
    open_input,
    open_output,
    pack,
    remove_output,
    unpack,
    write_each,
)
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from tests.support.model_repo import python_config

MULTI = """backend: "python"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_INT64, dims: [ 2 ] },
        { name: "B", data_type: TYPE_FP32, dims: [ -1 ] },
        { name: "C", data_type: TYPE_FP32, dims: [ 1 ], optional: true } ]
output [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] },
         { name: "Y", data_type: TYPE_INT32, dims: [ 3 ] } ]
"""
TEXT = """backend: "python"
max_batch_size: 8
input [ { name: "S", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "T", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""


def spec_of(text: str, name: str = "m") -> ModelSpec:
    return parse_config(text, source="cfg.pbtxt", model_name=name)


BATCHED = spec_of(python_config())  # IN/OUT FP32 [4], max_batch_size 8
FLAT = spec_of(python_config(max_batch_size=0))


def request(rows: int = 1, value: float = 1.0, **extra: Any) -> dict[str, Any]:
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [rows, 4], "data": [value] * (4 * rows)}]}
    return {**body, **extra}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_bytes("".join(line + "\n" for line in lines).encode())
    return path


def fp32(name: str, rows: list[list[float]]) -> WireTensor:
    arr = np.array(rows, dtype="<f4")
    return WireTensor(name, "FP32", arr.shape, arr.tobytes())


def item(index: int, tensors_: list[WireTensor] | None, **kw: Any) -> InputItem:
    rows = tensors_[0].shape[0] if tensors_ else 1
    return InputItem(index, index, index + 1, tensors_, **{"rows": rows, **kw})


# ---------------------------------------------------------------- JSONL input


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "in.jsonl", [
        json.dumps(request(id="a")),
        "",
        "   ",
        "{not json",
        json.dumps(request(2, 2.0, outputs=[{"name": "OUT"}], parameters={"k": 1})),
        json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}),
        json.dumps({"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}),
        json.dumps(request(value=7.0)),
    ])


def test_jsonl_items_errors_and_positions(jsonl: Path) -> None:
    src = open_input(jsonl, BATCHED)
    assert src.kind == "jsonl" and src.count() == 6
    items = list(src.read())
    assert [i.index for i in items] == [0, 1, 2, 3, 4, 5]
    assert [i.line for i in items] == [1, 4, 5, 6, 7, 8]
    raw = jsonl.read_bytes()
    assert [i.end_offset for i in items] == [len(b"".join(raw.splitlines(keepends=True)[: i.line])) for i in items]
    first, bad_json, batch, bad_shape, bad_type, last = items
    assert first.client_id == "a" and first.error is None and first.rows == 1
    assert first.inputs == [WireTensor("IN", "FP32", (1, 4), np.ones(4, "<f4").tobytes())]
    assert bad_json.inputs is None and bad_json.error is not None and "JSON" in bad_json.error
    assert batch.rows == 2 and batch.outputs == ["OUT"] and batch.parameters == {"k": 1}
    assert bad_shape.error is not None and "unexpected shape" in bad_shape.error
    assert bad_type.error is not None and "data-type" in bad_type.error
    assert last.end_offset == len(raw)
    src.close()


def test_an_error_quoting_a_lone_surrogate_is_written_as_its_escape(tmp_path: Path) -> None:
    """JSON can spell a lone surrogate (\\ud800), which no writer takes as text (orjson, msgpack, Redis): a
    line whose error quotes one (an input's name here) fails alone, its error written with the escape."""
    bad = '{"inputs": [{"name": "IN\\ud800", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}'
    src = open_input(write_jsonl(tmp_path / "in.jsonl", [bad, json.dumps(request())]), BATCHED)
    surrogate, plain = list(src.read())
    src.close()
    assert surrogate.error is not None and "'IN\\ud800'" in surrogate.error and plain.error is None
    surrogate.error.encode()  # text any writer takes
    out = open_output(tmp_path / "o.jsonl", "jsonl", BATCHED, 3)
    out.write(surrogate, None, surrogate.error, "m", 1)
    out.write(plain, None, "raw \ud800 text", "m", 1)  # the writer's own guard, for any error's text
    out.close()
    lines = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [d["line"] for d in lines] == [1, 2] and "IN\\ud800" in lines[0]["error"]
    assert lines[1]["error"] == "raw \\ud800 text"


def test_a_generate_line_that_gives_no_input_is_its_own_error(tmp_path: Path) -> None:
    """A generative model whose inputs are all optional takes a /generate body without any: as a job's line
    it fails alone (it has nothing to batch by), not the job."""
    spec = spec_of("""name: "gen"
backend: "llm"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
""", "gen")
    src = open_input(write_jsonl(tmp_path / "in.jsonl", ["{}", '{"temperature": 0.7}', '{"text_input": "hi"}']),
                     spec)
    empty, params_only, prompt = list(src.read())
    src.close()
    assert empty.error == params_only.error == "the line gives none of the model's inputs"
    assert prompt.error is None and prompt.inputs is not None


def test_a_line_asking_for_classes_is_its_own_error(tmp_path: Path) -> None:
    """A job writes each output's tensor: a line asking for classes (classification) is refused, not
    answered with the tensor."""
    path = write_jsonl(tmp_path / "in.jsonl", [
        json.dumps(request(outputs=[{"name": "OUT", "parameters": {"classification": 2}}])), json.dumps(request())])
    src = open_input(path, BATCHED)
    classes, plain = list(src.read())
    assert classes.inputs is None and classes.error == "the classification extension is not supported in bulk jobs"
    assert plain.error is None and plain.inputs is not None
    src.close()


def test_jsonl_resume_matches_full_read(jsonl: Path) -> None:
    src = open_input(jsonl, BATCHED)
    items = list(src.read())
    for k in range(1, len(items) + 1):
        assert list(src.read(k, items[k - 1].end_offset)) == items[k:]
    with pytest.raises(InvalidInput, match="line start"):
        next(src.read(1, items[0].end_offset - 1))


def test_jsonl_invalid_utf8_and_non_batching(tmp_path: Path) -> None:
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]}
    path = tmp_path / "in.ndjson"
    path.write_bytes(b'{"id": "\xff"}\n' + json.dumps(body).encode())
    bad, good = open_input(path, FLAT).read()
    assert bad.error is not None and good.error is None and good.rows == 1 and good.inputs is not None
    assert good.inputs[0].shape == (4,)


def padded(size: int) -> str:
    """A valid request line of exactly `size` bytes (spaces inside the JSON object)."""
    body = json.dumps(request())
    return body[:-1] + " " * (size - len(body)) + "}"


def test_jsonl_lines_over_the_limit_are_their_own_errors(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonl_module, "CHUNK_BYTES", 64)  # skipping reads many chunks, never the whole line
    limit = 300
    lines = [padded(limit), padded(limit + 1), " " * 5000, "x" * 5000, padded(100), "y" * 700]
    path = tmp_path / "long.jsonl"
    path.write_bytes("\n".join(lines).encode())  # the last line ends the file without a newline
    src = open_input(path, BATCHED, max_line_bytes=limit)
    items = list(src.read())
    assert src.count() == len(items) == 5  # a blank line is skipped however long, as count() skips it
    assert [(i.index, i.line) for i in items] == [(0, 1), (1, 2), (2, 4), (3, 5), (4, 6)]
    at_limit, over, garbage, short, last = items
    assert at_limit.error is None and short.error is None
    assert over.error == f"line 2 is {limit + 1} bytes, over the limit of {limit} bytes per line"
    assert garbage.error == f"line 4 is 5000 bytes, over the limit of {limit} bytes per line"
    assert last.error == f"line 6 is 700 bytes, over the limit of {limit} bytes per line"
    raw = path.read_bytes()
    assert [i.end_offset for i in items] == [len(b"".join(raw.splitlines(keepends=True)[: i.line])) for i in items]
    for k in range(1, len(items)):  # a resume cursor just past a skipped line reads on from there
        assert list(src.read(k, items[k - 1].end_offset)) == items[k:]


def test_a_json_array_line_says_what_is_wrong(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "arr.jsonl", [json.dumps([request()]), json.dumps(request(inputs=[[1, 2]])),
                                               json.dumps(request(outputs={"name": "OUT"}))])
    errors = [i.error or "" for i in open_input(path, BATCHED).read()]
    assert all(e for e in errors), errors
    assert not any("object has no attribute" in e or "Error" in e for e in errors), errors
    assert "must be an object" in errors[0]


@pytest.mark.parametrize("text", ["", "\n\n", "a", "a\n", "\na\n\n b \n\n", "x\r\n  \ny", "ab\ncd\n" * 9])
def test_count_lines_across_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(jsonl_module, "CHUNK_BYTES", 3)
    path = tmp_path / "c.jsonl"
    path.write_text(text)
    assert jsonl_module.count_lines(path) == sum(1 for line in text.split("\n") if line.strip())


def test_open_input_rejects_unknown_or_missing(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(InvalidInput, match="unsupported job input"):
        open_input(tmp_path / "x.csv", BATCHED)
    with pytest.raises(InvalidInput, match="does not exist"):
        open_input(tmp_path / "nope.jsonl", BATCHED)


# ---------------------------------------------------------------- arrays


def test_npy_rows_cast_and_resume(tmp_path: Path) -> None:
    data = np.arange(20, dtype=np.float64).reshape(5, 4)  # float64 -> FP32 is a same-kind cast
    np.save(tmp_path / "x.npy", data)
    src = open_input(tmp_path / "x.npy", BATCHED)
    assert src.kind == "array" and src.count() == 5
    items = list(src.read())
    assert [(i.index, i.line, i.end_offset, i.rows) for i in items] == [(r, r, r + 1, 1) for r in range(5)]
    assert items[2].inputs == [WireTensor("IN", "FP32", (1, 4), data[2].astype("<f4").tobytes())]
    assert list(src.read(3, 3)) == items[3:] == list(src.read(3))
    src.close()
    np.save(tmp_path / "flat.npy", data.astype(np.float32))
    (row,) = open_input(tmp_path / "flat.npy", FLAT).read(4)
    assert row.inputs is not None and row.inputs[0].shape == (4,)


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.zeros((3, 4), np.complex64), "cannot be cast"),
        (np.zeros((3, 5), np.float32), "does not match"),
        (np.zeros(4, np.float32), "does not match"),
        (np.array(["a", "b"]), "not a numeric"),
    ],
)
def test_npy_rejections(tmp_path: Path, array: np.ndarray, match: str) -> None:
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(InvalidInput, match=match):
        open_input(tmp_path / "x.npy", BATCHED)


def test_npy_float_to_int_rejected(tmp_path: Path) -> None:
    ints = spec_of(python_config().replace('name: "IN", data_type: TYPE_FP32', 'name: "IN", data_type: TYPE_INT32'))
    np.save(tmp_path / "x.npy", np.zeros((3, 4), np.float32))
    with pytest.raises(InvalidInput, match="cannot be cast to INT32"):
        open_input(tmp_path / "x.npy", ints)
    np.save(tmp_path / "x.npy", np.full((3, 4), 7, ">i8"))  # big-endian int64 -> INT32: same kind
    (row,) = open_input(tmp_path / "x.npy", ints).read(2)
    assert row.inputs == [WireTensor("IN", "INT32", (1, 4), np.full(4, 7, "<i4").tobytes())]


def test_npy_needs_single_input_and_no_strings(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidInput, match="use .npz"):
        open_input(tmp_path / "x.npy", spec_of(MULTI.replace(", optional: true", "")))
    with pytest.raises(InvalidInput, match="BYTES"):
        open_input(tmp_path / "x.npy", spec_of(TEXT))


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_streams_rows_and_resumes(tmp_path: Path, save: Any) -> None:
    a = np.arange(12, dtype=np.int32).reshape(6, 2)  # INT32 -> INT64 cast
    b = np.linspace(0, 1, 18, dtype=np.float32).reshape(6, 3)
    save(tmp_path / "x.npz", B=b, A=a)
    src = open_input(tmp_path / "x.npz", spec_of(MULTI))
    assert src.count() == 6
    items = list(src.read())
    assert items[4].inputs == [
        WireTensor("A", "INT64", (1, 2), a[4].astype("<i8").tobytes()),
        WireTensor("B", "FP32", (1, 3), b[4].tobytes()),
    ]
    for k in range(6):
        assert list(src.read(k, k)) == items[k:]
    src.close()


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"A": np.zeros((2, 2), np.int64)}, "missing arrays"),
        ({"A": np.zeros((2, 2), np.int64), "B": np.zeros((3, 1), np.float32)}, "same first dimension"),
        ({"A": np.zeros((2, 2), np.int64), "B": np.zeros((2, 1), np.float32), "Z": np.zeros(2)}, "not an input"),
        ({"A": np.asfortranarray(np.zeros((2, 2), np.int64)), "B": np.zeros((2, 1), np.float32)}, "Fortran"),
        ({"A": np.zeros((2, 2), np.float32), "B": np.zeros((2, 1), np.float32)}, "cannot be cast"),
    ],
)
def test_npz_rejections(tmp_path: Path, arrays: dict[str, np.ndarray], match: str) -> None:
    np.savez(tmp_path / "x.npz", **arrays)
    with pytest.raises(InvalidInput, match=match):
        open_input(tmp_path / "x.npz", spec_of(MULTI))


def test_npz_optional_input_and_bad_archive(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", A=np.ones((2, 2), np.int64), B=np.ones((2, 1), np.float32),
             C=np.ones((2, 1), np.float32))
    first = next(open_input(tmp_path / "x.npz", spec_of(MULTI)).read())
    assert first.inputs is not None and [t.name for t in first.inputs] == ["A", "B", "C"]
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InvalidInput, match="npz"):
        open_input(tmp_path / "bad.npz", spec_of(MULTI))


# ---------------------------------------------------------------- packing


def test_group_items_compatibility_rows_and_errors() -> None:
    one = [fp32("IN", [[1, 2, 3, 4]])]
    two = [fp32("IN", [[1, 2, 3, 4], [5, 6, 7, 8]])]
    other = [fp32("IN", [[1, 2, 3]])]
    items = [
        item(0, one), item(1, two), item(2, one),  # 4 rows: full at max_rows 4
        item(3, one), item(4, None, error="bad"), item(5, one),
        item(6, one, outputs=["OUT"]), item(7, one, outputs=["OUT"]),
        item(8, one, parameters={"p": 1}), item(9, one, parameters={"p": True}),
        item(10, other), item(11, [fp32("IN", [[0, 0, 0, 0]] * 5)]), item(12, one),
    ]
    groups = [[i.index for i in g] for g in group_items(items, 4)]
    assert groups == [[0, 1, 2], [3], [4], [5], [6, 7], [8], [9], [10], [11], [12]]
    assert [[i.index for i in g] for g in group_items(items[:3], 1)] == [[0], [1], [2]]


def test_group_items_is_lazy() -> None:
    pulled: list[int] = []

    def source() -> Iterator[InputItem]:
        for k in range(100):
            pulled.append(k)
            yield item(k, [fp32("IN", [[k, k, k, k]])])

    groups = group_items(source(), 2)
    assert [i.index for i in next(groups)] == [0, 1]
    assert pulled == [0, 1]


def test_pack_unpack_fixed_and_bytes() -> None:
    a, b = item(0, [fp32("IN", [[1, 2, 3, 4]])]), item(1, [fp32("IN", [[5, 6, 7, 8], [9, 10, 11, 12]])])
    (packed,) = pack([a, b])
    assert packed.shape == (3, 4)
    assert tensors.from_bytes(packed.data, BY_NAME["FP32"], packed.shape)[2, 3] == 12
    assert pack([a]) is a.inputs
    strings = np.array([[b"x"], [b""], [b"long string"]], dtype=object)
    reply = [packed, WireTensor("S", "BYTES", (3, 1), tensors.serialize_bytes(strings))]
    first, second = unpack(reply, [1, 2])
    assert a.inputs is not None and first[0] == a.inputs[0]
    assert second[1] == WireTensor("S", "BYTES", (2, 1), tensors.serialize_bytes(strings[1:]))
    assert unpack(reply, [3]) == [reply]
    flat = [WireTensor("OUT", "FP32", (4,), b"\0" * 16)]
    assert unpack(flat, [1]) == [flat]
    with pytest.raises(InvalidInput, match="expected 4 rows"):
        unpack(reply, [2, 2])
    with pytest.raises(InvalidInput, match="BYTES"):
        unpack([WireTensor("S", "BYTES", (2, 1), b"\1\0\0\0x")], [1, 1])


@settings(max_examples=40, deadline=None)
@given(
    datatype=st.sampled_from(["FP32", "INT64", "BYTES"]),
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    width=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip(datatype: str, rows: list[int], width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dt = BY_NAME[datatype]
    group = []
    for k, r in enumerate(rows):
        if datatype == "BYTES":
            arr = np.array([bytes(rng.integers(0, 256, rng.integers(0, 6))) for _ in range(r * width)],
                           dtype=object).reshape(r, width)
        else:
            arr = rng.integers(-1000, 1000, (r, width)).astype(dt.numpy)
        group.append(item(k, [WireTensor("T", datatype, (r, width), tensors.to_bytes(arr, dt))]))
    packed = pack(group)
    back = unpack(packed, rows)
    assert back == [[WireTensor(t.name, t.datatype, t.shape, bytes(t.data)) for t in g.inputs or []] for g in group]


# ---------------------------------------------------------------- writers


def results(k: int) -> list[WireTensor]:
    return [fp32("OUT", [[k, k + 0.5, 0, -1]])]


def write_jsonl_items(out: Any, ks: range) -> None:
    for k in ks:
        it = InputItem(k, k + 1, 0, [], client_id="c" if k % 2 else "")
        out.write(it, None if k == 3 else results(k), "boom" if k == 3 else None, "m", 2)


def test_jsonl_output_lines(tmp_path: Path) -> None:
    out = open_output(tmp_path / "o.jsonl", "jsonl", BATCHED, 5)
    write_jsonl_items(out, range(5))
    assert out.flush() == (tmp_path / "o.jsonl").stat().st_size
    out.finish()
    lines = (tmp_path / "o.jsonl").read_text().splitlines()
    assert lines[0] == ('{"line":1,"model_name":"m","model_version":"2","outputs":[{"name":"OUT",'
                        '"datatype":"FP32","shape":[1,4],"data":[0.0,0.5,0.0,-1.0]}]}')
    assert json.loads(lines[1])["id"] == "c"
    assert json.loads(lines[3]) == {"line": 4, "error": "boom"}


def test_jsonl_output_floats_are_the_shortest_that_read_back_exactly(tmp_path: Path) -> None:
    out = open_output(tmp_path / "o.jsonl", "jsonl", BATCHED, 1)
    values = np.array([[0.1, 1 / 3, 1e-8, 16777217.0]], dtype=np.float32)
    out.write(InputItem(0, 1, 0, []), [fp32("OUT", values.tolist())], None, "m", 1)
    out.finish()
    line = (tmp_path / "o.jsonl").read_text()
    assert '"data":[0.1,0.33333334,1e-8,16777216.0]' in line  # json would write 0.10000000149011612
    data = json.loads(line)["outputs"][0]["data"]
    assert np.array_equal(np.array(data, dtype=np.float32), values.reshape(-1))


def test_jsonl_lines_parse_as_infer_bodies_do(tmp_path: Path) -> None:
    from fleet.jobs.lines import parse_infer_line
    from fleet.kserve import parse_infer

    spec = BATCHED
    good = b'{"id":"a","inputs":[{"name":"IN","datatype":"FP32","shape":[1,4],"data":[1,2.5,3,4]}]}'
    fast, exact = parse_infer_line(good, spec), parse_infer(good, None, spec)
    assert (fast.client_id, fast.inputs) == (exact.client_id, exact.inputs)
    nan = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1,4],"data":[1,NaN,3,4]}]}'
    for bad, words in ((b'[1]', "must be an object"), (b'{"inputs": [', "failed to parse"),
                       (b'\xef\xbb\xbf{}', "byte order mark"), (nan, "failed to parse"),
                       (b'{"parameters":{"big":18446744073709551616},"inputs":[]}', "64-bit")):
        with pytest.raises(InvalidInput, match=words):
            parse_infer_line(bad, spec)


def test_jsonl_output_refuses_what_json_cannot_carry_and_writes_nothing(tmp_path: Path) -> None:
    out = open_output(tmp_path / "o.jsonl", "jsonl", BATCHED, 1)
    with pytest.raises(InvalidInput, match="NaN or infinity") as exc:
        out.write(InputItem(0, 1, 0, []), [fp32("OUT", [[np.inf, 0, 0, 0]])], None, "m", 1)
    assert "binary" not in exc.value.message  # /infer's advice; a JSONL job has no binary output
    out.write(InputItem(0, 1, 0, []), None, exc.value.message, "m", 1)  # what the runner writes instead
    out.finish()
    assert [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()] == [
        {"line": 1, "error": exc.value.message}]


def reply_column(rng: np.random.Generator, name: str, datatype: str, rows: int, width: int,
                 bad_rows: list[int]) -> WireTensor:
    """An output of `rows` rows: random values of `datatype`, NaN (or, for BYTES, bytes that are not UTF-8)
    in each of `bad_rows`."""
    dt = BY_NAME[datatype]
    if datatype == "BYTES":
        arr = np.array([bytes(rng.integers(97, 123, rng.integers(0, 5))) for _ in range(rows * width)],
                       dtype=object).reshape(rows, width)
        for r in bad_rows:
            if width:
                arr[r, 0] = b"\xff"
    elif datatype == "BOOL":
        arr = rng.integers(0, 2, (rows, width)).astype(bool)
    elif dt.numpy.kind == "f":
        scale = 10.0 ** rng.integers(-4, 5) if datatype == "FP16" else 10.0 ** rng.integers(-30, 31)
        arr = (rng.standard_normal((rows, width)) * scale).astype(dt.numpy)
        for r in bad_rows:
            if width:
                arr[r, rng.integers(0, width)] = [np.nan, np.inf, -np.inf][r % 3]
    else:
        info = np.iinfo(dt.numpy)
        arr = rng.integers(info.min, info.max, (rows, width), dtype=dt.numpy, endpoint=True)
    return WireTensor(name, datatype, (rows, width), tensors.to_bytes(arr, dt))


@settings(max_examples=60, deadline=None)
@given(
    datatypes=st.lists(st.sampled_from(["FP32", "FP16", "BF16", "FP64", "INT8", "INT64", "UINT64", "BOOL",
                                         "BYTES"]), min_size=0, max_size=3),
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=6),
    width=st.integers(0, 4),
    bad=st.sets(st.integers(0, 17), max_size=3),
    ids=st.lists(st.sampled_from(["", "a", "\ud800"]), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_a_replys_items_are_written_as_one_by_one(tmp_path_factory: pytest.TempPathFactory, datatypes: list[str],
                                                    rows: list[int], width: int, bad: set[int], ids: list[str],
                                                    seed: int) -> None:
    """JsonlOutput.write_reply (each output read and checked once for the reply, each item's data a slice of
    it) writes the same bytes, and says the same errors, as unpacking the reply and writing item by item;
    only an item whose own rows hold NaN, infinity or bytes that are not UTF-8 fails, and an id JSON
    cannot carry (a lone surrogate) fails its item alone."""
    rng = np.random.default_rng(seed)
    total = sum(rows)
    outputs = [reply_column(rng, f"O{k}", d, total, width, sorted(r for r in bad if r < total))
               for k, d in enumerate(datatypes)]
    items = [InputItem(k, k + 1, 0, [], client_id=ids[k], rows=r) for k, r in enumerate(rows)]
    check_rows(outputs, rows)
    folder = tmp_path_factory.mktemp("reply")
    fast = open_output(folder / "fast.jsonl", "jsonl", BATCHED, len(items))
    slow = open_output(folder / "slow.jsonl", "jsonl", BATCHED, len(items))
    got = fast.write_reply(items, outputs, "m", 3)
    want = write_each(slow, items, unpack(outputs, rows), [None] * len(items), "m", 3)
    assert got == want
    assert fast.flush() == slow.flush()
    fast.finish()
    slow.finish()
    assert (folder / "fast.jsonl").read_bytes() == (folder / "slow.jsonl").read_bytes()
    lines = [json.loads(line) for line in (folder / "fast.jsonl").read_text().splitlines()]
    assert [line["line"] for line in lines] == [k + 1 for k in range(len(items))]
    assert [line.get("error") for line in lines] == got


def test_a_reply_with_nan_fails_only_the_items_whose_rows_hold_it(tmp_path: Path) -> None:
    values = np.arange(24, dtype=np.float32).reshape(6, 4)
    values[3, 1] = np.nan  # the second item's (rows 2-3)
    items = [InputItem(k, k + 1, 0, [], rows=r) for k, r in enumerate([2, 2, 1, 1])]
    out = open_output(tmp_path / "o.jsonl", "jsonl", BATCHED, 4)
    errors = out.write_reply(items, [fp32("OUT", values.tolist())], "m", 1)
    out.finish()
    assert errors[0] is None and errors[2:] == [None, None]
    assert errors[1] == ("output 'OUT' holds NaN or infinity, which JSON cannot represent (a JSONL job's output is "
                         "JSON only)")
    lines = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert lines[1] == {"line": 2, "error": errors[1]}
    assert lines[0]["outputs"][0] == {"name": "OUT", "datatype": "FP32", "shape": [2, 4], "data": list(range(8))}
    assert lines[3]["outputs"][0]["data"] == [20.0, 21.0, 22.0, 23.0]


def test_a_reply_of_one_item_passes_through_without_a_batch_axis(tmp_path: Path) -> None:
    out = open_output(tmp_path / "o.jsonl", "jsonl", FLAT, 1)
    flat = WireTensor("OUT", "FP32", (4,), np.arange(4, dtype="<f4").tobytes())
    assert out.write_reply([InputItem(0, 1, 0, [])], [flat], "m", 1) == [None]
    out.finish()
    assert json.loads((tmp_path / "o.jsonl").read_text())["outputs"][0]["shape"] == [4]


def test_check_rows_refuses_what_unpack_refuses() -> None:
    good = fp32("OUT", [[1, 2, 3, 4]] * 3)
    check_rows([good], [1, 2])
    check_rows([WireTensor("OUT", "FP32", (4,), b"\0" * 16)], [1])  # one item: its outputs as they are
    for outputs, rows, words in (([good], [2, 2], "expected 4 rows"),
                                 ([WireTensor("OUT", "FP32", (3, 4), b"\0" * 40)], [1, 2], "holds 40 bytes"),
                                 ([WireTensor("S", "BYTES", (2, 1), b"\1\0\0\0x")], [1, 1], "BYTES")):
        for check in (check_rows, unpack):
            with pytest.raises(InvalidInput, match=words):
                check(outputs, rows)


def test_jsonl_output_resume_truncates(tmp_path: Path) -> None:
    straight = open_output(tmp_path / "a.jsonl", "jsonl", BATCHED, 9)
    write_jsonl_items(straight, range(9))
    straight.finish()
    out = open_output(tmp_path / "b.jsonl", "jsonl", BATCHED, 9)
    write_jsonl_items(out, range(5))
    offset = out.flush()
    write_jsonl_items(out, range(40, 42))  # written after the last flush: must vanish
    out.close()
    resumed = open_output(tmp_path / "b.jsonl", "jsonl", BATCHED, 9, resume_offset=offset)
    write_jsonl_items(resumed, range(5, 9))
    resumed.finish()
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    with pytest.raises(InvalidInput, match="cannot resume"):
        open_output(tmp_path / "c.jsonl", "jsonl", BATCHED, 9, resume_offset=10)


def array_item(k: int) -> InputItem:
    return InputItem(k, k, k + 1, [])


def test_npy_output_with_failed_mask_and_resume(tmp_path: Path) -> None:
    path = tmp_path / "o.npy"
    out = open_output(path, "npy", BATCHED, 4)
    out.write(array_item(0), results(0), None, "m", 1)
    out.write(array_item(1), None, "failed", "m", 1)
    assert out.flush() == 2
    out.write(array_item(2), results(99), None, "m", 1)  # lost: resumed from row 2
    out.close()
    out = open_output(path, "npy", BATCHED, 4, resume_offset=2)
    out.write(array_item(2), None, "failed", "m", 1)
    with pytest.raises(InvalidInput, match=r"1 row\(s\) need"):
        out.write(array_item(3), [fp32("OUT", [[1, 2, 3, 4]] * 2)], None, "m", 1)
    assert out.flush() == 4
    out.finish()
    np.testing.assert_array_equal(np.load(path), [[0, 0.5, 0, -1], [0] * 4, [0] * 4, [0] * 4])
    np.testing.assert_array_equal(np.load(f"{path}.failed.npy"), [False, True, True, True])
    flat = open_output(tmp_path / "f.npy", "npy", FLAT, 1)
    flat.write(array_item(0), [WireTensor("OUT", "FP32", (4,), np.arange(4, dtype="<f4").tobytes())], None, "m", 1)
    flat.finish()
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), [[0, 1, 2, 3]])


def test_a_refused_replys_rows_are_counted_once(tmp_path: Path) -> None:
    """A reply the array writer refuses (its shape) is written again as its item's failure (write_each):
    its rows count once, so the progress saved (flush) is rows written and a failed job flags the rest."""
    path = tmp_path / "o.npy"
    out = open_output(path, "npy", BATCHED, 4)
    errors = write_each(out, [array_item(0), array_item(1)], [results(0), [fp32("OUT", [[1, 2, 3, 4]] * 2)]],
                        [None, None], "m", 1)
    assert errors[0] is None and errors[1] is not None and "1 row(s) need" in errors[1]
    assert out.flush() == 2
    out.finish(partial=True)
    np.testing.assert_array_equal(np.load(f"{path}.failed.npy"), [False, True, True, True])


def test_an_npy_output_in_fortran_order_is_not_resumed(tmp_path: Path) -> None:
    path = tmp_path / "o.npy"
    np.save(path, np.asfortranarray(np.zeros((4, 4), np.float32)))  # its rows are not where a C write goes
    with pytest.raises(InvalidInput, match="Fortran order"):
        open_output(path, "npy", BATCHED, 4, resume_offset=2)


def test_npz_output_assembles_and_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "o.npz"
    out = open_output(path, "npz", spec_of(MULTI), 3)
    for k in range(3):
        x = fp32("X", [[k, k]])
        y = WireTensor("Y", "INT32", (1, 3), np.array([[k, k, k]], "<i4").tobytes())
        out.write(array_item(k), [y, x], "no" if k == 1 else None, "m", 1)
    out.finish()
    assert not (tmp_path / "o.npz.parts").exists()
    with np.load(path) as z:
        assert sorted(z.files) == ["X", "Y", "failed"]
        np.testing.assert_array_equal(z["X"], [[0, 0], [0, 0], [2, 2]])
        np.testing.assert_array_equal(z["Y"], [[0, 0, 0], [0, 0, 0], [2, 2, 2]])
        np.testing.assert_array_equal(z["failed"], [False, True, False])


@pytest.mark.parametrize("kind", ["npy", "npz"])
def test_a_failed_jobs_array_output_flags_the_rows_never_written(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"o.{kind}"
    out = open_output(path, kind, BATCHED, 4)
    out.write(array_item(0), results(0), None, "m", 1)
    out.write(array_item(1), None, "failed", "m", 1)
    out.finish(partial=True)
    mask = np.load(f"{path}.failed.npy") if kind == "npy" else np.load(path)["failed"]
    np.testing.assert_array_equal(mask, [False, True, True, True])


@pytest.mark.parametrize("kind", ["jsonl", "npy", "npz"])
def test_remove_output_leaves_nothing_of_a_cancelled_job(tmp_path: Path, kind: str) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    path = job_dir / f"output.{kind}"
    out = open_output(path, kind, BATCHED, 4)
    if kind == "jsonl":
        write_jsonl_items(out, range(2))
    else:
        out.write(array_item(0), results(0), None, "m", 1)
    out.flush()
    out.close()  # as a cancelled runner leaves it: parts and masks on disk, no final file yet
    assert any(job_dir.iterdir())
    remove_output(path)
    assert not job_dir.exists() and tmp_path.exists()


def test_array_outputs_reject_unfit_models(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="BYTES"):
        open_output(tmp_path / "o.npy", "npy", spec_of(TEXT), 2)
    with pytest.raises(InvalidInput, match="use .npz"):
        open_output(tmp_path / "o.npy", "npy", spec_of(MULTI), 2)
    variable = spec_of(python_config().replace('name: "OUT", data_type: TYPE_FP32, dims: [ 4 ]',
                                               'name: "OUT", data_type: TYPE_FP32, dims: [ -1 ]'))
    with pytest.raises(InvalidInput, match="variable dims"):
        open_output(tmp_path / "o.npz", "npz", variable, 2)
    with pytest.raises(InvalidInput, match="unknown job output kind"):
        open_output(tmp_path / "o.csv", "csv", BATCHED, 2)


# ---------------------------------------------------------------- blocks of array rows (bulk fast path)


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_blocks_carry_the_same_rows_as_single_reads(tmp_path: Path, suffix: str) -> None:
    x = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    path = tmp_path / f"x{suffix}"
    np.save(path, x) if suffix == ".npy" else np.savez_compressed(path, IN=x)
    src = open_input(path, BATCHED)
    blocks = list(src.read(block_rows=4))
    assert [(b.index, b.rows, b.count, b.end_offset) for b in blocks] == [(0, 4, 4, 4), (4, 4, 4, 8), (8, 2, 2, 10)]
    assert b"".join(bytes(b.inputs[0].data) for b in blocks if b.inputs) == x.tobytes()
    assert blocks[2].inputs == [WireTensor("IN", "FP32", (2, 4), x[8:].tobytes())]
    # Resuming at a block boundary gives the same blocks; exploding a block gives the single rows.
    assert list(src.read(4, 4, block_rows=4)) == blocks[1:]
    singles = list(src.read())
    assert explode(blocks[1]) == singles[4:8]
    src.close()


def test_a_block_is_written_as_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "o.npy"
    out = open_output(path, "npy", BATCHED, 6)
    block = InputItem(0, 0, 4, None, rows=4, count=4)
    out.write(block, [fp32("OUT", [[r] * 4 for r in range(4)])], None, "m", 1)
    out.write(InputItem(4, 4, 6, None, rows=2, count=2), None, "bad block", "m", 1)
    assert out.flush() == 6
    out.finish()
    np.testing.assert_array_equal(np.load(path), [[r] * 4 for r in range(4)] + [[0] * 4] * 2)
    np.testing.assert_array_equal(np.load(f"{path}.failed.npy"), [False] * 4 + [True] * 2)


def test_lines_that_fail_alike_share_one_message_whatever_their_ids(tmp_path: Path) -> None:
    """A job counts its failed lines by message: the online route's "[request id: ...]" prefix is left out."""
    bad = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    src = open_input(write_jsonl(tmp_path / "in.jsonl", [json.dumps({**bad, "id": f"r{i}"}) for i in range(3)]),
                     BATCHED)
    errors = {item.error for item in src.read()}
    src.close()
    assert len(errors) == 1 and next(iter(errors)).startswith("unexpected shape for input 'IN'")
