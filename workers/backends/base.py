"""The Backend seam: what a model instance is to the worker loop.

An instance executes a list of requests (the batch the policy formed) and returns exactly one result per
request, in order. Framework backends merge the list into batch tensors and split the outputs back;
the Python backend hands the list to `TritonPythonModel.execute` as Triton does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from batching.merge import merge, split
from fleet.envelope import WireTensor
from fleet.errors import InferenceFailed, ServingError
from fleet.model_config import ModelSpec


@dataclass(slots=True)
class InferenceItem:
    inputs: dict[str, np.ndarray]  # empty for backends that take wire tensors (takes_wire = True)
    requested_outputs: list[str] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    wire: list[WireTensor] = field(default_factory=list)  # the envelope's tensors, as received


@dataclass(slots=True)
class ItemResult:
    outputs: dict[str, np.ndarray] | None = None  # in the order the model produced them
    error: ServingError | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # Outputs already in wire form (the Python backend's stub encodes them): passed through as bytes.
    wire_outputs: dict[str, WireTensor] | None = None


@dataclass(frozen=True, slots=True)
class LoadContext:
    spec: ModelSpec
    model_dir: Path
    version: int
    instance_name: str
    device: str  # "cpu" or "cuda:N"
    # How often a request that crashes the instance when run alone is tried before it is poison.
    max_deliveries: int = 3


class Backend(Protocol):
    """`takes_wire` (class attribute, default False): the backend reads `InferenceItem.wire` instead of
    decoded arrays, so a process hop forwards the envelope's bytes without decoding and re-encoding."""

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]: ...

    def close(self) -> None: ...


def failed(items: list[InferenceItem], exc: BaseException) -> list[ItemResult]:
    """One error result per item: a failed batch fails only its own requests."""
    err = exc if isinstance(exc, ServingError) else InferenceFailed(f"{type(exc).__name__}: {exc}")
    return [ItemResult(error=err) for _ in items]


def int_parameter(spec: ModelSpec, key: str, default: int) -> int:
    try:
        return int(spec.parameters.get(key, default))
    except ValueError:
        return default


def run_merged(
    spec: ModelSpec, items: list[InferenceItem], run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
) -> list[ItemResult]:
    """Framework backends: one forward pass over the concatenated batch, outputs split per request."""
    try:
        if spec.max_batch_size > 0:
            rows = [next(iter(i.inputs.values())).shape[0] for i in items]
            outputs = run(merge([i.inputs for i in items]))
            return [ItemResult(outputs=o) for o in split(outputs, rows)]
        return [ItemResult(outputs=run(i.inputs)) for i in items]
    except Exception as exc:  # a bad batch fails its own requests, never the worker
        return failed(items, exc)
