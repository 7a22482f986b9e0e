"""Builds one-model repositories around the timed model (tests/support/timed_model.py), with the
batching, queue policy and instance count a test wants, and reads its answers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMED = Path(__file__).with_name("timed_model.py")


def timed_repository(root: Path, name: str, *, max_batch_size: int = 4, dynamic_batching: str | None = "",
                     instances: int = 1) -> Path:
    """A repository at root/<name>-repo holding `name`: IN (FP32 [-1], first element = sleep in ms) ->
    OUT = IN, PID, START_NS, END_NS, POSITION (INT64 [1]). `dynamic_batching` None: no dynamic batcher."""
    repo = root / f"{name}-repo"
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(TIMED, repo / name / "1" / "model.py")
    scalars = " ".join(f'{{ name: "{n}", data_type: TYPE_INT64, dims: [ 1 ] }},'
                       for n in ("PID", "START_NS", "END_NS", "POSITION")).rstrip(",")
    batcher = "" if dynamic_batching is None else f"dynamic_batching {{ {dynamic_batching} }}"
    (repo / name / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }}, {scalars} ]
{batcher}
instance_group [ {{ kind: KIND_CPU, count: {instances} }} ]
""")
    return repo


def timed_request(sleep_ms: float, *, batched: bool = True, width: int = 1, **parameters: Any) -> dict[str, Any]:
    """A JSON infer body for the timed model; `sleep_ms` also tells the requests apart in the answers.
    `width`: elements of IN (requests of different widths never share a batch)."""
    shape = [1, width] if batched else [width]
    data = [sleep_ms] + [0.0] * (width - 1)
    body: dict[str, Any] = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": shape, "data": data}]}
    if parameters:
        body["parameters"] = parameters
    return body


@dataclass(frozen=True)
class Execution:
    """Where and when the timed model ran one request."""

    value: float
    pid: int
    start_ns: int
    end_ns: int
    position: int

    @property
    def order(self) -> tuple[int, int]:
        """Service order: executions by start time, then the request's place within its execution."""
        return (self.start_ns, self.position)

    @classmethod
    def of(cls, response_json: dict[str, Any]) -> Execution:
        out = {o["name"]: o["data"] for o in response_json["outputs"]}
        return cls(float(out["OUT"][0]), int(out["PID"][0]), int(out["START_NS"][0]), int(out["END_NS"][0]),
                   int(out["POSITION"][0]))
