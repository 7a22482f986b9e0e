"""`fleet analyze` (fleet/analyzer) against real gateway and worker processes in explicit model-control mode:
it loads each config of the sweep through the repository extension, measures it with its own load, picks
the best and loads it (--apply), or puts the model's config back. The model is a `sleep` model whose
batch costs 2 ms + 15 ms per item (wall time, no CPU), so a second instance doubles what C=4 gets, and a
busy machine (the suite starts other systems meanwhile) slows the rest far less than that: the expected
winner is known without timing anything tightly."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.http as th

from tests.support.processes import Cluster, explicit_cluster

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

CONFIG = """backend: "sleep"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 }
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "execute_delay_us" value { string_value: "2000" } }
parameters { key: "execute_delay_per_item_us" value { string_value: "15000" } }
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("analyze")
    repo = tmp / "models"
    (repo / "paced" / "1").mkdir(parents=True)
    (repo / "paced" / "config.pbtxt").write_text(CONFIG)
    with explicit_cluster(tmp, repo, "analyze", "paced") as c:
        yield c


def analyze(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet", "analyze", "paced", "--url", cluster.base_url,
                           "--warmup", "0.3", "--seconds", "1.0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)


def served_config(cluster: Cluster) -> dict[str, object]:
    client = th.InferenceServerClient(f"127.0.0.1:{cluster.http_port}")
    try:
        return dict(client.get_model_config("paced"))
    finally:
        client.close()


def test_the_sweep_measures_every_point_and_applies_the_best(cluster: Cluster, tmp_path: Path) -> None:
    out = analyze(cluster, "--instances", "1,2", "--delays", "0", "--concurrency", "1,4",
                  "--json", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.svg"),
                  "--write-config", str(tmp_path / "best.pbtxt"), "--apply")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 configs x 2 concurrencies (1, 4) = 4 measurements" in out.stdout
    doc = json.loads((tmp_path / "m.json").read_text())
    rows = doc["measurements"]
    assert len(rows) == 4 and all(r["errors"] == 0 and r["infer_s"] > 0 for r in rows)
    assert [r["point"]["instances"] for r in rows[:2]] == [1, 1]  # the current config first
    one = next(r for r in rows if r["point"] == rows[0]["point"] and r["concurrency"] == 4)
    assert one["mean_batch"] > 1.0  # requests that waited while one instance computed were batched
    assert doc["best"]["point"]["instances"] == 2 and doc["best"]["concurrency"] == 4
    assert "best: 2 inst" in out.stdout and "(nothing within the budget)" not in out.stdout
    config = served_config(cluster)
    assert config["instance_group"][0]["count"] == 2  # type: ignore[index]
    assert "count: 2" in (tmp_path / "best.pbtxt").read_text()
    assert (tmp_path / "m.svg").read_text().startswith("<svg")


def test_without_apply_the_model_gets_its_config_back(cluster: Cluster) -> None:
    before = served_config(cluster)
    out = analyze(cluster, "--instances", "3", "--delays", "0", "--concurrency", "2", "--latency-budget-ms", "0.01")
    assert out.returncode == 1, out.stdout + out.stderr  # nothing answers in 10 µs
    assert "no config kept p99 within 0.01 ms" in out.stdout
    assert served_config(cluster) == before


def test_a_sweep_the_model_cannot_take_is_refused_before_anything_loads(cluster: Cluster) -> None:
    out = analyze(cluster, "--threads", "2")
    assert out.returncode == 2 and "has no intra-op thread setting" in out.stderr
    out = analyze(cluster, "--dry-run", "--instances", "1,2,3", "--concurrency", "1,8")
    assert out.returncode == 0 and "configs x 2 concurrencies" in out.stdout
    assert "3 inst, delay 1000 µs" in out.stdout
