"""Builds one-model repositories around the sleeper model, with the queue policy a test wants."""

from __future__ import annotations

import shutil
from pathlib import Path

SLEEPER = Path(__file__).with_name("sleeper_model.py")


def sleeper_repository(root: Path, name: str, *, sleep_ms: int, dynamic_batching: str,
                       max_batch_size: int = 1, instances: int = 1) -> Path:
    """A repository at root/<name>-repo holding `name`: IN -> OUT (FP32 [-1]) after sleep_ms."""
    repo = root / f"{name}-repo"
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(SLEEPER, repo / name / "1" / "model.py")
    (repo / name / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }} ]
dynamic_batching {{ {dynamic_batching} }}
instance_group [ {{ kind: KIND_CPU, count: {instances} }} ]
parameters {{ key: "SLEEP_MS" value: {{ string_value: "{sleep_ms}" }} }}
""")
    return repo
