"""The worker's heartbeat: `fleet:worker:<id>` (hash + TTL) says which (model, version) pairs it serves.

Gateways read these to answer readiness; a worker that dies stops refreshing and its key expires."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.keys import Keys

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, client: aioredis.Redis, keys: Keys, worker_id: str, device: str,
                 interval_s: float, ttl_s: float) -> None:
        self._client = client
        self.key = keys.worker(worker_id)
        self._device = device
        self._interval_s = interval_s
        self._ttl_ms = int(ttl_s * 1000)
        self.ready: list[tuple[str, int]] = []
        self.failed: dict[str, str] = {}
        # A loaded model is advertised only while this says so (its instances are not hung).
        self.healthy: Callable[[str], bool] = lambda name: True

    async def beat(self) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self.key, mapping={
            "models": json.dumps([m for m in self.ready if self.healthy(m[0])]),
            "failed": json.dumps(self.failed),
            "device": self._device,
            "pid": str(os.getpid()),
        })
        pipe.pexpire(self.key, self._ttl_ms)
        await pipe.execute()

    async def beat_quietly(self) -> None:
        try:
            await self.beat()
        except (RedisError, OSError) as exc:
            log.warning("heartbeat failed: %s", exc)

    async def run(self) -> None:
        while True:
            try:
                await self.beat()
            except (RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self._interval_s)

    async def clear(self) -> None:
        try:
            await self._client.delete(self.key)
        except (RedisError, OSError):
            pass
