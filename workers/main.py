"""`fleet worker`: load the repository's models, serve their streams, heartbeat, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import redis.asyncio as aioredis

from fleet.admission import lane_count
from fleet.clock import SystemClock
from fleet.gc_tuning import freeze_after_startup
from fleet.keys import Keys
from fleet.logs import configure_logging
from fleet.repository import ModelEntry, scan
from fleet.settings import Settings
from workers.backends import load_backend
from workers.backends.base import LoadContext
from workers.consumer import StreamConsumer
from workers.heartbeat import Heartbeat
from workers.instance import Instance
from workers.loop import ModelLoop

log = logging.getLogger("workers")


def load_instances(entry: ModelEntry, device: str) -> dict[int, list[Instance]]:
    """Every selected version's instances; raises if any fails (the model is then not served here)."""
    out: dict[int, list[Instance]] = {}
    count = max(1, entry.spec.instance_count)
    try:
        for version in entry.versions:
            insts = []
            for i in range(count):
                name = f"{entry.name}_{i}"
                ctx = LoadContext(spec=entry.spec, model_dir=entry.path, version=version, instance_name=name,
                                  device=device)
                insts.append(Instance(name, load_backend(ctx), ThreadPoolExecutor(1, thread_name_prefix=name)))
                out.setdefault(version, []).append(insts[-1])
    except Exception:
        close_instances(out)
        raise
    return out


def close_instances(instances: dict[int, list[Instance]]) -> None:
    for insts in instances.values():
        for inst in insts:
            try:
                inst.backend.close()
            finally:
                inst.executor.shutdown(wait=False)


async def run_worker(settings: Settings, device: str, stop: asyncio.Event) -> None:
    """Serve until `stop` is set, then drain: answer everything held, ack, remove the heartbeat."""
    keys = Keys(settings.key_prefix)
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    url = settings.redis_url_or_default
    control = aioredis.Redis.from_url(url, protocol=2)
    heartbeat = Heartbeat(control, keys, worker_id, device, settings.heartbeat_interval_s, settings.heartbeat_ttl_s)
    repository = scan(list(settings.model_repositories))
    heartbeat.failed.update(repository.errors)
    beat_task = asyncio.create_task(heartbeat.run())

    loops: list[ModelLoop] = []
    tasks: list[asyncio.Task[None]] = []
    for name, entry in sorted(repository.models.items()):
        if stop.is_set():
            break
        try:
            instances = await asyncio.to_thread(load_instances, entry, device)
        except Exception as exc:
            log.error("model '%s' failed to load: %s", name, exc)
            heartbeat.failed[name] = str(exc)
            continue
        # Each model reads on its own connections (a pool): its two readers block in XREADGROUP.
        client = aioredis.Redis.from_url(url, protocol=2)
        consumer = StreamConsumer(client, keys, name, worker_id, lanes=lane_count(entry.spec))
        loop = ModelLoop(entry.spec, instances, consumer, SystemClock(),
                         block_ms=settings.block_ms, read_ahead_batches=settings.read_ahead_batches,
                         claim_idle_ms=settings.claim_idle_ms, claim_interval_s=settings.claim_interval_s,
                         max_deliveries=settings.max_deliveries, aging_us=settings.lane_aging_ms * 1000,
                         bulk_share=settings.bulk_share_cpu if device == "cpu" else 1.0)
        loops.append(loop)
        tasks.append(asyncio.create_task(loop.run(), name=f"model-{name}"))
        heartbeat.ready.extend((name, v) for v in instances)
        await heartbeat.beat()
        log.info("model '%s' ready: versions %s, %d instance(s) each", name, list(instances),
                 len(next(iter(instances.values()))))
    log.info("worker %s on %s serving %d models", worker_id, device, len(loops))
    freeze_after_startup()

    await stop.wait()
    log.info("worker %s stopping: draining", worker_id)
    heartbeat.ready.clear()
    await heartbeat.clear()
    beat_task.cancel()
    for loop in loops:
        loop.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    for loop in loops:
        close_instances(loop.instances)
        await loop.consumer.close()
    await control.aclose()
    log.info("worker %s stopped", worker_id)


def serve(settings: Settings, device: str = "cpu") -> int:
    configure_logging(settings)
    import uvloop

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await run_worker(settings, device, stop)

    uvloop.run(main())
    return 0
