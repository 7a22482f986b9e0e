"""`fleet worker`: serve the models model control says (workers/control.py), heartbeat, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import uuid

import redis
from redis.exceptions import RedisError

from fleet.cancellation import cancel_and_wait
from fleet.gc_tuning import freeze_after_startup
from fleet.keys import Keys
from fleet.logs import configure_logging
from fleet.redis_clients import async_client, wait_for_redis
from fleet.redis_time import RedisClock
from fleet.settings import Settings
from fleet.settings_watch import follow_log_settings
from fleet.subscription import follow_channel
from workers import gil
from workers.auto_complete import complete_config
from workers.bls import BlsService
from workers.control import ModelHost
from workers.custody import CustodyConfig
from workers.gpu import NvmlReader
from workers.heartbeat import Heartbeat
from workers.host_context import HostContext
from workers.instance import Instance
from workers.loop_config import LoopConfig
from workers.rate_limiter import RateLimiter, parse_resource_flags
from workers.replies import ReplyWriter
from workers.sequence_reaper import SequenceReaper

# Exit status of a worker that stopped because an instance hung in code it cannot interrupt (a native
# backend's thread): its supervisor (`fleet up`, compose's restart policy) starts a fresh one.
EXIT_HUNG = 70

log = logging.getLogger("workers")


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
                          redis_clock, gpus=NvmlReader())
    try:
        await wait_for_redis(control, f"worker {worker_id}")
    except RedisError as exc:
        log.critical("worker %s cannot use Redis: %s", worker_id, exc)
        await control.aclose()
        return 1
    await heartbeat.sample_clock()
    # The logging extension's settings, as a gateway changes them (read now: they may have changed before).
    settings_task = asyncio.create_task(follow_log_settings(url, keys, settings))
    custody = CustodyConfig(claim_idle_ms=settings.claim_idle_ms, claim_min_ms=settings.claim_min_ms,
                            keepalive_s=settings.claim_keepalive_s, claim_interval_s=settings.claim_interval_s,
                            max_deliveries=settings.max_deliveries, dead_consumer_idle_s=settings.dead_consumer_idle_s)
    config = LoopConfig(block_ms=settings.block_ms, read_ahead_batches=settings.read_ahead_batches,
                        aging_us=settings.lane_aging_ms * 1000, watchdog_s=settings.watchdog_s,
                        inline_max_us=settings.inline_max_us, custody=custody,
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

    completer = complete_config if settings.auto_complete_config else None
    limiter = None
    if settings.rate_limit == "execution_count":
        limiter = RateLimiter(parse_resource_flags(settings.rate_limit_resources, device),
                              redis.Redis.from_url(url, protocol=2), settings.key_prefix, worker_id)
    replies = ReplyWriter(url, keys, worker_id)  # decoupled models' responses before their last; custom metrics
    # Python models' calls to other models; nested instances for cyclic calls come from what the host loaded.
    bls = BlsService(settings, keys, control, worker_id, asyncio.get_running_loop(),
                     lambda model, version: host.load_context(model, version))
    host = ModelHost(settings, HostContext(keys, worker_id, device, control, redis_clock, config, exit_hung, fail,
                                           on_loop_done, beat_now, heartbeat.live_workers, limiter,
                                           heartbeat.serves_elsewhere, bls, replies.emit, replies),
                      completer)
    heartbeat.report = host.report
    beat_task = asyncio.create_task(heartbeat.run())
    await host.seed()
    # The first reconcile loads what the worker serves from the start; later ones follow model control.
    await host.reconcile_once()
    host_task = asyncio.create_task(host.run(), name="model control")
    host_task.add_done_callback(on_loop_done)
    cancel_task = asyncio.create_task(listen_for_cancellations(url, keys, host))
    # What dead workers' sequence streams hold is answered by a live one (nobody else reads them).
    reaper = SequenceReaper(control, keys, worker_id, host.sequence_units, settings.claim_interval_s)
    reaper_task = asyncio.create_task(reaper.run(), name="sequence reaper")
    control_task = asyncio.create_task(follow_channel(url, keys.control(), "model control listener",
                                                      lambda _: _nudge(host)))
    log.info("worker %s on %s started (model control: %s)", worker_id, device, settings.model_control_mode)
    freeze_after_startup()

    await stop.wait()
    log.info("worker %s stopping: draining", worker_id)
    heartbeat.report = Heartbeat.report_nothing
    await heartbeat.clear()
    await cancel_and_wait([host_task, beat_task, cancel_task, control_task, settings_task, reaper_task],
                          f"worker {worker_id}")
    await host.stop()
    await bls.stop()
    replies.close()
    if limiter is not None:
        limiter.close()
    await control.aclose()
    log.info("worker %s stopped", worker_id)
    return 1 if failures else 0


async def _nudge(host: ModelHost) -> None:
    host.nudge()


async def listen_for_cancellations(url: str, keys: Keys, host: ModelHost) -> None:
    """Drop queued requests whose callers went away (fleet/broker.py publishes them): never computed.
    Best effort: a cancellation missed while reconnecting only costs a reply nobody reads."""

    async def cancel(data: object) -> None:
        try:
            model, request_id = json.loads(data)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return
        if isinstance(model, str):
            for loop in host.loops_of(model):
                loop.cancel({request_id})
                # One running on a decoupled model: the model sees request.is_cancelled().
                for instances in loop.instances.values():
                    for instance in instances:
                        cancel_running = getattr(instance.backend, "cancel_requests", None)
                        if cancel_running is not None:
                            cancel_running([request_id])

    await follow_channel(url, keys.cancel(), "cancellation listener", cancel)


def serve(settings: Settings, device: str = "cpu") -> int:
    configure_logging(settings, "worker")
    gil.serving()
    import uvloop

    async def main() -> int:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        return await run_worker(settings, device, stop)

    return uvloop.run(main())
