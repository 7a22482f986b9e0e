"""Triton's benchmark client runs against the gateway unchanged."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import RunningSystem

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PERF_ANALYZER = ROOT / ".tools/perf_analyzer/perf_analyzer"
# These tests check that perf_analyzer works against fleet, not how fast: on a shared 2-core machine whose
# speed drifts, its default 10% stability over 3 windows can fail to settle (seen once in a suite run).
STEADY = ["--stability-percentage", "50", "--max-trials", "20"]


def test_perf_analyzer_simple(system: RunningSystem) -> None:
    exe = str(PERF_ANALYZER) if PERF_ANALYZER.exists() else shutil.which("perf_analyzer")
    assert exe, "perf_analyzer is not installed: run `make perf-analyzer` (make test does)"
    cmd = [exe, "-m", "simple", "-i", "http", "-u", system.url, "--concurrency-range", "1:8:4",
           "--measurement-interval", "1000", *STEADY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Request concurrency: 5" in proc.stdout
    assert "Server:" in proc.stdout  # it read our statistics extension


def test_perf_analyzer_over_grpc(system: RunningSystem) -> None:
    """perf_analyzer's gRPC client: ModelMetadata/ModelConfig/ModelStatistics and ModelInfer (it sends
    triton_enable_empty_final_response on every request), synchronous and with --async."""
    exe = str(PERF_ANALYZER) if PERF_ANALYZER.exists() else shutil.which("perf_analyzer")
    assert exe, "perf_analyzer is not installed: run `make perf-analyzer` (make test does)"
    for mode in ([], ["--async"]):
        cmd = [exe, "-m", "simple", "-i", "grpc", "-u", system.grpc_url, "--concurrency-range", "1:8:4",
               "--measurement-interval", "1000", *STEADY, *mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Request concurrency: 5" in proc.stdout
        assert "Server:" in proc.stdout  # it read the statistics over gRPC
