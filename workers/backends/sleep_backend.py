"""`backend: "sleep"`: a model whose execution is time, not CPU (like a GPU seen from the host).

Each output is its input of the same position (names may differ; datatype and dims must match), and a
batch of n rows takes `execute_delay_us + n * execute_delay_per_item_us` microseconds of `time.sleep`,
which releases the GIL: the worker's own cost per batch is all that is left on the CPU. bench/scale.py
uses it to measure how throughput grows with workers (design.md's promise) on a machine whose cores
would otherwise be taken by the models. Triton's `identity` backend with `execute_delay_ms` is the same
idea.

    backend: "sleep"
    parameters { key: "execute_delay_us" value { string_value: "20000" } }
    parameters { key: "execute_delay_per_item_us" value { string_value: "1000" } }
"""

from __future__ import annotations

import time

import numpy as np

from fleet.errors import ConfigError
from fleet.model_spec import ModelSpec
from workers.backends.base import InferenceItem, InProcessBackend, ItemResult, LoadContext, run_merged


def delay_parameter(spec: ModelSpec, key: str) -> float:
    """A delay parameter in seconds; a missing one is 0, a bad one a ConfigError (a silent 0 would
    measure something else than what the config says)."""
    raw = spec.parameters.get(key, "0")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{spec.name}: parameter '{key}' must be a number of microseconds, got '{raw}'") from None
    if not value >= 0:
        raise ConfigError(f"{spec.name}: parameter '{key}' must not be negative, got '{raw}'")
    return value / 1e6


class SleepBackend(InProcessBackend):
    def __init__(self, ctx: LoadContext) -> None:
        spec = ctx.spec
        if len(spec.inputs) != len(spec.outputs):
            raise ConfigError(f"{spec.name}: the sleep backend maps each input to the output at the same "
                              f"position; the config has {len(spec.inputs)} inputs and {len(spec.outputs)} outputs")
        for i, o in zip(spec.inputs, spec.outputs, strict=True):
            if i.datatype != o.datatype or list(i.dims) != list(o.dims):
                raise ConfigError(f"{spec.name}: output '{o.name}' must have the datatype and dims of input "
                                  f"'{i.name}' (the sleep backend returns its input)")
        self._spec = spec
        self.host_bound = False  # time.sleep: the thread waits, as on a GPU
        self._pairs = [(i.name, o.name) for i, o in zip(spec.inputs, spec.outputs, strict=True)]
        self._base_s = delay_parameter(spec, "execute_delay_us")
        self._per_item_s = delay_parameter(spec, "execute_delay_per_item_us")

    def _run(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = next(iter(batch.values())).shape[0] if self._spec.max_batch_size > 0 and batch else 1
        time.sleep(self._base_s + rows * self._per_item_s)
        return {out: batch[inp] for inp, out in self._pairs}

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return run_merged(self._spec, items, self._run)

    def close(self) -> None:
        pass
