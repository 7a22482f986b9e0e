"""Dead workers' custom-metric parts are folded into one field by a scraping gateway (each worker start
is a new field: without the fold a model's hash grows by one per restart), against a real Redis: the
fleet's totals do not move, the dead fields go, a live or merely late worker is never folded, and a
folded worker's later writes are refused (its counts are in the fold)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import redis
import redis.asyncio as aioredis

from fleet.custom_metrics import Family, Kind, Series, encode
from fleet.keys import Keys
from fleet.redis_server import LocalServer
from gateway.custom_metrics import FOLD_AT, RETIRED, custom_metrics_text
from workers.replies import ReplyWriter

MODEL = "m"
LABELS = (("model", MODEL), ("version", "1"))


def requests(n: float) -> list[Any]:
    return encode([Family("requests", "r", Kind.COUNTER, (Series(LABELS, n),))])


def part(count: float, in_flight: float) -> bytes:
    families = [Family("requests", "requests served", Kind.COUNTER, (Series(LABELS, count),)),
                Family("in_flight", "requests in flight", Kind.GAUGE, (Series(LABELS, in_flight),))]
    return msgpack.packb(encode(families), use_bin_type=True)  # type: ignore[no-any-return]


def value(page: bytes, name: str) -> float:
    [line] = [x for x in page.decode().splitlines() if x.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_dead_workers_parts_are_folded_without_moving_the_totals(redis_server: LocalServer, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    sync = redis.Redis.from_url(redis_server.url)
    back = ReplyWriter(redis_server.url, keys, worker_id="back")  # will be taken for dead, then write again
    back.custom_metrics.report(MODEL, "stub-0", requests(7.0))
    dead = [f"dead-{i}/t" for i in range(FOLD_AT)]
    for i, w in enumerate(dead):
        sync.hset(keys.custom_metrics(MODEL), w, part(10 + i, 1))
    sync.hset(keys.custom_metrics(MODEL), "live/t", part(100, 2))  # serving (in the live set)
    sync.hset(keys.custom_metrics(MODEL), "late/t", part(1000, 3))  # between beats: its heartbeat key is there
    sync.hset(keys.worker("late"), "host", "h")
    sync.hset(keys.custom_metrics(MODEL), "stalled/t", part(500, 4))  # key expired, still in the registry
    sync.zadd(keys.workers(), {"stalled": 1})
    expected = 7 + sum(10 + i for i in range(len(dead))) + 100 + 1000 + 500

    async def scrape() -> bytes:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            return await custom_metrics_text(client, keys, [MODEL], {"live"}, b"")
        finally:
            await client.aclose()

    first = asyncio.run(scrape())
    fields = {k.decode() if isinstance(k, bytes) else k for k in sync.hkeys(keys.custom_metrics(MODEL))}
    assert fields == {RETIRED, "live/t", "late/t", "stalled/t"}  # back's part and the dead ones folded
    assert value(first, "requests") == expected
    second = asyncio.run(scrape())
    assert value(second, "requests") == expected  # the fold itself counted once
    assert value(second, "in_flight") == 2  # gauges: the live worker's only

    # The folded worker writes again (it was frozen past its heartbeat, say): refused, counted once.
    back.custom_metrics.report(MODEL, "stub-0", requests(9.0))
    assert not sync.hexists(keys.custom_metrics(MODEL), back.part)
    assert value(asyncio.run(scrape()), "requests") == expected
    # The same worker id started again (a fixed --worker-id) is a new part, and writes as before.
    again = ReplyWriter(redis_server.url, keys, worker_id="back")
    again.custom_metrics.report(MODEL, "stub-1", requests(5.0))
    assert sync.hexists(keys.custom_metrics(MODEL), again.part)
    assert value(asyncio.run(scrape()), "requests") == expected + 5


def test_fewer_dead_parts_than_the_threshold_are_left_alone(redis_server: LocalServer, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    sync = redis.Redis.from_url(redis_server.url)
    for i in range(FOLD_AT - 1):
        sync.hset(keys.custom_metrics(MODEL), f"dead-{i}/t", part(1, 0))

    async def scrape() -> bytes:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            return await custom_metrics_text(client, keys, [MODEL], set(), b"")
        finally:
            await client.aclose()

    assert value(asyncio.run(scrape()), "requests") == FOLD_AT - 1
    assert RETIRED.encode() not in sync.hkeys(keys.custom_metrics(MODEL))
