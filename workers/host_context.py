"""What a worker gives each of its model hosts (workers/control.py) besides settings: its identity, its
connections and clocks, and the callbacks through which a host's model loops report to the worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from fleet.keys import Keys
from fleet.redis_time import RedisClock
from workers.backends.base import BlsHandler, ModelWrites
from workers.backends.decoupled import Emit
from workers.custody import LiveWorkers
from workers.inline import Neighbours
from workers.loop_config import LoopConfig
from workers.rate_limiter import RateLimiter
from workers.watchdog import HungHandler


async def _unknown() -> bool:
    return True


@dataclass(frozen=True, slots=True)
class HostContext:
    """What a host needs from its worker besides settings."""

    keys: Keys
    worker_id: str
    device: str
    client: aioredis.Redis  # the worker's control connection
    redis_clock: RedisClock
    loop_config: LoopConfig
    on_hung: HungHandler
    on_give_up: Callable[[str, BaseException], None]
    on_loop_done: Callable[[asyncio.Task[None]], None]
    beat_now: Callable[[], None]
    live_workers: LiveWorkers
    limiter: RateLimiter | None = None  # --rate-limit execution_count (workers/rate_limiter.py)
    # Whether a live worker other than this one serves (model, version): read from the heartbeats.
    serves_elsewhere: Callable[[str, int], Awaitable[bool]] = field(default=lambda m, v: _unknown())
    bls: BlsHandler | None = None  # Python models' calls to other models (workers/bls.py)
    emit: Emit | None = None  # a decoupled model's responses as they come (workers/replies.py)
    writes: ModelWrites | None = None  # generation engines' responses and metrics (workers/replies.py)
    # The model loops on this worker's event loop: the loop computes a batch itself only where no other
    # holds requests (workers/inline.py).
    neighbours: Neighbours = field(default_factory=Neighbours)
