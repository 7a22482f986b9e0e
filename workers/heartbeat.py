"""The worker's heartbeat: `fleet:worker:<id>` (hash + TTL) says which model versions it serves, loads
and unloads (each with its generation), which failed to load here and why, and how many requests it
has queued per version (the fields come from workers/control.py's `report`); `fleet:workers` (sorted
set, scored by expiry) lists the workers, so gateways read the heartbeats without scanning the
keyspace. A worker that dies stops refreshing and its key expires; the gateways' reads drop it from the
registry.

Each beat also samples Redis's clock (fleet/redis_time.py), which the worker's deadlines are read in,
and, given a GPU reader (workers/gpu.py), publishes the host's GPU readings (`gpus`,
fleet/gpu_metrics.py) that the gateways export.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.cancellation import raise_if_cancelled
from fleet.gpu_metrics import encode_readings
from fleet.keys import Keys
from fleet.redis_time import RedisClock
from workers.gpu import NvmlReader

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, client: aioredis.Redis, keys: Keys, worker_id: str, device: str,
                 interval_s: float, ttl_s: float, redis_clock: RedisClock | None = None,
                 gpus: NvmlReader | None = None) -> None:
        self._client = client
        self._keys = keys
        self.worker_id = worker_id
        self.key = keys.worker(worker_id)
        self._device = device
        self._interval_s = interval_s
        self._ttl_ms = int(ttl_s * 1000)
        self.redis_clock = redis_clock or RedisClock()
        self._calibrated = False  # the first sample_clock takes a burst
        self._gpus = gpus
        # The model fields of the hash (`models`, `units`, `failed`, `queued`, ...), as JSON strings.
        self.report: Callable[[], dict[str, str]] = Heartbeat.report_nothing

    @staticmethod
    def report_nothing() -> dict[str, str]:
        return {"models": "[]", "units": "[]", "failed": "{}", "queued": "{}"}

    async def beat(self) -> None:
        pipe = self._client.pipeline(transaction=False)
        # host and at_ms (when this beat was sent) are for people (gateway/status_routes.py), not routing.
        fields = {**self.report(), "device": self._device, "pid": str(os.getpid()), "id": self.worker_id,
                  "host": socket.gethostname(), "at_ms": str(int(time.time() * 1000))}
        if self._gpus is not None and self._gpus.enabled:
            fields["gpus"] = encode_readings(await asyncio.to_thread(self._gpus.read))
        pipe.hset(self.key, mapping=fields)  # type: ignore[arg-type]
        pipe.pexpire(self.key, self._ttl_ms)
        pipe.zadd(self._keys.workers(), {self.worker_id: int(time.time() * 1000) + self._ttl_ms})
        await pipe.execute()

    async def beat_quietly(self) -> None:
        try:
            await self.beat()
        except (RedisError, OSError) as exc:
            raise_if_cancelled()
            log.warning("heartbeat failed: %s", exc)

    async def sample_clock(self) -> None:
        """A burst of samples the first time (fleet/redis_time.py calibrate), then one per beat."""
        try:
            if self._calibrated:
                await self.redis_clock.sample(self._client)
            else:
                await self.redis_clock.calibrate(self._client)
                self._calibrated = True
        except (RedisError, OSError) as exc:
            raise_if_cancelled()
            log.debug("cannot sample Redis's clock: %s", exc)

    async def run(self) -> None:
        while True:
            await self.beat_quietly()
            await self.sample_clock()
            await asyncio.sleep(self._interval_s)

    async def clear(self) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(self.key)
            pipe.zrem(self._keys.workers(), self.worker_id)
            await pipe.execute()
        except (RedisError, OSError):
            pass

    async def serves_elsewhere(self, model: str, version: int) -> bool:
        """Whether another live worker's heartbeat advertises (model, version) ready."""
        others = await self.live_workers() - {self.worker_id}
        if not others:
            return False
        pipe = self._client.pipeline(transaction=False)
        for worker_id in sorted(others):
            pipe.hget(self._keys.worker(worker_id), "models")
        for raw in await pipe.execute():
            if raw and any(item[0] == model and int(item[1]) == version for item in json.loads(raw)):
                return True
        return False

    async def live_workers(self) -> set[str]:
        """Ids of workers whose heartbeat was refreshed within the last minute (generous: clocks differ)."""
        ids = await self._client.zrangebyscore(self._keys.workers(), int(time.time() * 1000) - 60_000, "+inf")
        return {i.decode() if isinstance(i, bytes) else str(i) for i in ids}
