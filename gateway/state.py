"""Everything one gateway process holds: settings, catalog, broker, and the readiness refresher.

Readiness comes from the workers' heartbeats, found through the registry (`fleet:workers`, a sorted
set) rather than by scanning the keyspace. The refresher, like the broker's tasks, is supervised: a
task that keeps dying makes the gateway exit non-zero for its supervisor (`on_give_up`)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis
from redis.exceptions import RedisError

from fleet.broker import Broker
from fleet.cancellation import cancel_and_wait, raise_if_cancelled
from fleet.keys import Keys
from fleet.redis_clients import async_client
from fleet.repository import Repository
from fleet.settings import Settings
from gateway.catalog import Catalog
from gateway.counters import Counters
from gateway.dataplane import DataPlane, model_statistics
from gateway.ensembles import Ensembles
from gateway.jobs.service import jobs_context
from gateway.model_control import ModelControl
from gateway.response_cache import ResponseCache, parse_cache_config
from gateway.runtime_settings import RuntimeSettings
from gateway.sequences import SequenceRouter
from gateway.shared_memory import SharedMemoryRegistry
from gateway.tracer import Tracer

log = logging.getLogger(__name__)

HEARTBEAT_POLL_S = 0.5
REGISTRY_GRACE_MS = 60_000  # registry entries this far past their expiry are removed (clocks differ)


def exit_for_supervisor(what: str, exc: BaseException) -> None:
    log.critical("%s keeps failing (%r): the gateway exits (status 1) for its supervisor to restart it", what, exc)
    logging.shutdown()
    os._exit(1)


class GatewayState:
    def __init__(self, settings: Settings,
                 on_give_up: Callable[[str, BaseException], None] = exit_for_supervisor) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        url = settings.redis_url_or_default
        self.client = async_client(url)
        self.catalog = Catalog.from_repository(Repository(models={}, errors={}))
        self.control = ModelControl(settings, self.client, self.keys, self.catalog, self.read_heartbeats)
        repository = self.control.scan()
        for name, why in repository.errors.items():
            if name not in repository.dirs:
                log.error("model '%s' cannot be served: %s", name, why)
        self.catalog.set_targets(repository, self.control.targets(repository))
        gateway_id = settings.gateway_id or f"gw-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.broker = Broker(self.client, async_client(url), self.keys, gateway_id,
                             block_ms=settings.block_ms, request_timeout_s=settings.request_timeout_s,
                             outage_s=settings.redis_outage_s, on_give_up=on_give_up)
        # Shared-memory regions are this process's own, or its host's gateways' (gateway/shared_memory.py).
        self.shared_memory = SharedMemoryRegistry(settings.max_input_bytes, settings.shared_memory_dir)
        # Statistics this gateway adds itself (gateway/counters.py).
        self.counters = Counters(self.client, self.keys)
        self.cache = ResponseCache(self.client, settings.key_prefix, parse_cache_config(settings.cache_config),
                                   self.counters)
        self.ensembles = Ensembles(self.catalog, self.keys, self.counters)
        sequences = SequenceRouter(self.client, self.keys, self.catalog, settings.request_timeout_s)
        self.dataplane = DataPlane(self.catalog, self.broker, regions=self.shared_memory,
                                   max_in_flight=settings.max_in_flight, cache=self.cache, ensembles=self.ensembles,
                                   sequences=sequences)
        # Bulk jobs go through RQ, which is synchronous: their own (blocking) client, used off the loop.
        self.jobs = jobs_context(redis.Redis.from_url(url, protocol=2), settings)
        # The logging and trace extensions: settings followed from Redis, traces written by this process.
        self.tracer = Tracer(settings.trace_file, self.broker.redis_clock)
        self.runtime = RuntimeSettings(settings, self.client, self.keys, self.catalog, self.tracer)
        self._refresher: asyncio.Task[None] | None = None
        # Front ends that answer on their own (the gRPC server): each finishes what it accepted before
        # the broker stops, when the gateway stops.
        self.drains: list[Callable[[], Awaitable[None]]] = []

    async def start(self) -> None:
        """Start serving; Redis need not be up (readiness stays false until workers are seen)."""
        await self.broker.start()
        self.runtime.start(self.broker.supervisor)
        try:
            await self.control.seed()
            await self.refresh_readiness()
        except (RedisError, OSError) as exc:
            log.warning("cannot read worker heartbeats yet: %s", exc)
        self._refresher = self.broker.supervisor.start("readiness", self._refresh_loop)
        log.info("gateway %s serving %d models: %s", self.broker.gateway_id, len(self.catalog.views),
                 ", ".join(sorted(self.catalog.views)))

    async def stop(self) -> None:
        await asyncio.gather(*(drain() for drain in self.drains))
        if self._refresher:
            await cancel_and_wait([self._refresher], "readiness refresher")
        await self.runtime.stop()
        await self.cache.drain()
        await self.ensembles.drain()
        await self.counters.close()
        await self.broker.stop()
        self.jobs.client.close()

    async def statistics(self, name: str | None, version: str | None) -> dict[str, Any]:
        return await model_statistics(self.catalog, self.client, self.keys, name, version)

    async def refresh_readiness(self) -> None:
        """Follow model control's desired state and the workers' heartbeats (gateway/model_control.py)."""
        await self.read_heartbeats()
        await self.control.refresh()

    async def read_heartbeats(self) -> None:
        """Read every registered worker's heartbeat; an expired key means that worker is gone (and its
        registry entry is dropped once well past its expiry)."""
        registry = self.keys.workers()
        now_ms = int(time.time() * 1000)
        ids: list[bytes] = await self.client.zrangebyscore(registry, now_ms - REGISTRY_GRACE_MS, "+inf")  # type: ignore[assignment]
        pipe = self.client.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.keys.worker(worker_id.decode()))
        pipe.zremrangebyscore(registry, "-inf", now_ms - REGISTRY_GRACE_MS)
        beats = [b for b in (await pipe.execute())[:-1] if b]
        self.catalog.update_from_heartbeats(beats)

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        while True:
            await asyncio.sleep(HEARTBEAT_POLL_S)
            self.shared_memory.sweep()  # regions other gateways of this host unregistered: unmapped here too
            try:
                await self.refresh_readiness()
                failing_since = None
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                log.warning("cannot read worker heartbeats: %s", exc)
                # One failed read (a Redis restart) does not make every model unready: the heartbeats
                # read last stay valid for as long as their keys would have lived.
                failing_since = failing_since or loop.time()
                if loop.time() - failing_since > self.settings.heartbeat_ttl_s:
                    self.catalog.update_from_heartbeats([])
