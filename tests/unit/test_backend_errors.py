"""Framework backends (workers.backends.base.run_merged): a failed pass fails only the request at fault,
and a backend's own verdict that the data is wrong (a ServingError such as InvalidInput) reaches that
request as it is, while anything else becomes InferenceFailed."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.errors import ErrorCode, InvalidInput
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from tests.support.item_results import output_array
from workers.backends.base import InferenceItem, run_merged


def spec(max_batch_size: int) -> ModelSpec:
    return parse_config(f'platform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
                        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]', source="m", model_name="m")


def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = batch["X"]
    if (x < 0).any():
        raise InvalidInput("negative values are refused")
    if (x > 100).any():
        raise RuntimeError("the framework broke")
    return {"Y": x * 2}


@pytest.mark.parametrize("max_batch_size", [8, 0])
def test_only_the_request_at_fault_gets_the_error(max_batch_size: int) -> None:
    shape = (1, 1) if max_batch_size else (1,)
    items = [InferenceItem(inputs={"X": np.full(shape, v, np.float32)}) for v in (1.0, -1.0, 2.0, 500.0, 3.0)]
    results = run_merged(spec(max_batch_size), items, run)
    assert [output_array(r, "Y").item() if r.error is None else None for r in results] == [2.0, None, 4.0, None, 6.0]
    assert results[1].error is not None and results[1].error.code is ErrorCode.INVALID_ARG
    assert results[1].error.message == "negative values are refused"
    assert results[3].error is not None and results[3].error.code is ErrorCode.INTERNAL
    assert results[3].error.message == "RuntimeError: the framework broke"
