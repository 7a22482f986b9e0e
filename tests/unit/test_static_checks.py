"""House rules that tools check: ruff (lint, import order) and mypy --strict over the packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["fleet", "gateway", "workers", "batching"]


@pytest.mark.timeout(600)
def test_mypy_strict() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", *PACKAGES], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", *PACKAGES, "tests"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
