"""The sleep backend (workers/backends/sleep_backend.py): outputs are the inputs, and a batch of n rows takes
execute_delay_us + n * execute_delay_per_item_us, as wall time that leaves the CPU free."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from fleet.errors import ConfigError
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from tests.support.item_results import output_array
from workers.backends import load_backend
from workers.backends.base import InferenceItem, LoadContext


def sleep_spec(base_us: str = "20000", per_item_us: str = "5000", out_dims: str = "[ 4 ]") -> ModelSpec:
    return parse_config(
        'backend: "sleep"\nmax_batch_size: 8\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
        f'output [ {{ name: "OUT", data_type: TYPE_FP32, dims: {out_dims} }} ]\n'
        f'parameters {{ key: "execute_delay_us" value {{ string_value: "{base_us}" }} }}\n'
        f'parameters {{ key: "execute_delay_per_item_us" value {{ string_value: "{per_item_us}" }} }}',
        source="s", model_name="s")


def load(spec: ModelSpec) -> object:
    return load_backend(LoadContext(spec=spec, model_dir=Path("."), version=1, instance_name="s_0", device="cpu"))


def test_outputs_are_inputs_and_a_batch_takes_base_plus_per_row() -> None:
    backend = load(sleep_spec())
    items = [InferenceItem(inputs={"IN": np.full((rows, 4), rows, np.float32)}) for rows in (1, 3)]
    wall, cpu = time.perf_counter(), time.process_time()
    results = backend.execute(items)  # type: ignore[attr-defined]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert [output_array(r, "OUT").tolist() for r in results] == [[[1.0] * 4], [[3.0] * 4] * 3]
    assert 0.040 <= wall < 0.5  # 20 ms + 4 rows x 5 ms
    assert cpu < 0.02  # the delay is a sleep, not a spin


@pytest.mark.parametrize("kwargs, message", [
    ({"base_us": "fast"}, "parameter 'execute_delay_us' must be a number of microseconds"),
    ({"per_item_us": "-1"}, "parameter 'execute_delay_per_item_us' must not be negative"),
    ({"out_dims": "[ 5 ]"}, "output 'OUT' must have the datatype and dims of input 'IN'"),
])
def test_a_config_it_cannot_honour_fails_the_load(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(sleep_spec(**kwargs))
