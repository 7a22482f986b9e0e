"""Every metric the Grafana dashboard (docs/deploy/grafana/dashboards/fleet.json) reads is one a real
gateway exports, once requests have been served: a renamed metric breaks this test, not the dashboard.
Absent by design here: GPU metrics (no GPU) and per-job progress (only while a job runs)."""

from __future__ import annotations

import urllib.request

import numpy as np
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import RunningSystem
from tests.unit.test_grafana_dashboard import dashboard, metric_names

ABSENT_HERE = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "fleet_job_items_done", "fleet_job_items_total"}


def test_every_metric_the_dashboard_reads_is_exported(system: RunningSystem) -> None:
    client = httpclient.InferenceServerClient(url=system.url)
    x = np.zeros((1, 256), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client.infer("mlp", [inp])
    with urllib.request.urlopen(system.metrics_url, timeout=10) as r:
        text = r.read().decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name)
        exported.update(s.name for s in family.samples)  # counters: the family drops _total, samples keep it
    wanted = metric_names(dashboard()) - ABSENT_HERE
    assert wanted - exported == set()
