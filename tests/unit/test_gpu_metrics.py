"""GPU readings (fleet/gpu_metrics.py, workers/gpu.py) from fake NVML results to Triton's samples. No GPU
here: the real NVML calls are not exercised (unverified on a GPU)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from fleet.gpu_metrics import GpuReading, decode_readings, encode_readings, gpu_samples, reading_from_nvml
from gateway.metric_families import gpu_families
from workers.gpu import NvmlReader

UUID = "GPU-8a7c3b1e-0000-1111-2222-333344445555"


def test_nvml_results_become_triton_units() -> None:
    r = reading_from_nvml(UUID.encode(), SimpleNamespace(gpu=37, memory=12),
                          SimpleNamespace(total=80 * 2**30, used=5 * 2**30, free=75 * 2**30), 123_456)
    assert r == GpuReading(UUID, 0.37, 80 * 2**30, 5 * 2**30, 123.456)
    assert gpu_samples([r]) == [("nv_gpu_utilization", UUID, 0.37),
                                ("nv_gpu_memory_total_bytes", UUID, float(80 * 2**30)),
                                ("nv_gpu_memory_used_bytes", UUID, float(5 * 2**30)),
                                ("nv_gpu_power_usage", UUID, 123.456)]


def test_a_figure_nvml_cannot_give_has_no_sample_and_one_reading_per_uuid_is_kept() -> None:
    old = GpuReading("GPU-b", 0.1, 10, 1, None)
    new = GpuReading("GPU-b", 0.2, 10, 2, None)
    other = reading_from_nvml("GPU-a", None, SimpleNamespace(total=4, used=3), 50_000)
    assert gpu_samples([old, other, new]) == [
        ("nv_gpu_utilization", "GPU-b", 0.2),
        ("nv_gpu_memory_total_bytes", "GPU-a", 4.0), ("nv_gpu_memory_total_bytes", "GPU-b", 10.0),
        ("nv_gpu_memory_used_bytes", "GPU-a", 3.0), ("nv_gpu_memory_used_bytes", "GPU-b", 2.0),
        ("nv_gpu_power_usage", "GPU-a", 50.0)]


def test_readings_cross_the_heartbeat_and_damage_gives_none() -> None:
    readings = [GpuReading(UUID, 0.5, 100, 40, 250.0), GpuReading("GPU-x")]
    assert decode_readings(encode_readings(readings).encode()) == readings
    assert decode_readings(None) == decode_readings(b"") == decode_readings(b"{not json") == []
    assert decode_readings(b'[{"uuid": 3}, "x", {"uuid": "GPU-y", "power_w": "hot"}]') == [GpuReading("GPU-y")]


class _Families(Collector):
    def __init__(self, readings: list[GpuReading]) -> None:
        self.readings = readings

    def collect(self):  # type: ignore[no-untyped-def]
        yield from gpu_families(self.readings)


def render(readings: list[GpuReading]) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(readings))
    text = generate_latest(registry).decode()
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_gateway_exports_tritons_gpu_gauges_and_nothing_without_a_gpu() -> None:
    families = render([GpuReading(UUID, 0.25, 1000, 600, 300.5)])
    assert families == {
        "nv_gpu_utilization": [({"gpu_uuid": UUID}, 0.25)],
        "nv_gpu_memory_total_bytes": [({"gpu_uuid": UUID}, 1000.0)],
        "nv_gpu_memory_used_bytes": [({"gpu_uuid": UUID}, 600.0)],
        "nv_gpu_power_usage": [({"gpu_uuid": UUID}, 300.5)],
    }
    assert render([]) == {}


class _NVMLError(Exception):
    pass


def fake_pynvml(uuids: list[str], power_fails: bool = False, init_fails: bool = False) -> types.ModuleType:
    """A stand-in for the `pynvml` module (nvidia-ml-py) with the calls workers/gpu.py makes."""
    module = types.ModuleType("pynvml")

    def init() -> None:
        if init_fails:
            raise _NVMLError("Driver Not Loaded")

    def power(handle: int) -> int:
        if power_fails:
            raise _NVMLError("Not Supported")
        return 70_000 + handle

    module.NVMLError = _NVMLError  # type: ignore[attr-defined]
    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(uuids)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: uuids[h].encode()  # type: ignore[attr-defined]
    module.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=10 * (h + 1), memory=0)  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=100, used=h)  # type: ignore[attr-defined]
    module.nvmlDeviceGetPowerUsage = power  # type: ignore[attr-defined]
    return module


def test_the_reader_reads_every_device_and_leaves_out_what_one_does_not_support(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(["GPU-0", "GPU-1"], power_fails=True))
    reader = NvmlReader()
    assert reader.read() == [GpuReading("GPU-0", 0.1, 100, 0, None), GpuReading("GPU-1", 0.2, 100, 1, None)]
    assert reader.enabled


def test_the_reader_turns_itself_off_without_nvml_or_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(["GPU-0"], init_fails=True))
    reader = NvmlReader()
    assert reader.read() == [] and not reader.enabled
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: package not installed
    reader = NvmlReader()
    assert reader.read() == [] and not reader.enabled
