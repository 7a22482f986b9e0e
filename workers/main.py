"""`fleet worker`: load the repository's models, serve their streams, heartbeat, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

from redis.exceptions import RedisError

from fleet.admission import lane_count
from fleet.cancellation import cancel_and_wait
from fleet.clock import SystemClock
from fleet.gc_tuning import freeze_after_startup
from fleet.keys import Keys
from fleet.logs import configure_logging
from fleet.placement import instance_device, placement_problem
from fleet.redis_clients import async_client, wait_for_redis
from fleet.redis_time import RedisClock
from fleet.repository import ModelEntry, scan
from fleet.settings import Settings
from fleet.settings_watch import follow_log_settings
from fleet.subscription import follow_channel
from workers.backends import load_backend
from workers.backends.base import LoadContext
from workers.consumer import StreamConsumer
from workers.custody import CustodyConfig
from workers.heartbeat import Heartbeat
from workers.instance import Instance
from workers.loop import LoopConfig, ModelLoop
from workers.warmup import warm_up

# Exit status of a worker that stopped because an instance hung in code it cannot interrupt (a native
# backend's thread): its supervisor (`fleet up`, compose's restart policy) starts a fresh one.
EXIT_HUNG = 70

log = logging.getLogger("workers")


def load_instances(entry: ModelEntry, device: str, max_deliveries: int = 3) -> dict[int, list[Instance]]:
    """Every selected version's instances; raises if any fails (the model is then not served here)."""
    out: dict[int, list[Instance]] = {}
    count = max(1, entry.spec.instance_count)
    try:
        for version in entry.versions:
            insts = []
            for i in range(count):
                name = f"{entry.name}_{i}"
                ctx = LoadContext(spec=entry.spec, model_dir=entry.path, version=version, instance_name=name,
                                  device=device, max_deliveries=max_deliveries)
                insts.append(Instance(name, load_backend(ctx), ThreadPoolExecutor(1, thread_name_prefix=name)))
                out.setdefault(version, []).append(insts[-1])
                # model_warmup: before the model is advertised; a failing sample fails the load.
                warm_up(entry.spec, entry.path, version, insts[-1].backend)
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


async def run_worker(settings: Settings, device: str, stop: asyncio.Event) -> int:
    """Serve until `stop` is set, then drain: answer everything held, ack, remove the heartbeat.
    Returns the exit status: 1 if a model's loop failed for good (a refused ACL, a bug that keeps
    killing one of its tasks), so a supervisor sees it. A missing Redis is never a reason to exit:
    every loop waits for it with backoff."""
    keys = Keys(settings.key_prefix)
    worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    url = settings.redis_url_or_default
    control = async_client(url)
    redis_clock = RedisClock()
    heartbeat = Heartbeat(control, keys, worker_id, device, settings.heartbeat_interval_s, settings.heartbeat_ttl_s,
                          redis_clock)
    repository = scan(list(settings.model_repositories))
    heartbeat.failed.update(repository.errors)
    try:
        await wait_for_redis(control, f"worker {worker_id}")
    except RedisError as exc:
        log.critical("worker %s cannot use Redis: %s", worker_id, exc)
        await control.aclose()
        return 1
    await heartbeat.sample_clock()
    beat_task = asyncio.create_task(heartbeat.run())
    # The logging extension's settings, as a gateway changes them (read now: they may have changed before).
    settings_task = asyncio.create_task(follow_log_settings(url, keys, settings))

    loops: list[ModelLoop] = []
    tasks: list[asyncio.Task[None]] = []
    by_name: dict[str, ModelLoop] = {}
    heartbeat.healthy = lambda name: name not in by_name or by_name[name].healthy
    heartbeat.queued = lambda: {name: loop.queued() for name, loop in by_name.items()}
    custody = CustodyConfig(claim_idle_ms=settings.claim_idle_ms, claim_min_ms=settings.claim_min_ms,
                            keepalive_s=settings.claim_keepalive_s, claim_interval_s=settings.claim_interval_s,
                            max_deliveries=settings.max_deliveries, dead_consumer_idle_s=settings.dead_consumer_idle_s)
    config = LoopConfig(block_ms=settings.block_ms, read_ahead_batches=settings.read_ahead_batches,
                        aging_us=settings.lane_aging_ms * 1000, watchdog_s=settings.watchdog_s, custody=custody,
                        bulk_share=settings.bulk_share_cpu if device == "cpu" else 1.0)

    failures: list[BaseException] = []

    def fail(what: str, exc: BaseException) -> None:
        if stop.is_set():
            return
        failures.append(exc)
        log.critical("%s failed for good: %r; the worker stops (exit status 1) for its supervisor", what, exc)
        stop.set()

    def on_loop_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            fail(task.get_name(), task.exception())  # type: ignore[arg-type]

    def beat_now() -> None:
        asyncio.ensure_future(heartbeat.beat_quietly())

    def exit_hung(instance: Instance) -> None:
        log.critical("worker %s exits: instance %s is hung in code that cannot be interrupted; "
                     "what this worker held is claimed by other workers", worker_id, instance.name)
        logging.shutdown()
        os._exit(EXIT_HUNG)

    for name, entry in sorted(repository.models.items()):
        if stop.is_set():
            break
        problem = placement_problem(entry.spec, device)
        if problem is not None:  # another worker's device fits it (fleet/placement.py)
            log.info("model '%s' is not served by this %s worker: %s", name, device, problem)
            heartbeat.failed[name] = f"not served by a {device} worker: {problem}"
            continue
        try:
            instances = await asyncio.to_thread(load_instances, entry, instance_device(entry.spec, device),
                                                settings.max_deliveries)
        except Exception as exc:
            log.error("model '%s' failed to load: %s", name, exc)
            heartbeat.failed[name] = str(exc)
            continue
        # Each model reads on its own connections (a pool): its readers block in XREADGROUP.
        client = async_client(url)
        consumer = StreamConsumer(client, keys, name, worker_id, lanes=lane_count(entry.spec), redis_clock=redis_clock)
        loop = ModelLoop(entry.spec, instances, consumer, SystemClock(), redis_clock, config,
                         on_hung=exit_hung, on_health=beat_now, on_give_up=fail,
                         live_workers=heartbeat.live_workers)
        loops.append(loop)
        by_name[name] = loop
        tasks.append(asyncio.create_task(loop.run(), name=f"model '{name}'"))
        tasks[-1].add_done_callback(on_loop_done)
        heartbeat.ready.extend((name, v) for v in instances)
        await heartbeat.beat_quietly()
        log.info("model '%s' ready: versions %s, %d instance(s) each", name, list(instances),
                 len(next(iter(instances.values()))))
    log.info("worker %s on %s serving %d models", worker_id, device, len(loops))
    cancel_task = asyncio.create_task(listen_for_cancellations(url, keys, by_name))
    freeze_after_startup()

    await stop.wait()
    log.info("worker %s stopping: draining", worker_id)
    heartbeat.ready.clear()
    await heartbeat.clear()
    await cancel_and_wait([beat_task, cancel_task, settings_task], f"worker {worker_id}")
    for loop in loops:
        loop.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    for loop in loops:
        close_instances(loop.instances)
        await loop.consumer.close()
    await control.aclose()
    log.info("worker %s stopped", worker_id)
    return 1 if failures else 0


async def listen_for_cancellations(url: str, keys: Keys, loops: dict[str, ModelLoop]) -> None:
    """Drop queued requests whose callers went away (gateway/broker.py publishes them): never computed.
    Best effort: a cancellation missed while reconnecting only costs a reply nobody reads."""

    async def cancel(data: object) -> None:
        try:
            model, request_id = json.loads(data)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return
        loop = loops.get(model) if isinstance(model, str) else None
        if loop is not None:
            loop.cancel({request_id})

    await follow_channel(url, keys.cancel(), "cancellation listener", cancel)


def serve(settings: Settings, device: str = "cpu") -> int:
    configure_logging(settings)
    import uvloop

    async def main() -> int:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        return await run_worker(settings, device, stop)

    return uvloop.run(main())
