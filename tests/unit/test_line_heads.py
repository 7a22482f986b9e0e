"""fleet/jobs/line_heads.py: a JSONL line parsed from a known head is what parse_infer makes of it, error or
result, whatever its data and id; only heads whose result depends on them alone are kept."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.errors import ServingError
from fleet.jobs.items import RawLine
from fleet.jobs.line_heads import LineHeads, item_parser
from fleet.jobs.lines import parse_infer_line, parse_item
from fleet.jobs.packing import signature
from fleet.kserve import MAX_ID_CHARS, parse_infer
from fleet.model_config import parse_config
from tests.support.parsed_infer import CONFIG, SPEC, outcome, same, with_outputs_and_parameters


def _line(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def _doc(a: Any, b: Any, **extra: Any) -> dict[str, Any]:
    return {**extra, "inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "data": a},
                                {"name": "B", "datatype": "INT32", "shape": [1, 2], "data": b}]}


def _check(heads: LineHeads, line: bytes) -> None:
    same(outcome(lambda: heads.parse(line, SPEC)), outcome(lambda: parse_infer(line, None, SPEC)))
    # The same line as a job's item: parse_item's, field by field, and its packing key the item's own.
    raw = RawLine(7, 8, 9, line)
    item, want = heads.item(raw, SPEC, "in.jsonl"), parse_item(raw, SPEC, parse_infer_line, "in.jsonl")
    assert item == want
    assert item.key is None or (item.key == signature(item) and item.key == signature(want))


def test_a_known_head_gives_each_line_its_own_data_and_id() -> None:
    heads = LineHeads()
    extra = {"outputs": [{"name": "Y"}], "parameters": {"priority": 2, "k": "v"}}
    first = heads.parse(_line(_doc([1, 2, 3, 4], [5, 6], id="one", **extra)), SPEC)
    assert len(heads) == 1
    second_line = _line(_doc([0.5, -1, 1e-8, 16777217], [[7, 8]], id="two", **extra))
    second = heads.parse(second_line, SPEC)
    assert len(heads) == 1  # the same head: used, not kept again
    same(second, parse_infer(second_line, None, SPEC))
    assert first.client_id == "one" and second.client_id == "two"
    assert bytes(first.inputs[1].data) != bytes(second.inputs[1].data)
    # Nothing mutable is shared between the requests made from one entry.
    second.parameters["x"] = 1
    assert second.outputs is not None
    second.outputs.append("Z")
    _check(heads, _line(_doc([1, 2, 3, 4], [5, 6], id="three", **extra)))


@pytest.mark.parametrize("a, b, extra", [
    ([1, 2, 3, True], [5, 6], {}),
    ([1, 2, 3, "4"], [5, 6], {}),
    ([1, 2, 3, None], [5, 6], {}),
    ([1, 2, 3, 1e39], [5, 6], {}),
    ([1, 2, 3, 1e400], [5, 6], {}),
    ([1, 2, 3], [5, 6], {}),
    ([[1, 2], [3, 4]], [5, 6], {}),
    ([1, 2, 3, 4], [5, 6.5], {}),
    ([1, 2, 3, 4], [5, 2**31], {}),
    ([1, 2, 3, 4], [5, 18446744073709551616], {}),
    ([1, 2, 3, 4], [5, 6], {"id": 7}),
    ([1, 2, 3, 4], [5, 6], {"id": "x" * (MAX_ID_CHARS + 1)}),
    ([1, 2, 3, 4], [5, 6], {"id": "\ud800"}),
], ids=["bool", "string", "null", "beyond FP32", "infinite", "too few", "nested wrong", "a fraction for INT32",
        "beyond INT32", "beyond 64 bits", "id not text", "id too long", "id a lone surrogate"])
def test_a_line_refused_for_its_data_or_id_gets_parse_infers_error(a: Any, b: Any, extra: dict[str, Any]) -> None:
    heads = LineHeads()
    heads.parse(_line(_doc([1, 2, 3, 4], [5, 6], **({"id": "ok"} if "id" in extra else {}))), SPEC)
    assert len(heads) == 1
    _check(heads, _line(_doc(a, b, **extra)))


@pytest.mark.parametrize("doc", [
    {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                {"name": "B", "datatype": "INT32", "shape": [1, 0], "parameters": {"binary_data_size": 0}}]},
    {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}]},
    {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
     "parameters": {"big": 18446744073709551616}},
    {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}, {"name": "A"}]},
    {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
     "outputs": [{"name": "Y", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}}]},
], ids=["empty binary data", "binary data", "read by json", "refused", "output to a region"])
def test_heads_whose_result_is_not_theirs_alone_are_not_kept(doc: dict[str, Any]) -> None:
    heads = LineHeads()
    for _ in range(2):
        _check(heads, _line(doc))
    assert len(heads) == 0


def test_a_sequence_models_lines_are_parsed_each_time() -> None:
    spec = parse_config(CONFIG + 'sequence_batching { }\n', source="test", model_name="m")
    heads = LineHeads()
    for sid in (1, 1, 2):
        line = _line(_doc([1, 2, 3, 4], [5, 6], parameters={"sequence_id": sid, "sequence_start": True}))
        got = heads.parse(line, spec)
        same(got, parse_infer(line, None, spec))
        assert got.sequence is not None and got.sequence.id == sid
    assert len(heads) == 0


def test_heads_that_differ_in_one_part_are_each_their_own() -> None:
    """Each part of a head decides something: lines that differ only there never share an entry."""
    heads = LineHeads()
    b2 = {"name": "B", "datatype": "INT32", "shape": [2, 1], "data": [5, 6]}
    variants = [
        _doc([1, 2, 3, 4], [5, 6]),
        _doc([1, 2, 3, 4], [5, 6], parameters={"priority": 1}),
        _doc([1, 2, 3, 4], [5, 6], parameters={"priority": 2}),
        _doc([1, 2, 3, 4], [5, 6], parameters={"k": "a"}),
        _doc([1, 2, 3, 4], [5, 6], parameters={"k": "b"}),
        _doc([1, 2, 3, 4], [5, 6], parameters={"binary_data_output": True}),
        _doc([1, 2, 3, 4], [5, 6], outputs=[{"name": "Y"}]),
        _doc([1, 2, 3, 4], [5, 6], outputs=[{"name": "Z", "parameters": {"binary_data": True}}]),
        _doc([1, 2, 3, 4], [5, 6]) | {"inputs": [_doc([1, 2, 3, 4], [5, 6])["inputs"][1],
                                                  _doc([1, 2, 3, 4], [5, 6])["inputs"][0]]},
        {"inputs": [{"name": "A", "datatype": "FP32", "shape": [2, 4], "data": [1, 2, 3, 4] * 2}, b2]},
        {"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                    {**b2, "shape": [1, 3], "data": [5, 6, 7]}]},
    ]
    for _ in range(2):
        for doc in variants:
            _check(heads, _line(doc))
    assert len(heads) == len(variants)
    # A passed-through parameter's JSON type is its own head (1, 1.0 and true are equal to Python's ==).
    for value in (1, 1.0, True, 1, True, 1.0):
        got = heads.parse(_line(_doc([1, 2, 3, 4], [5, 6], parameters={"k": value})), SPEC)
        assert type(got.parameters["k"]) is type(value)


def test_no_head_is_kept_without_room() -> None:
    heads = LineHeads(capacity=0)
    for _ in range(2):
        _check(heads, _line(_doc([1, 2, 3, 4], [5, 6])))
    assert len(heads) == 0


def test_a_reloaded_config_is_checked_anew() -> None:
    heads = LineHeads()
    line = _line(_doc([1, 2, 3, 4], [5, 6]))
    heads.parse(line, SPEC)
    reloaded = parse_config(CONFIG.replace("dims: [ 4 ]", "dims: [ 5 ]", 1), source="test", model_name="m")
    with pytest.raises(ServingError) as refused:
        heads.parse(line, reloaded)
    assert "unexpected shape" in refused.value.message


def test_the_oldest_head_goes_when_full() -> None:
    heads = LineHeads(capacity=2)
    for n in (1, 2, 3):
        heads.parse(_line(_doc([1, 2, 3, 4], [5] * n) | {"inputs": [
            {"name": "B", "datatype": "INT32", "shape": [1, n], "data": [5] * n},
            {"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}), SPEC)
    assert len(heads) == 2


def test_a_jobs_infer_lines_are_read_through_their_heads() -> None:
    items = item_parser(SPEC)
    owner = getattr(getattr(items, "func", None), "__self__", None)
    assert isinstance(owner, LineHeads)
    items(RawLine(0, 1, 0, _line(_doc([1, 2, 3, 4], [5, 6]))))
    assert len(owner) == 1


def test_a_known_heads_items_share_its_key_and_nothing_mutable() -> None:
    items = item_parser(SPEC, "in.jsonl")
    extra = {"outputs": [{"name": "Y"}], "parameters": {"k": "v"}}
    first, second, third = (items(RawLine(k, k + 1, 0, _line(_doc([k, 2, 3, 4], [5, 6], **extra))))
                            for k in range(3))
    assert first.key is None  # its head was not known yet: computed when packed
    assert second.key is not None and second.key is third.key and second.key == signature(second)
    assert second.parameters is not third.parameters and second.outputs is not third.outputs
    assert [bytes(t.data) for t in second.inputs or []] != [bytes(t.data) for t in third.inputs or []]
    other = items(RawLine(3, 4, 0, _line(_doc([1, 2, 3, 4], [5, 6], parameters={"k": "w"}))))
    again = items(RawLine(4, 5, 0, _line(_doc([1, 2, 3, 4], [5, 6], parameters={"k": "w"}))))
    assert again.key == signature(again) != second.key and other.key is None


# ---------------------------------------------------------------- every line, as parse_infer reads it

_WRONG = st.one_of(st.booleans(), st.text(max_size=2), st.none(), st.just(1e39), st.floats(allow_nan=False),
                   st.lists(st.integers(0, 3), max_size=2), st.integers(-(2**40), 2**40))


@st.composite
def heads(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly valid heads for SPEC (so that most are kept and then known), each part sometimes wrong; the
    inputs' data is drawn per line (`lines`)."""
    def wrong() -> bool:
        return draw(st.integers(0, 7)) == 0

    rows = draw(st.integers(0, 9)) if wrong() else draw(st.integers(1, 3))
    entries = []
    for name, datatype, width in (("A", "FP32", 4), ("B", "INT32", draw(st.integers(1, 3))), ("S", "BYTES", 1)):
        if draw(st.integers(0, 9)) == 0 or (name == "S" and draw(st.booleans())):
            continue  # missing
        shape = draw(st.lists(st.integers(-1, 5), max_size=3)) if wrong() else [rows, width]
        entry: dict[str, Any] = {"name": name, "datatype": "FP64" if wrong() else datatype, "shape": shape}
        if draw(st.integers(0, 9)) == 0:
            entry["parameters"] = {"x": draw(st.integers(0, 3))}
        entries.append(entry)
    doc: dict[str, Any] = {"inputs": draw(st.permutations(entries))}
    return with_outputs_and_parameters(draw, doc)


@st.composite
def lines(draw: st.DrawFn, head: dict[str, Any]) -> bytes:
    """A line of `head`: each input's data drawn for its shape (its elements sometimes wrong), an id or not."""
    doc = dict(head)
    inputs = []
    for entry in head["inputs"]:
        count = 1
        for d in entry["shape"]:
            count *= max(d, 0)
        value: Any = {"FP32": st.floats(-1e6, 1e6, width=32), "INT32": st.integers(-(2**31), 2**31 - 1),
                      "BYTES": st.text(max_size=3)}.get(entry["datatype"], st.integers(0, 9))
        data = draw(st.lists(st.one_of(value, _WRONG) if draw(st.integers(0, 4)) == 0 else value,
                             min_size=count, max_size=count) if draw(st.integers(0, 9)) else
                    st.lists(value, max_size=count + 1))
        inputs.append({**entry, "data": data})
    doc["inputs"] = inputs
    if draw(st.booleans()):
        doc = {"id": draw(st.one_of(st.text(max_size=4), st.integers(0, 3))), **doc}
    return _line(doc)


@settings(max_examples=300, deadline=None)
@given(drawn=st.lists(heads(), min_size=1, max_size=3), data=st.data())
def test_every_line_parses_as_parse_infer_parses_it(drawn: list[dict[str, Any]], data: st.DataObject) -> None:
    """Whatever the heads, first seen or known, and whatever data and id each line has, lines of several heads
    through one cache: parse_infer's result or error."""
    cache = LineHeads()
    mixed = [line for head in drawn for line in data.draw(st.lists(lines(head), min_size=2, max_size=4))]
    for line in data.draw(st.permutations(mixed)):
        _check(cache, line)
        _check(cache, line)  # again, through the entry it may have made
