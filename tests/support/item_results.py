"""A backend result's output as an array, whichever form the backend gave it in (arrays, or wire bytes: a
framework backend's outputs of their declared type, workers/backends/base.py's `_wire_outputs`)."""

from __future__ import annotations

import numpy as np

from fleet import tensors
from workers.backends.base import ItemResult


def output_array(result: ItemResult, name: str) -> np.ndarray:
    if result.wire_outputs is not None:
        wire = result.wire_outputs[name]
        return tensors.from_bytes(wire.data, tensors.lookup(wire.datatype), wire.shape)
    assert result.outputs is not None, result.error
    return result.outputs[name]
