"""A few links (fleet/redis_link.py) for one caller, so that a round trip goes out while another is on its
way instead of waiting for it: the gateway's enqueues (fleet/broker.py) and a worker's reply writes
(workers/consumer.py). Measured in bench/RESULTS.md, stop 51."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from fleet.redis_link import Command, RedisLink

__all__ = ["LinkPool"]


class LinkPool:
    """`size` links, so that up to `size` round trips are in flight at once, each on its own connection: a
    caller takes an idle one (the last given back first, so a light load keeps to one connection) and waits
    only while every link has a round trip. Round trips on different links reach Redis in any order."""

    def __init__(self, client: aioredis.Redis, size: int) -> None:
        self.links = [RedisLink(client) for _ in range(size)]
        self._idle = self.links[::-1]  # taken from the end
        self._waiting: deque[asyncio.Future[RedisLink]] = deque()  # handed a link as one is given back

    async def take(self) -> RedisLink:
        """An idle link, the caller's until it gives it back (`give`, in a `finally`). Waiters are served in
        the order they came: a link given back goes to the first, not to whoever asks next."""
        if self._idle:
            return self._idle.pop()
        waiter: asyncio.Future[RedisLink] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give(waiter.result())  # handed a link, then cancelled: it goes to the next
            raise

    def give(self, link: RedisLink) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # (a waiter cancelled meanwhile is skipped)
                waiter.set_result(link)
                return
        self._idle.append(link)

    async def execute(self, commands: Sequence[Command],
                      resend: Callable[[], Sequence[Command]] | None = None) -> list[Any]:
        """`RedisLink.execute` on an idle link."""
        link = await self.take()
        try:
            return await link.execute(commands, resend=resend)
        finally:
            self.give(link)

    async def aclose(self) -> None:
        for link in self.links:
            await link.aclose()
