"""Priority lanes in a real worker against real Redis: the bulk lane never holds up an online request,
and lane aging keeps the bulk lane moving under a saturating online load."""

from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path

import redis

from fleet.admission import bulk_lane
from fleet.envelope import RequestEnvelope, WireTensor, decode_reply, encode_request
from fleet.keys import Keys
from fleet.model_config import load_config
from fleet.redis_server import LocalServer
from fleet.settings import Settings
from tests.support.queue_models import sleeper_repository
from workers.main import run_worker


def envelope(request_id: str, keys: Keys, value: float) -> bytes:
    """A request as a gateway (or a bulk job) would enqueue it, replying to the stream reply:lanes."""
    tensor = WireTensor("IN", "FP32", (1, 1), struct.pack("<f", value))
    return encode_request(RequestEnvelope(id=request_id, model="slow", version=1, inputs=[tensor],
                                          reply_to=keys.reply("lanes"), enqueued_at_us=time.time_ns() // 1000))


def replies_in_order(client: redis.Redis, keys: Keys) -> list[str]:
    out = []
    for _, fields in client.xrange(keys.reply("lanes")):
        out += [decode_reply(v).id for k, v in sorted(fields.items()) if k.startswith(b"d")]
    return out


async def wait_for_replies(client: redis.Redis, keys: Keys, n: int, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = replies_in_order(client, keys)
        if len(done) >= n:
            return done
        await asyncio.sleep(0.02)
    raise TimeoutError(f"only {len(replies_in_order(client, keys))} of {n} replies")


def test_online_request_overtakes_a_bulk_backlog(redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    repo = sleeper_repository(tmp_path, "slow", sleep_ms=50, dynamic_batching="")
    spec = load_config(repo / "slow")
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    for i in range(20):  # a bulk job's backlog, queued before any worker runs
        client.xadd(keys.queue("slow", bulk_lane(spec), version=1), {b"d": envelope(f"bulk{i}", keys, i)})
    settings = Settings(redis_url=redis_server.url, key_prefix=key_prefix, model_repositories=(repo,), block_ms=100)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            await wait_for_replies(client, keys, 2)  # bulk is flowing
            seen = len(replies_in_order(client, keys))  # counted now: a late poll may have seen more than 2
            client.xadd(keys.queue("slow", 0, version=1), {b"d": envelope("online", keys, -1)})
            done = await wait_for_replies(client, keys, 21)
            # It waited for at most the batch running when it arrived and the one already dispatched (and
            # one more answered between the count and the XADD), not for the backlog.
            assert done.index("online") <= seen + 3, (seen, done)
            assert sorted(done) == sorted([f"bulk{i}" for i in range(20)] + ["online"])
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_aging_moves_the_bulk_lane_under_saturating_online_load(redis_server: LocalServer, key_prefix: str,
                                                               tmp_path: Path) -> None:
    repo = sleeper_repository(tmp_path, "slow", sleep_ms=20, dynamic_batching="")
    spec = load_config(repo / "slow")
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    settings = Settings(redis_url=redis_server.url, key_prefix=key_prefix, model_repositories=(repo,), block_ms=100,
                        lane_aging_ms=300)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            for i in range(10):  # keep more online work queued than the instance can serve
                client.xadd(keys.queue("slow", 0, version=1), {b"d": envelope(f"on{i}", keys, i)})
            await wait_for_replies(client, keys, 1)
            client.xadd(keys.queue("slow", bulk_lane(spec), version=1), {b"d": envelope("bulk", keys, 0)})
            started, sent = time.monotonic(), 10
            while "bulk" not in replies_in_order(client, keys):
                assert time.monotonic() - started < 5, "the bulk lane starved"
                queued = client.xlen(keys.queue("slow", 0, version=1))
                for _ in range(max(0, 10 - queued)):  # saturation: the online lane never runs dry
                    client.xadd(keys.queue("slow", 0, version=1), {b"d": envelope(f"on{sent}", keys, sent)})
                    sent += 1
                await asyncio.sleep(0.01)
            # Served after about one aging interval (0.3 s), not after the online flood stopped.
            assert time.monotonic() - started < 2.0
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())
