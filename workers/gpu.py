"""Reading the host's GPUs through NVML for the heartbeat (fleet/gpu_metrics.py says what is published).

NVML comes from the optional `nvidia-ml-py` package (`pip install fleet[gpu]`), imported on first use:
without it, or without a driver or a GPU, the reader turns itself off after one try and the worker
publishes no GPU readings (the gateway then exports no GPU series). A figure a device does not support
(power on some boards, utilization under MIG) is left out, not the device.

Not verified on a GPU in this project's tests (none here): the conversion of NVML's results is
(tests/unit/test_gpu_metrics.py), the calls below are NVML's documented ones.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fleet.gpu_metrics import GpuReading, reading_from_nvml

log = logging.getLogger(__name__)

T = TypeVar("T")


class NvmlReader:
    def __init__(self) -> None:
        self._nvml: Any = None
        self.enabled = True  # False once NVML proved unusable here

    def _start(self) -> Any:
        if self._nvml is None:
            nvml: Any = importlib.import_module("pynvml")
            nvml.nvmlInit()
            self._nvml = nvml
        return self._nvml

    def read(self) -> list[GpuReading]:
        """Every GPU NVML lists; [] (and off for good) where NVML cannot run. Blocking: call it in a
        thread."""
        if not self.enabled:
            return []
        try:
            nvml = self._start()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            uuids = [nvml.nvmlDeviceGetUUID(h) for h in handles]
        except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError (no driver, no device), OSError
            self.enabled = False
            log.info("no GPU readings on this host (%s: %s)", type(exc).__name__, exc)
            return []
        error: type[BaseException] = getattr(nvml, "NVMLError", OSError)
        return [reading_from_nvml(uuid, _optional(error, nvml.nvmlDeviceGetUtilizationRates, h),
                                  _optional(error, nvml.nvmlDeviceGetMemoryInfo, h),
                                  _optional(error, nvml.nvmlDeviceGetPowerUsage, h))
                for uuid, h in zip(uuids, handles, strict=True)]


def _optional(error: type[BaseException], call: Callable[[Any], T], handle: Any) -> T | None:
    try:
        return call(handle)
    except error:
        return None
