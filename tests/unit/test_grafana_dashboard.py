"""The Grafana dashboard and provisioning under docs/deploy/grafana/, checked as files (Grafana cannot be
installed here: no Debian package, no registry for its image). The metric names its queries use are
checked against a real gateway's /metrics in tests/e2e/test_dashboard.py, and every query is evaluated
by a real Prometheus in tests/compose/."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docs" / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "fleet.json"
METRIC = re.compile(r"\b((?:nv|fleet)_[a-z0-9_]+)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def metric_names(d: dict[str, Any]) -> set[str]:
    """Metric names the dashboard's queries read, histogram buckets folded into their family (the
    dashboard reads `_bucket` series only: `_count` would fold Triton's nv_inference_count away)."""
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in d["templating"]["list"]]
    return {m.removesuffix("_bucket") for e in exprs for m in METRIC.findall(e)}


def check(d: dict[str, Any], datasource_uid: str) -> list[str]:
    """What is wrong with a dashboard: [] if nothing."""
    problems = []
    for key in ("uid", "title", "panels", "schemaVersion", "templating"):
        if key not in d:
            problems.append(f"no {key}")
    ids = [p.get("id") for p in d.get("panels", [])]
    if len(set(ids)) != len(ids):
        problems.append(f"panel ids repeat: {ids}")
    boxes = []
    for p in d.get("panels", []):
        g = p.get("gridPos", {})
        if not all(isinstance(g.get(k), int) for k in "xywh") or g["x"] < 0 or g["x"] + g["w"] > 24 or g["h"] < 1:
            problems.append(f"panel {p.get('title')!r}: gridPos {g} is not inside the 24-column grid")
            continue
        boxes.append((p["title"], g))
        if not p.get("targets"):
            problems.append(f"panel {p.get('title')!r} has no query")
        for t in p.get("targets", []):
            if not t.get("expr") or t.get("datasource", {}).get("uid") != datasource_uid:
                problems.append(f"panel {p.get('title')!r}: query {t} has no expr or another data source")
            if t.get("expr", "").count("(") != t.get("expr", "").count(")"):
                problems.append(f"panel {p.get('title')!r}: unbalanced parentheses in {t['expr']}")
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1:]:
            if ga["x"] < gb["x"] + gb["w"] and gb["x"] < ga["x"] + ga["w"] and \
                    ga["y"] < gb["y"] + gb["h"] and gb["y"] < ga["y"] + ga["h"]:
                problems.append(f"panels {a!r} and {b!r} overlap")
    return problems


def test_the_provisioned_data_source_is_compose_s_prometheus() -> None:
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    [source] = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert "./docs/deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "fleet.yml").read_text())["providers"][0]
    assert f"./docs/deploy/grafana/dashboards:{provider['options']['path']}:ro" in mounts


def test_the_dashboard_is_well_formed() -> None:
    uid = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert check(dashboard(), uid["datasources"][0]["uid"]) == []


def test_the_dashboard_covers_what_the_issue_asks_for() -> None:
    names = metric_names(dashboard())
    for needed in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count",
                   "fleet_request_duration_us", "fleet_pending_requests", "fleet_batch_size", "fleet_workers"):
        assert needed in names, needed


@pytest.mark.parametrize("breakage", ["overlap", "no query", "other source", "outside"])
def test_the_check_catches_a_broken_dashboard(breakage: str) -> None:
    d = dashboard()
    p0, p1 = d["panels"][0], d["panels"][1]
    if breakage == "overlap":
        p1["gridPos"] = dict(p0["gridPos"])
    elif breakage == "no query":
        p0["targets"] = []
    elif breakage == "other source":
        p0["targets"][0]["datasource"] = {"type": "prometheus", "uid": "elsewhere"}
    else:
        p0["gridPos"]["x"] = 20
    assert check(d, "fleet-prometheus") != []
