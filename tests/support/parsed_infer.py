"""Comparing what a cache of decoded infer requests returns with what its decoder returns (gateway/header_cache.py
against parse_infer, gateway/grpc/request_heads.py against decode_infer): the same result or the same error."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from hypothesis import strategies as st

from fleet.errors import ServingError
from fleet.kserve import ParsedInfer
from fleet.model_config import parse_config

Outcome = ParsedInfer | tuple[type, str]

# The model both caches' tests decode for: a fixed-shape input, a variable one and an optional BYTES one.
CONFIG = """
name: "m"
backend: "python"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_FP32, dims: [ 4 ] },
        { name: "B", data_type: TYPE_INT32, dims: [ -1 ] },
        { name: "S", data_type: TYPE_STRING, dims: [ 1 ], optional: true } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] }, { name: "Z", data_type: TYPE_INT32, dims: [ -1 ] } ]
"""
SPEC = parse_config(CONFIG, source="test", model_name="m")


def outcome(decode: Callable[[], ParsedInfer]) -> Outcome:
    """What `decode` returns, or the type and message of the ServingError it raises."""
    try:
        return decode()
    except ServingError as exc:
        return type(exc), exc.message


def same(got: Outcome, want: Outcome) -> None:
    """The same result (every field of it; inputs by their bytes) or the same error."""
    assert type(got) is type(want)
    if isinstance(got, ParsedInfer):
        assert isinstance(want, ParsedInfer)
        for f in fields(ParsedInfer):
            if f.name == "inputs":
                assert [(t.name, t.datatype, t.shape, bytes(t.data)) for t in got.inputs] == \
                    [(t.name, t.datatype, t.shape, bytes(t.data)) for t in want.inputs]
            else:
                assert getattr(got, f.name) == getattr(want, f.name), f.name
    else:
        assert got == want


def with_outputs_and_parameters(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (a request's JSON, drawn by a test's strategy) with drawn `outputs` and `parameters`, or without:
    SPEC's outputs and some that it has not, the parameters fleet reads and some it passes through."""
    if draw(st.booleans()):
        doc["outputs"] = draw(st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(["Y", "Z", "W"])},
            optional={"parameters": st.fixed_dictionaries({"binary_data": st.booleans()})}), max_size=2))
    if draw(st.booleans()):
        doc["parameters"] = draw(st.dictionaries(st.sampled_from(["priority", "timeout", "k", "triton_x"]),
                                                 st.one_of(st.integers(-1, 3), st.text(max_size=2)), max_size=2))
    return doc
