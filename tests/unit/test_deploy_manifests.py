"""The autoscaling examples of docs/deployment.md (docs/deploy/*.yaml) against their schemas: KEDA's
ScaledObject CRD schema (vendored: tests/data/keda/) with jsonschema, and the HorizontalPodAutoscaler
through the Kubernetes Python client's models (autoscaling/v2). Unknown fields are refused, as
`kubectl apply --validate=strict` refuses them; a deliberately broken copy of each shows that a wrong
field fails."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes.client
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy"
KEDA_SCHEMA = ROOT / "tests" / "data" / "keda" / "scaledobject-openapiv3.yaml"


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the fields (a CRD schema leaves them
    to be pruned; strict field validation refuses them instead)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def keda_errors(doc: Any) -> list[str]:
    schema = _strict(yaml.safe_load(KEDA_SCHEMA.read_text()))
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


_LIST = re.compile(r"^[Ll]ist\[(.+)\]$")
_DICT = re.compile(r"^(?:dict\(str, (.+)\)|Dict\[str, (.+)\])$")
_SCALARS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "float": (float, int),
                                         "datetime": (str,), "object": (object,)}


def _build(value: Any, kind: str, path: str) -> Any:
    """`value` (parsed YAML) as the client's model `kind` (an openapi_types entry); raises ValueError
    naming the path of an unknown field, a wrong type or a missing required field."""
    if kind in _SCALARS:
        if not isinstance(value, _SCALARS[kind]) or (kind == "int" and isinstance(value, bool)):
            raise ValueError(f"{path}: expected {kind}, got {value!r}")
        return value
    if (m := _LIST.match(kind)) is not None:
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        return [_build(v, m.group(1), f"{path}[{i}]") for i, v in enumerate(value)]
    if (m := _DICT.match(kind)) is not None:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a map, got {value!r}")
        inner = m.group(1) or m.group(2)
        return {k: _build(v, inner, f"{path}.{k}") for k, v in value.items()}
    model = getattr(kubernetes.client, kind)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a {kind} object, got {value!r}")
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    unknown = sorted(set(value) - set(by_json))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown} for {kind}")
    fields = {by_json[k]: _build(v, model.openapi_types[by_json[k]], f"{path}.{k}") for k, v in value.items()}
    try:
        return model(**fields)  # the client's own checks: required fields, enums
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def hpa_errors(doc: Any) -> list[str]:
    if (doc.get("apiVersion"), doc.get("kind")) != ("autoscaling/v2", "HorizontalPodAutoscaler"):
        return [f"not an autoscaling/v2 HorizontalPodAutoscaler: {doc.get('apiVersion')} {doc.get('kind')}"]
    try:
        _build(doc, "V2HorizontalPodAutoscaler", "")
    except ValueError as exc:
        return [str(exc)]
    return []


def _load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_the_keda_scaled_object_matches_its_schema() -> None:
    doc = _load("keda-scaledobject.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert keda_errors(doc) == []
    trigger = doc["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and "nv_inference_pending_request_count" in trigger["metadata"]["query"]


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d["spec"].__setitem__("maxReplicas", 16), "Additional properties are not allowed ('maxReplicas'"),
    (lambda d: d["spec"].__setitem__("minReplicaCount", "one"), "'one' is not of type 'integer'"),
    (lambda d: d["spec"]["triggers"][0]["metadata"].__setitem__("threshold", 32), "32 is not of type 'string'"),
    (lambda d: d["spec"].pop("scaleTargetRef"), "'scaleTargetRef' is a required property"),
])
def test_a_broken_scaled_object_is_refused(change: Any, expected: str) -> None:
    broken = copy.deepcopy(_load("keda-scaledobject.yaml"))
    change(broken)
    assert any(expected in e for e in keda_errors(broken)), keda_errors(broken)


def test_the_hpa_matches_the_kubernetes_model() -> None:
    doc = _load("hpa.yaml")
    assert hpa_errors(doc) == []
    assert doc["spec"]["metrics"][0]["type"] == "External"


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d["spec"].__setitem__("maxReplicaCount", 16), r"spec: unknown field\(s\) \['maxReplicaCount'\]"),
    (lambda d: d["spec"]["metrics"][0]["external"]["target"].__setitem__("averageValue", ["32"]),
     r"\.spec\.metrics\[0\]\.external\.target\.averageValue: expected str"),
    (lambda d: d["spec"].pop("maxReplicas"), r"maxReplicas\s+Field required|`max_replicas`, must not be `None`"),
])
def test_a_broken_hpa_is_refused(change: Any, expected: str) -> None:
    broken = copy.deepcopy(_load("hpa.yaml"))
    change(broken)
    errors = hpa_errors(broken)
    assert any(re.search(expected, e) for e in errors), errors
