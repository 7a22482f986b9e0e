"""gateway/header_cache.py: a request parsed from a known header is what parse_infer makes of it, error or
result, whatever the header and the tail; only headers whose result depends on them alone are kept."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.errors import ServingError
from fleet.kserve import parse_infer
from fleet.model_config import parse_config
from gateway.header_cache import HeaderCache
from tests.support.parsed_infer import CONFIG, SPEC, outcome, same, with_outputs_and_parameters


def _body(doc: dict[str, Any], tail: bytes) -> tuple[bytes, str]:
    header = json.dumps(doc).encode()
    return header + tail, str(len(header))


def _binary(name: str, datatype: str, shape: list[int], size: int, **params: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": size, **params}}


def test_a_known_header_gives_each_tail_its_own_inputs() -> None:
    cache = HeaderCache()
    doc = {"inputs": [_binary("A", "FP32", [1, 4], 16), _binary("B", "INT32", [1, 2], 8)],
           "outputs": [{"name": "Y", "parameters": {"binary_data": True}}], "parameters": {"priority": 2, "k": "v"}}
    first = cache.parse(*_body(doc, bytes(range(24))), SPEC, None)
    assert len(cache) == 1
    second = cache.parse(*_body(doc, bytes(range(100, 124))), SPEC, None)
    same(second, parse_infer(*_body(doc, bytes(range(100, 124))), SPEC))
    assert bytes(first.inputs[0].data) == bytes(range(16)) and bytes(second.inputs[1].data) == bytes(range(116, 124))
    # Nothing mutable is shared between the requests made from one entry.
    second.parameters["x"] = 1
    assert second.outputs is not None
    second.outputs.append("Z")
    same(cache.parse(*_body(doc, bytes(24)), SPEC, None), parse_infer(*_body(doc, bytes(24)), SPEC))


def test_a_tail_of_another_length_gets_parse_infers_error() -> None:
    cache = HeaderCache()
    doc = {"inputs": [_binary("A", "FP32", [1, 4], 16), _binary("B", "INT32", [1, 2], 8)]}
    cache.parse(*_body(doc, bytes(24)), SPEC, None)
    for tail in (bytes(23), bytes(25), b""):
        same(outcome(lambda t=tail: cache.parse(*_body(doc, t), SPEC, None)),  # type: ignore[misc]
              outcome(lambda t=tail: parse_infer(*_body(doc, t), SPEC)))  # type: ignore[misc]


@pytest.mark.parametrize("doc, tail", [
    ({"id": "r1", "inputs": [_binary("A", "FP32", [1, 4], 16), _binary("B", "INT32", [1, 1], 4)]}, bytes(20)),
    ({"inputs": [_binary("A", "FP32", [1, 4], 16), {"name": "B", "datatype": "INT32", "shape": [1, 1],
                                                     "data": [7]}]}, bytes(16)),
    ({"inputs": [_binary("A", "FP32", [1, 4], 16), _binary("B", "INT32", [1, 1], 4),
                 _binary("S", "BYTES", [1, 1], 6)]}, bytes(20) + b"\x02\x00\x00\x00hi"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                 {"name": "B", "datatype": "INT32", "shape": [1, 1], "data": [7]}]}, b""),
], ids=["request id", "JSON data", "BYTES", "no binary tail"])
def test_headers_whose_result_depends_on_more_are_parsed_each_time(doc: dict[str, Any], tail: bytes) -> None:
    cache = HeaderCache()
    body, length = _body(doc, tail)
    got = cache.parse(body, length if tail else None, SPEC, None)
    same(got, parse_infer(body, length if tail else None, SPEC))
    assert len(cache) == 0


def test_a_reloaded_config_is_checked_anew() -> None:
    cache = HeaderCache()
    doc = {"inputs": [_binary("A", "FP32", [1, 4], 16), _binary("B", "INT32", [1, 2], 8)]}
    cache.parse(*_body(doc, bytes(24)), SPEC, None)
    reloaded = parse_config(CONFIG.replace("dims: [ 4 ]", "dims: [ 5 ]", 1), source="test", model_name="m")
    with pytest.raises(ServingError) as refused:
        cache.parse(*_body(doc, bytes(24)), reloaded, None)
    assert "unexpected shape" in refused.value.message


def test_the_oldest_entry_goes_when_full() -> None:
    cache = HeaderCache(capacity=2)
    for n in (1, 2, 3):
        doc = {"inputs": [_binary("A", "FP32", [1, 4], 16), _binary("B", "INT32", [1, n], 4 * n)]}
        cache.parse(*_body(doc, bytes(16 + 4 * n)), SPEC, None)
    assert len(cache) == 2


@st.composite
def docs(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly valid requests for SPEC (so that many are kept and then known), each part sometimes wrong."""
    def wrong() -> bool:
        return draw(st.integers(0, 5)) == 0

    rows = draw(st.integers(0, 9)) if wrong() else draw(st.integers(1, 8))
    entries = []
    for name, datatype, width, itemsize in (("A", "FP32", 4, 4), ("B", "INT32", draw(st.integers(0, 3)), 4)):
        if draw(st.integers(0, 9)) == 0:
            continue  # missing
        shape = draw(st.lists(st.integers(-1, 5), max_size=3)) if wrong() else [rows, width]
        count = 1
        for d in shape:
            count *= max(d, 0)
        size = draw(st.integers(-1, 40)) if wrong() else count * itemsize
        entry = _binary(name, "FP64" if wrong() else datatype, shape, size)
        if draw(st.integers(0, 9)) == 0:
            entry["parameters"]["x"] = draw(st.integers(0, 3))
        entries.append(entry)
    if draw(st.integers(0, 5)) == 0:
        entries.append({"name": draw(st.sampled_from(["S", "Q"])), "datatype": "BYTES", "shape": [rows, 1],
                        "parameters": {"binary_data_size": 6}})
    doc: dict[str, Any] = {"inputs": draw(st.permutations(entries))}
    return with_outputs_and_parameters(draw, doc)


@settings(max_examples=300, deadline=None)
@given(doc=docs(), tails=st.lists(st.binary(max_size=48), min_size=1, max_size=4), data=st.data())
def test_every_request_parses_as_parse_infer_parses_it(doc: dict[str, Any], tails: list[bytes],
                                                        data: st.DataObject) -> None:
    """Whatever the header, first seen or known, and whatever tail follows it: parse_infer's result or error."""
    declared = sum(max(0, i["parameters"]["binary_data_size"]) for i in doc["inputs"])
    fitting = data.draw(st.lists(st.binary(min_size=declared, max_size=declared), min_size=2, max_size=3))
    cache = HeaderCache()
    for tail in [*fitting, *tails]:
        body, length = _body(doc, tail)
        same(outcome(lambda b=body, n=length: cache.parse(b, n, SPEC, None)),  # type: ignore[misc]
              outcome(lambda b=body, n=length: parse_infer(b, n, SPEC)))  # type: ignore[misc]
        # The same tail again, through the entry it may have made.
        same(outcome(lambda b=body, n=length: cache.parse(b, n, SPEC, None)),  # type: ignore[misc]
              outcome(lambda b=body, n=length: parse_infer(b, n, SPEC)))  # type: ignore[misc]
