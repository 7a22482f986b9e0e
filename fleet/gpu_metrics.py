"""GPU readings as workers publish them in their heartbeats and the gateway exports them, under Triton's
metric names (`nv_gpu_utilization`, `nv_gpu_memory_total_bytes`, `nv_gpu_memory_used_bytes`,
`nv_gpu_power_usage`, label `gpu_uuid`). Pure: workers/gpu.py does the NVML calls and hands their
results to `reading_from_nvml`; a host without a GPU publishes nothing, and then no series exist.

A GPU can be seen by several workers (one per device on a host, each seeing every GPU NVML lists), so
the gateway keeps one reading per UUID."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

GPU_METRICS = (
    # (name, help, GpuReading attribute)
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "utilization"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "memory_total_bytes"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "memory_used_bytes"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "power_w"),
)


class UtilizationRates(Protocol):
    gpu: int  # percent of the last sample period a kernel ran (nvmlDeviceGetUtilizationRates)


class MemoryInfo(Protocol):
    total: int  # bytes (nvmlDeviceGetMemoryInfo)
    used: int


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one moment; a figure NVML could not give (not supported: MIG, some boards) is None."""

    uuid: str
    utilization: float | None = None  # 0..1
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    power_w: float | None = None


def reading_from_nvml(uuid: str | bytes, utilization: UtilizationRates | None, memory: MemoryInfo | None,
                      power_mw: int | None) -> GpuReading:
    """A reading from what NVML returned for one device (older bindings return the UUID as bytes)."""
    return GpuReading(
        uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
        utilization=None if utilization is None else utilization.gpu / 100,
        memory_total_bytes=None if memory is None else int(memory.total),
        memory_used_bytes=None if memory is None else int(memory.used),
        power_w=None if power_mw is None else power_mw / 1000,
    )


def encode_readings(readings: Iterable[GpuReading]) -> str:
    """The heartbeat's `gpus` field."""
    return json.dumps([asdict(r) for r in readings], separators=(",", ":"))


def decode_readings(raw: bytes | str | None) -> list[GpuReading]:
    """The readings of a heartbeat's `gpus` field; a missing or damaged field gives none."""
    if not raw:
        return []
    try:
        doc: Any = json.loads(raw)
    except ValueError:
        return []
    out = []
    for item in doc if isinstance(doc, list) else []:
        if isinstance(item, dict) and isinstance(item.get("uuid"), str):
            out.append(GpuReading(item["uuid"], *(_number(item.get(k)) for k in (
                "utilization", "memory_total_bytes", "memory_used_bytes", "power_w"))))  # type: ignore[arg-type]
    return out


def _number(value: object) -> float | int | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def gpu_samples(readings: Iterable[GpuReading]) -> list[tuple[str, str, float]]:
    """(metric name, gpu_uuid, value) for every figure of every GPU, one reading per UUID (the last),
    in metric then UUID order."""
    by_uuid = {r.uuid: r for r in readings}
    out = []
    for name, _, attr in GPU_METRICS:
        for uuid in sorted(by_uuid):
            value = getattr(by_uuid[uuid], attr)
            if value is not None:
                out.append((name, uuid, float(value)))
    return out
