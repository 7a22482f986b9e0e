"""Loading and closing one model version's instances (backends, warmup), off the event loop."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleet.llm_spec import is_llm, llm_settings
from fleet.repository import ModelEntry
from workers.backends import load_backend
from workers.backends.base import BlsHandler, LoadContext, ModelWrites
from workers.backends.decoupled import Emit
from workers.instance import Instance
from workers.rate_limiter import RateLimiter
from workers.warmup import warm_up


def load_version(entry: ModelEntry, version: int, device: str, max_deliveries: int = 3,
                 limiter: RateLimiter | None = None, bls: BlsHandler | None = None,
                 emit: Emit | None = None, writes: ModelWrites | None = None,
                 worker_id: str = "") -> list[Instance]:
    """The version's instances, each warmed up (model_warmup: before the version is advertised; a
    failing sample fails the load); raises if any fails, after closing those already made. With a
    `limiter` (--rate-limit execution_count), each instance executes under its group's rate_limiter."""
    out: list[Instance] = []
    limits = entry.spec.instance_limits
    if limiter is not None:
        limiter.register(limits)
    # A generative model's instances are the engine's slots (workers/backends/llm.py), one engine for all.
    count = llm_settings(entry.spec).max_sequences if is_llm(entry.spec) else entry.spec.instance_count
    siblings: dict[str, Any] = {}
    try:
        for i in range(max(1, count)):
            name = f"{entry.name}_{i}"
            ctx = LoadContext(spec=entry.spec.model_facing(), model_dir=entry.path, version=version, instance_name=name,
                              device=device, max_deliveries=max_deliveries, bls=bls, emit=emit,
                              writes=writes, worker_id=worker_id, siblings=siblings)
            limit = limits[i] if limiter is not None and i < len(limits) and limits[i].resources else None
            out.append(Instance(name, load_backend(ctx), ThreadPoolExecutor(1, thread_name_prefix=name),
                                limit=limit, limiter=limiter if limit is not None else None))
            warm_up(entry.spec, entry.path, version, out[-1].backend)
    except Exception:
        close_instances({version: out})
        raise
    return out


def close_instances(instances: dict[int, list[Instance]]) -> None:
    for insts in instances.values():
        for inst in insts:
            try:
                inst.backend.close()
            finally:
                inst.executor.shutdown(wait=False)
