"""Redis's clock as the one time base every process shares.

Times that cross processes (a request's enqueue time, its queue deadline, when its caller stops
waiting) are written in Redis's time, not in the writer's: a gateway and a worker on two machines whose
clocks differ by a few ms would otherwise see deadlines move and queue delays shrink or grow by that
much. Each process estimates the offset of Redis's clock (TIME) from its own, NTP-style: the sample
with the shortest round trip of the last few bounds the error by half that round trip (well under a
millisecond on one network), and converts at the edges: `to_redis(local)` when writing, `to_local(redis)`
when reading.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WINDOW = 32  # samples kept (a minute or so); the one with the shortest round trip wins


@dataclass(frozen=True, slots=True)
class Sample:
    sent_us: int  # local clock, just before TIME was sent
    server_us: int  # Redis's clock, as TIME answered
    received_us: int  # local clock, once the answer was in

    @property
    def rtt_us(self) -> int:
        return self.received_us - self.sent_us

    @property
    def offset_us(self) -> int:
        """Redis's clock minus ours, assuming the answer was taken halfway through the round trip."""
        return self.server_us - (self.sent_us + self.received_us) // 2


@dataclass
class RedisClock:
    """The offset of Redis's clock from this process's (0 until the first sample). Pure: fed samples."""

    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=WINDOW))
    offset_us: int = 0
    now_us: Callable[[], int] = field(default=lambda: time.time_ns() // 1000)  # this process's clock

    def observe(self, sample: Sample) -> None:
        if sample.rtt_us < 0:
            return  # the local clock stepped back during the sample: useless
        self.samples.append(sample)
        self.offset_us = min(self.samples, key=lambda s: s.rtt_us).offset_us

    def to_redis(self, local_us: int) -> int:
        return local_us + self.offset_us

    def to_local(self, redis_us: int) -> int:
        return redis_us - self.offset_us

    def now_ns(self) -> int:
        """Now on Redis's clock in ns (trace timestamps: every process's stamps of one request line up)."""
        return time.time_ns() + self.offset_us * 1000

    async def sample(self, client: Any) -> None:
        """One TIME round trip on `client` (redis.asyncio); Redis errors propagate."""
        sent = self.now_us()
        seconds, micros = await client.time()
        self.observe(Sample(sent, int(seconds) * 1_000_000 + int(micros), self.now_us()))

    async def calibrate(self, client: Any, rounds: int = 8) -> None:
        """Several samples back to back at start: one sample on a busy machine can be milliseconds off
        (a slow round trip), and the periodic ones take a while to find a fast one. Until then a worker
        would cut max_queue_delay and deadlines short by that much."""
        for _ in range(rounds):
            await self.sample(client)

    def sample_sync(self, client: Any) -> None:
        """The same on a synchronous client (redis.Redis: the bulk-job runner)."""
        sent = self.now_us()
        seconds, micros = client.time()
        self.observe(Sample(sent, int(seconds) * 1_000_000 + int(micros), self.now_us()))
