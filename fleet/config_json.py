"""Triton's rendering of a ModelConfig as JSON (GET /v2/models/NAME/config): proto field names in
declaration order, defaults printed, and exactly the 64-bit fields Triton prints as numbers."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format


def config_to_json(proto: Any) -> dict[str, Any]:
    raw = json_format.MessageToDict(
        proto, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    doc = _ordered(raw, proto.DESCRIPTOR)
    _fix_int64(doc)
    return doc


def _ordered(value: dict[str, Any], descriptor: Any) -> dict[str, Any]:
    """`value` (a MessageToDict object) with keys in .proto declaration order, recursively."""
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        if field.name not in value:
            continue
        item, sub = value[field.name], field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            value_desc = sub.fields_by_name["value"].message_type
            if value_desc is not None:
                item = {k: _ordered(v, value_desc) for k, v in item.items()}
        elif sub is not None:
            item = [_ordered(v, sub) for v in item] if field.is_repeated else _ordered(item, sub)
        out[field.name] = item
    return out


def _fix(obj: Any, key: str) -> None:
    """obj[key] (a 64-bit int or list of them, printed as strings by protobuf) as numbers."""
    if isinstance(obj, dict) and key in obj:
        value = obj[key]
        obj[key] = [int(x) for x in value] if isinstance(value, list) else int(value)


def _fix_int64(doc: dict[str, Any]) -> None:
    """Exactly the fields Triton core's ModelConfigToJson turns from strings into numbers. Like
    Triton, sequence_batching.state[].initial_state[].dims stay strings (Triton looks for
    `initial_state` on sequence_batching, where it never is) and map keys stay strings."""
    for io in [*doc.get("input", []), *doc.get("output", [])]:
        _fix(io, "dims")
        _fix(io.get("reshape"), "shape")
    _fix(doc.get("version_policy", {}).get("specific"), "versions")
    db = doc.get("dynamic_batching")
    if db is not None:
        for key in ("max_queue_delay_microseconds", "priority_levels", "default_priority_level"):
            _fix(db, key)
        _fix(db.get("default_queue_policy"), "default_timeout_microseconds")
        for policy in db.get("priority_queue_policy", {}).values():
            _fix(policy, "default_timeout_microseconds")
    seq = doc.get("sequence_batching")
    if seq is not None:
        _fix(seq, "max_sequence_idle_microseconds")
        _fix(seq.get("oldest"), "max_queue_delay_microseconds")
        _fix(seq.get("direct"), "max_queue_delay_microseconds")
        for state in seq.get("state", []):
            _fix(state, "dims")
    for step in doc.get("ensemble_scheduling", {}).get("step", []):
        _fix(step, "model_version")
    for warmup in doc.get("model_warmup", []):
        for tensor in warmup.get("inputs", {}).values():
            _fix(tensor, "dims")
