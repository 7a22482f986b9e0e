"""workers/acks.py against a real Valkey: an acknowledgement waits ACK_DELAY_S for a ride from when it
joined, so at one request at a time each rides the next reply write instead of a round trip of its own."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet.keys import GROUP, Keys
from fleet.redis_clients import async_client
from fleet.redis_server import LocalServer
from workers import acks
from workers.acks import Acks
from workers.consumer import StreamConsumer

DELAY_S = 1.0  # ACK_DELAY_S for this test: wide margins on a loaded host


def test_an_acknowledgement_waits_its_own_delay_for_a_ride(redis_server: LocalServer, key_prefix: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acks, "ACK_DELAY_S", DELAY_S)
    keys = Keys(key_prefix)

    async def main() -> None:
        r = async_client(redis_server.url)
        consumer = StreamConsumer(r, keys, "acked", 1, "c")
        released: list[object] = []
        waiting = Acks(consumer, 30.0, released.extend)
        try:
            await consumer.join()
            queue = keys.queue("acked", version=1)
            first, second = [await r.xadd(queue, {b"d": b"x"}) for _ in range(2)]
            await r.xreadgroup(GROUP, "c", {queue: ">"}, count=2)

            async def pending() -> int:
                return int((await r.xpending(queue, GROUP))["pending"])

            armed = time.monotonic()
            waiting.add([(0, first)])  # arms a flush for DELAY_S from now
            await asyncio.sleep(0.6 * DELAY_S)
            ride = waiting.take()  # the next reply write carries the first (as workers/custody.py's)
            await consumer.ack([m for ms, _ in ride for m in ms])
            waiting.settle(ride, True)
            waiting.add([(0, second)])  # joins 0.6 DELAY_S after the flush was armed
            await asyncio.sleep(armed + 1.2 * DELAY_S - time.monotonic())
            # The flush armed for the first is past due; the second has waited only 0.6 DELAY_S: not sent.
            assert await pending() == 1, "acknowledged before its own delay, without a ride"
            # Released once the acknowledgement's result is read back, which may come just after Redis ran
            # it (this XPENDING on another connection can see it first): wait for both.
            deadline = time.monotonic() + 10
            while (await pending() or len(released) < 2) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await pending() == 0, "never acknowledged on its own"
            assert released == [(0, first), (0, second)]
            assert await r.xlen(queue) == 0  # deleted with the acknowledgement
        finally:
            await consumer.close()
            await r.aclose()

    asyncio.run(main())
