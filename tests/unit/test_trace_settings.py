"""The trace extension's settings (fleet/trace_settings.py): validation with Triton's texts, Triton's
global/per-model semantics, the hash encoding, and the gRPC conversions."""

from __future__ import annotations

import json

import pytest

from fleet.errors import InvalidInput, Unsupported
from fleet.trace_settings import (
    DEFAULT,
    GLOBAL,
    TraceSetting,
    TraceState,
    TraceUpdate,
    check_update,
    decode_state,
    model_scope,
    parse_trace_update,
    response_to_grpc,
    update_from_grpc,
)

FILE = "/tmp/fleet-trace.json"


def parse(doc: object) -> TraceUpdate:
    return parse_trace_update(doc, FILE)


def test_values_are_strings_as_triton_takes_them_and_integers_too() -> None:
    update = parse({"trace_level": ["TENSORS", "TIMESTAMPS"], "trace_rate": "5", "trace_count": "-1",
                    "log_frequency": 2})
    assert update.sets == {"level": ("TIMESTAMPS", "TENSORS"), "rate": 5, "count": -1, "log_frequency": 2}
    assert update.clears == frozenset()


def test_null_clears_and_off_is_the_empty_level() -> None:
    update = parse({"trace_rate": None, "trace_level": ["OFF"]})
    assert update.sets == {"level": ()}
    assert update.clears == {"rate"}
    assert parse({"trace_level": []}).sets == {}  # Triton: an empty list changes nothing


@pytest.mark.parametrize(("doc", "text"), [
    ({"trace_level": ["OFF", "TIMESTAMPS"]}, "Expect only one trace level 'OFF' is specified"),
    ({"trace_level": ["SECONDS"]}, "unknown trace level 'SECONDS'"),
    ({"trace_level": "TIMESTAMPS"}, "attempt to access JSON non-array as array"),
    ({"trace_level": [1]}, "attempt to access JSON non-string as string"),
    ({"trace_rate": "abc"}, "Unable to parse 'trace_rate', got: abc"),
    ({"trace_rate": "12abc"}, "Unable to parse 'trace_rate', got: 12abc"),
    ({"trace_rate": "4294967296"},
     "Unable to parse 'trace_rate', value is out of range [ 0, 4294967295 ], got: 4294967296"),
    ({"trace_rate": 1.5}, "attempt to access JSON non-string as string"),
    ({"trace_rate": True}, "attempt to access JSON non-string as string"),
    ({"trace_count": "-2"}, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
    ({"log_frequency": "-1"}, "Unable to parse 'log_frequency', value is out of range [ 0, 4294967295 ], got: -1"),
    ({"trace_sampling": "1"}, "unknown trace setting 'trace_sampling'"),
    (["trace_rate"], "must be a JSON object"),
])
def test_invalid_updates_name_the_setting(doc: object, text: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        parse(doc)
    assert text in exc.value.message


def test_trace_file_and_mode_cannot_be_changed_but_may_be_restated() -> None:
    assert parse({"trace_file": FILE, "trace_mode": "triton", "trace_rate": "1"}).sets == {"rate": 1}
    assert parse({"trace_file": None, "trace_mode": None}) == TraceUpdate()
    with pytest.raises(Unsupported, match="trace file location can not be updated through network protocol"):
        parse({"trace_file": "/etc/passwd"})
    with pytest.raises(Unsupported, match="trace mode \"opentelemetry\" is not supported"):
        parse({"trace_mode": "opentelemetry"})


def test_a_model_follows_the_global_setting_in_the_fields_it_does_not_set() -> None:
    state = TraceState().updated(GLOBAL, parse({"trace_level": ["TIMESTAMPS"], "trace_rate": "10"}))
    state = state.updated(model_scope("m"), parse({"trace_rate": "1"}))
    assert state.effective(None) == TraceSetting(level=("TIMESTAMPS",), rate=10)
    assert state.effective("m") == TraceSetting(level=("TIMESTAMPS",), rate=1)
    assert state.effective("other") == state.effective(None)
    later = state.updated(GLOBAL, parse({"trace_count": "7"}))
    assert later.effective("m") == TraceSetting(level=("TIMESTAMPS",), rate=1, count=7)
    # Clearing the model's only field: it follows the global setting entirely again.
    cleared = later.updated(model_scope("m"), parse({"trace_rate": None}))
    assert not cleared.has_model("m") and cleared.models() == []
    assert cleared.effective("m") == cleared.effective(None)
    # Clearing a global field: back to Triton's default.
    assert later.updated(GLOBAL, parse({"trace_rate": None})).effective(None).rate == DEFAULT.rate


def test_versions_renew_a_model_on_global_updates_only_while_it_follows_them() -> None:
    state = TraceState().updated(model_scope("m"), parse({"trace_rate": "1"}))
    before = state.version("m")
    assert state.updated(GLOBAL, parse({"trace_count": "3"})).version("m") != before
    full = state.updated(model_scope("m"), parse({"trace_level": ["TIMESTAMPS"], "trace_count": "1",
                                                  "log_frequency": "0"}))
    assert full.updated(GLOBAL, parse({"trace_count": "3"})).version("m") == full.version("m")


def test_a_setting_that_could_never_trace_is_refused_unless_tracing_is_off() -> None:
    with pytest.raises(InvalidInput, match="Attempting to set invalid trace setting :sample rate must be non-zero"):
        check_update(TraceState(), None, parse({"trace_level": ["TIMESTAMPS"], "trace_rate": "0"}))
    check_update(TraceState(), None, parse({"trace_rate": "0"}))  # level OFF: allowed
    check_update(TraceState(), "m", parse({"trace_level": ["OFF"], "trace_rate": "0"}))


def test_the_hash_decodes_to_the_state_it_was_written_from() -> None:
    raw = {b"global.level": json.dumps(["TIMESTAMPS"]).encode(), b"global.rate": b"3", b"global._v": b"2",
           b"model:a.b.count": b"5", b"model:a.b._v": b"1", b"model:x.unknown": b"1", b"global.count": b"oops"}
    state = decode_state(raw)
    assert state.effective(None) == TraceSetting(level=("TIMESTAMPS",), rate=3)
    assert state.effective("a.b") == TraceSetting(level=("TIMESTAMPS",), rate=3, count=5)
    assert state.models() == ["a.b"]
    assert state.version("a.b") == (2, 1)


def test_responses_are_tritons_strings() -> None:
    doc = TraceSetting(level=("TIMESTAMPS",), rate=2).response(4, FILE)
    assert doc == {"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_count": "4", "log_frequency": "0",
                   "trace_file": FILE, "trace_mode": "triton"}
    assert DEFAULT.response(-1, FILE)["trace_level"] == ["OFF"]


def test_grpc_values_convert_both_ways() -> None:
    assert update_from_grpc({"trace_level": ["TIMESTAMPS"], "trace_rate": ["5"], "trace_count": []}) == \
        {"trace_level": ["TIMESTAMPS"], "trace_rate": "5", "trace_count": None}
    assert response_to_grpc({"trace_level": ["OFF"], "trace_rate": "5"}) == \
        {"trace_level": ["OFF"], "trace_rate": ["5"]}
