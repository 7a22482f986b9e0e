"""Under load, a worker reads what came after a blocking read's first message before it batches
(workers/loop.py `_top_up`). Real Valkey, a real worker in process, the sleeper Python-backend model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis

from fleet.keys import Keys
from fleet.redis_server import LocalServer
from fleet.settings import Settings
from fleet.stats import fold_args, render_model_stats
from tests.integration.test_lanes import envelope, wait_for_replies
from tests.support.queue_models import sleeper_repository
from workers.consumer import StreamConsumer
from workers.main import run_worker


def reads_without_block(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many messages each of the worker's non-blocking reads (`_top_up`'s) returned."""
    got: list[int] = []
    read = StreamConsumer.read

    async def recorded(self: StreamConsumer, lane: int, count: int, block_ms: int | None) -> Any:
        messages = await read(self, lane, count, block_ms)
        if block_ms is None:
            got.append(len(messages))
        return messages

    monkeypatch.setattr(StreamConsumer, "read", recorded)
    return got


def batch_sizes(client: redis.Redis, keys: Keys, model: str) -> dict[int, int]:
    """How many batches of each size the model computed (the statistics extension's batch_stats)."""
    client.eval(*fold_args(keys, model))
    fields: Any = client.hgetall(keys.stats(model))
    raw = {k.decode(): int(v) for k, v in fields.items()}
    stats: Any = render_model_stats(model, 1, raw)
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


def slow_model(redis_server: LocalServer, key_prefix: str, tmp_path: Path, *, instances: int = 1,
               block_ms: int = 2000) -> tuple[Keys, redis.Redis, Settings]:
    """A worker's settings serving `slow` (the sleeper, 1 ms a batch of up to 8, no queue delay: the scheduler
    batches what it has the moment an instance is free), the test's keys and client."""
    repo = sleeper_repository(tmp_path, "slow", sleep_ms=1, dynamic_batching="", max_batch_size=8,
                              instances=instances)
    settings = Settings(redis_url=redis_server.url, key_prefix=key_prefix, model_repositories=(repo,),
                        block_ms=block_ms)
    return Keys(key_prefix), redis.Redis.from_url(redis_server.url, protocol=2), settings


def test_a_flush_of_requests_is_one_batch_though_the_blocking_read_returned_its_first(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topped_up = reads_without_block(monkeypatch)
    keys, client, settings = slow_model(redis_server, key_prefix, tmp_path)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            client.xadd(keys.queue("slow", 0, version=1), {b"d": envelope("first", keys, 0)})
            await wait_for_replies(client, keys, 1)  # the worker is up, its next read blocked
            await asyncio.sleep(0.2)
            # Six requests in one round trip, as a gateway's flush: Valkey answers the blocked read after the
            # first XADD, with that one alone; the other five are in the stream when the worker reads it.
            pipe = client.pipeline(transaction=False)
            for i in range(6):
                pipe.xadd(keys.queue("slow", 0, version=1), {b"d": envelope(f"r{i}", keys, i)})
            pipe.execute()
            done = await wait_for_replies(client, keys, 7)
            assert sorted(done) == sorted(["first"] + [f"r{i}" for i in range(6)])
            # One batch of six after the first request's own (without the top-up: one of one, then five).
            assert batch_sizes(client, keys, "slow") == {1: 1, 6: 1}
            assert 5 in topped_up
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_requests_sent_one_at_a_time_cost_no_read_more(redis_server: LocalServer, key_prefix: str,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topped_up = reads_without_block(monkeypatch)
    # At C=1 nothing else is in the stream when a read returns: a second read would only add a round trip.
    keys, client, settings = slow_model(redis_server, key_prefix, tmp_path, block_ms=5000)

    async def one_at_a_time(first: int, n: int) -> None:
        for i in range(first, first + n):
            client.xadd(keys.queue("slow", 0, version=1), {b"d": envelope(f"r{i}", keys, i)})
            await wait_for_replies(client, keys, i + 1)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            await one_at_a_time(0, 4)  # (the first batches, before one at a time is a pattern)
            before = len(topped_up)
            await one_at_a_time(4, 10)
            assert len(topped_up) == before  # one blocking read a request, nothing more
            assert batch_sizes(client, keys, "slow") == {1: 14}
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_a_model_on_two_instances_reads_no_more(redis_server: LocalServer, key_prefix: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The first request's lone batch leaves the other instance free for the rest: nothing to gain.
    topped_up = reads_without_block(monkeypatch)
    keys, client, settings = slow_model(redis_server, key_prefix, tmp_path, instances=2)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            pipe = client.pipeline(transaction=False)
            for i in range(6):
                pipe.xadd(keys.queue("slow", 0, version=1), {b"d": envelope(f"r{i}", keys, i)})
            pipe.execute()
            assert len(await wait_for_replies(client, keys, 6)) == 6
            assert topped_up == []
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())
