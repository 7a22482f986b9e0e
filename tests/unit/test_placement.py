"""fleet/placement.py: which workers serve a model, by its instance groups and the worker's device."""

from __future__ import annotations

import pytest

from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from fleet.placement import instance_device, placement_problem


def spec(groups: str) -> ModelSpec:
    return parse_config(f"""
backend: "python"
max_batch_size: 4
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }} ]
{groups}
""", source="test", model_name="m")


CPU = 'instance_group [ { kind: KIND_CPU, count: 2 } ]'
GPU = 'instance_group [ { kind: KIND_GPU, count: 1 } ]'
GPU1 = 'instance_group [ { kind: KIND_GPU, count: 1, gpus: [ 1 ] } ]'
MIXED = 'instance_group [ { kind: KIND_GPU, count: 1, gpus: [ 1 ] }, { kind: KIND_CPU, count: 1 } ]'
AUTO = 'instance_group [ { count: 1 } ]'
MODEL = 'instance_group [ { kind: KIND_MODEL, count: 1 } ]'


@pytest.mark.parametrize(("groups", "device", "served", "runs_on"), [
    (CPU, "cpu", True, "cpu"),
    ("", "cpu", True, "cpu"),  # no group: Triton adds one (KIND_AUTO, here KIND_CPU)
    (AUTO, "cpu", True, "cpu"),
    (GPU, "cpu", False, None),
    (GPU1, "cpu", False, None),
    (MIXED, "cpu", True, "cpu"),
    (MODEL, "cpu", True, "cpu"),
    (CPU, "cuda:0", True, "cpu"),  # a GPU host runs KIND_CPU instances on its CPU
    (GPU, "cuda:3", True, "cuda:3"),
    (GPU1, "cuda:1", True, "cuda:1"),
    (GPU1, "cuda:0", False, None),
    (MIXED, "cuda:0", True, "cuda:0"),
    (MODEL, "cuda:0", True, "cpu"),
])
def test_a_worker_serves_what_its_device_fits(groups: str, device: str, served: bool, runs_on: str | None) -> None:
    s = spec(groups)
    problem = placement_problem(s, device)
    assert (problem is None) == served, problem
    if served:
        assert instance_device(s, device) == runs_on


def test_the_reason_says_what_the_model_needs() -> None:
    assert placement_problem(spec(GPU), "cpu") == \
        "its instance groups are all KIND_GPU and this worker has no GPU"
    assert placement_problem(spec(GPU1), "cuda:0") == \
        "its KIND_GPU instance groups name GPUs [1], not this worker's GPU 0"
