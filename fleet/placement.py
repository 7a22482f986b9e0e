"""Which workers serve a model: its `instance_group` kinds (and `gpus`) against a worker's device.

A worker runs on one device ("cpu", or "cuda:N"; `fleet up` starts one per GPU, or one CPU worker on a
host without GPUs). A CPU worker skips models whose groups are all KIND_GPU, saying why (the repository
index shows it as the model's reason). A GPU worker serves KIND_CPU models too (their instances run on
the CPU, as Triton runs KIND_CPU groups on a GPU host) and skips KIND_GPU-only models whose `gpus` all
name other GPUs. Triton's KIND_AUTO was already resolved to KIND_CPU (fleet/config_checks.py normalise:
the config is read on hosts without GPUs).
"""

from __future__ import annotations

from fleet.config_proto import model_config_pb2 as pb
from fleet.model_spec import ModelSpec

_KIND = pb.ModelInstanceGroup.Kind


def placement_problem(spec: ModelSpec, device: str) -> str | None:
    """Why a worker on `device` does not serve this model; None if it does."""
    groups = list(spec.proto.instance_group)
    if spec.ensemble or not groups:
        return None  # ensembles have no instances of their own
    kinds = {g.kind for g in groups}
    if device == "cpu":
        if kinds == {_KIND.KIND_GPU}:
            return "its instance groups are all KIND_GPU and this worker has no GPU"
        return None
    gpu = int(device.rsplit(":", 1)[1]) if ":" in device else 0
    if kinds != {_KIND.KIND_GPU}:
        return None
    gpu_groups = [g for g in groups if g.kind == _KIND.KIND_GPU]
    if all(g.gpus and gpu not in g.gpus for g in gpu_groups):
        named = sorted({d for g in gpu_groups for d in g.gpus})
        return f"its KIND_GPU instance groups name GPUs {named}, not this worker's GPU {gpu}"
    return None


def instance_device(spec: ModelSpec, device: str) -> str:
    """Where this worker runs the model's instances: its GPU only for a model with a KIND_GPU group."""
    if device == "cpu" or not any(g.kind == _KIND.KIND_GPU for g in spec.proto.instance_group):
        return "cpu"
    return device
