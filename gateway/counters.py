"""Statistics a gateway adds itself (a response-cache hit or miss, an ensemble request), into the same
Redis hash the workers count into (fleet/stats.py), written off the request path: a request never waits
for its statistics, and a failed write only loses a count."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.stats import LAST_INFERENCE, field

log = logging.getLogger(__name__)


class Counters:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._pending: set[asyncio.Task[None]] = set()

    def add(self, key: str, version: int, deltas: dict[str, int], last_inference: bool = True) -> None:
        """HINCRBY each delta into `version`'s fields of the stats hash `key` (and stamp last_inference)."""
        task = asyncio.ensure_future(self._write(key, version, deltas, last_inference))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, key: str, version: int, deltas: dict[str, int], last_inference: bool) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, value in deltas.items():
            pipe.hincrby(key, field(version, name), value)
        if last_inference:
            pipe.hset(key, field(version, LAST_INFERENCE), int(time.time() * 1000))
        try:
            await pipe.execute()
        except RedisError as exc:
            log.warning("cannot add to the statistics of %s: %s", key, exc)

    async def drain(self) -> None:
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=5)
