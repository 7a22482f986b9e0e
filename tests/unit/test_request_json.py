"""fleet/request_json.py: a request read through orjson is what Python's json module reads, and a refusal
says what json's said; a response written by orjson reads back as json's does."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.errors import InvalidInput, ServingError
from fleet.kserve import ParsedInfer, parse_infer, parse_infer_doc, split_body
from fleet.model_config import parse_config
from fleet.request_json import dump_json, load_exact, load_json

SPEC = parse_config(
    'name: "m"\nbackend: "python"\nmax_batch_size: 8\n'
    'input [ { name: "F" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "I" data_type: TYPE_INT64 dims: [ 2 ] '
    "optional: true } ]\n"
    'output [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]',
    source="m", model_name="m",
)


def _outcome(parse: Any, body: bytes, header_length: str | None = None) -> tuple[Any, ...]:
    try:
        req: ParsedInfer = parse(body, header_length)
    except ServingError as exc:
        return ("refused", type(exc).__name__, exc.message)
    return ("parsed", [(t.name, t.datatype, t.shape, bytes(t.data)) for t in req.inputs], req.parameters,
            req.outputs, req.client_id, req.priority, req.timeout_us)


def _as_json_reads(body: bytes, header_length: str | None) -> ParsedInfer:
    """What parse_infer did before orjson: the header read by json alone."""
    header, binary = split_body(body, header_length, SPEC)
    return parse_infer_doc(load_exact(header), SPEC, binary, None)


def _both(body: bytes, header_length: str | None = None) -> tuple[Any, ...]:
    fast = _outcome(lambda b, h: parse_infer(b, h, SPEC), body, header_length)
    assert fast == _outcome(_as_json_reads, body, header_length)
    return fast


def _body(f: str = "[1, 2]", i: str | None = None, parameters: str = "{}", extra: str = "") -> bytes:
    inputs = f'{{"name": "F", "datatype": "FP32", "shape": [1, 2], "data": {f}}}'
    if i is not None:
        inputs += f', {{"name": "I", "datatype": "INT64", "shape": [1, 2], "data": {i}}}'
    return f'{{"id": "r", "parameters": {parameters}, "inputs": [{inputs}]{extra}}}'.encode()


@pytest.mark.parametrize(("body", "verdict"), [
    (_body(), "parsed"),
    (_body("[1e30, 100000000000000000000000000000]"), "parsed"),  # an integer past 64 bits as FP32: a float
    (_body("[NaN, 1]"), "refused"),  # json's extension, refused with json's words
    (_body("[1e400, 1]"), "refused"),  # orjson refuses, json reads inf: the finite check says so
    (_body(i="[18446744073709551616, 1]"), "refused"),  # orjson reads a float, json an int past INT64
    (_body(i="[9223372036854775807, -9223372036854775808]"), "parsed"),
    (_body(parameters='{"priority": 18446744073709551616}'), "refused"),  # a float in orjson would pass
    (_body(parameters='{"timeout": 9223372036854775808}'), "parsed"),  # 2^63: a uint64 (an int in orjson too)
    (_body(parameters='{"custom": 12345678901234567890123}'), "refused"),  # past 64 bits: json's int, refused
    (_body(extra=', "outputs": [{"name": "X", "parameters": {"binary_data": true}}]'), "parsed"),
    (b'{"id": "\\ud800", "inputs": []}', "refused"),  # a lone surrogate: orjson refuses, json reads it
    (b'{"id": "a", "id": "b", "inputs": [{"name": "F", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}',
     "parsed"),  # duplicate keys: the last one, in both
    (_body("[" * 1010 + "1" + "]" * 1010), "refused"),  # nested past json's limit, within orjson's
    (b"[1, 2]", "refused"),
    (b'{"inputs": ', "refused"),
    (b"\xef\xbb\xbf{}", "refused"),
    (b'{"id": "\xff"}', "refused"),
])
def test_orjson_reads_as_json_does(body: bytes, verdict: str) -> None:
    assert _both(body)[0] == verdict


def test_the_words_of_a_refusal_are_jsons() -> None:
    assert _both(_body("[NaN, 1]"))[2] == "failed to parse the request JSON buffer: NaN is not valid JSON"
    assert _both(_body("[" * 1010 + "1" + "]" * 1010))[2] == \
        "failed to parse the request JSON buffer: nested too deeply"
    assert "INT64" in _both(_body(i="[18446744073709551616, 1]"))[2]  # the range, not "a number with a fraction"


def test_a_binary_header_reads_the_same() -> None:
    header = b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [1, 2], "parameters": {"binary_data_size": 8}}]}'
    assert _both(header + b"\x00" * 8, str(len(header)))[0] == "parsed"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _json_values, max_size=5), st.booleans())
def test_any_object_reads_as_json_reads_it(doc: dict[str, Any], in_parameters: bool) -> None:
    if in_parameters:
        doc = {"parameters": doc, "inputs": [{"name": "F", "parameters": doc}]}
    text = json.dumps(doc).encode()
    got, fast = load_json(text)
    exact = load_exact(text)
    if fast:  # orjson's reading kept: then it is json's, except a number past 64 bits outside parameters
        assert _same(got, exact) or _has_huge_int(exact)
    else:
        assert got == exact


def _has_huge_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) >= 2**63
    if isinstance(value, list):
        return any(_has_huge_int(v) for v in value)
    if isinstance(value, dict):
        return any(_has_huge_int(v) for v in value.values())
    return False


def _same(a: Any, b: Any) -> bool:
    """Equal, with types: 1 and 1.0 are not the same reading."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _json_values, max_size=5))
def test_a_response_written_by_orjson_reads_back_as_jsons(doc: dict[str, Any]) -> None:
    ours = dump_json(doc, checked=True)
    assert _same(json.loads(ours), json.loads(json.dumps(doc, separators=(",", ":"))))


def test_a_response_with_nan_is_refused_unless_known_finite() -> None:
    with pytest.raises(ValueError):
        dump_json({"parameters": {"p": math.nan}}, checked=False)
    assert dump_json({"id": "\ud800"}, checked=True) == b'{"id":"\\ud800"}'  # json's escape, not an error
    assert json.loads(dump_json({"s": "héllo"}, checked=True)) == {"s": "héllo"}


def test_an_orjson_refusal_is_not_an_invalid_input_of_its_own() -> None:
    with pytest.raises(InvalidInput, match="Expecting"):  # json's words for a truncated document
        load_json(b'{"a": ')
