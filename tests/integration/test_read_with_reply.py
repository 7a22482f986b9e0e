"""A lone request's next read goes out with its reply write (workers/consumer.py `_Ride`, workers/loop.py):
one send, seen by Valkey's MONITOR as one client's commands in a row; a read no write takes goes out on
its own after its wait, or at once when told (`lapse_ride`); a write that fails lets it go out on its own.
Real Valkey; the worker's own case with the sleeper Python-backend model in process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import RedisError

from fleet.envelope import ReplyEnvelope
from fleet.keys import Keys
from fleet.redis_clients import async_client
from fleet.redis_server import LocalServer, start_server
from fleet.settings import Settings
from tests.integration.test_lanes import envelope, wait_for_replies
from tests.support.queue_models import sleeper_repository
from workers.consumer import StreamConsumer
from workers.main import run_worker


@contextmanager
def monitored(url: str) -> Iterator[list[dict[str, Any]]]:
    """Every command Valkey runs meanwhile (MONITOR, read on a thread): its client address and words."""
    seen: list[dict[str, Any]] = []
    client = redis.Redis.from_url(url, protocol=2)
    done = threading.Event()

    def watch() -> None:
        with client.monitor() as m:
            ready.set()
            for command in m.listen():
                seen.append(command)
                if done.is_set():
                    return

    ready = threading.Event()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert ready.wait(5)
    time.sleep(0.1)  # (MONITOR's OK read: from now on every command is seen)
    try:
        yield seen
    finally:
        done.set()
        client.ping()  # one command more, so the watcher sees `done`
        thread.join(5)
        client.close()


def words(command: dict[str, Any]) -> list[str]:
    return str(command["command"]).split()


def test_a_read_offered_to_the_next_write_goes_out_with_it_or_on_its_own(
        redis_server: LocalServer, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    lane = keys.queue("m", 0, version=1)
    reply_to = keys.reply("g")

    async def main() -> None:
        client = async_client(redis_server.url)
        consumer = StreamConsumer(client, keys, "m", 1, "c")
        try:
            await consumer.join()
            await client.xadd(lane, {b"d": b"first"})
            with monitored(redis_server.url) as seen:
                reading = asyncio.ensure_future(consumer.read(0, 10, 5000, ride_s=10.0))
                await asyncio.sleep(0.3)
                assert not reading.done()  # not sent: the message waits in the stream
                assert not any("XREADGROUP" in words(c) for c in seen)
                written = await consumer.write([(reply_to, ReplyEnvelope(id="r1", error_code="X"))], [])
                assert written.replies == {0} and written.error is None
                got = await asyncio.wait_for(reading, 5)
                assert [payload for _, payload in got] == [b"first"]
            # The reply's XADD and the read are one client's, in a row: one send.
            ours = [c for c in seen if words(c)[0] in ('XADD', 'XREADGROUP')]
            assert [words(c)[0] for c in ours] == ['XADD', 'XREADGROUP']
            assert ours[0]["client_port"] == ours[1]["client_port"]

            # Not taken within its wait: it goes out on its own.
            await client.xadd(lane, {b"d": b"second"})
            started = time.monotonic()
            got = await asyncio.wait_for(consumer.read(0, 10, 5000, ride_s=0.3), 5)
            assert [payload for _, payload in got] == [b"second"] and time.monotonic() - started >= 0.25
            # Told that no write is coming: at once.
            await client.xadd(lane, {b"d": b"third"})
            reading = asyncio.ensure_future(consumer.read(0, 10, 5000, ride_s=10.0))
            await asyncio.sleep(0.05)
            consumer.lapse_ride()
            got = await asyncio.wait_for(reading, 2)
            assert [payload for _, payload in got] == [b"third"]
        finally:
            await consumer.close()

    asyncio.run(main())


def test_a_read_offered_to_a_write_that_fails_goes_out_on_its_own(tmp_path: Path) -> None:
    """Redis stopped by its PID: the write that took the read fails, and the read fails too, at once
    (the reader backs off and reads again, as after any failed read), instead of waiting for a write."""
    server = start_server(tmp_path / "valkey", appendonly=False)
    keys = Keys("ride")

    async def main() -> None:
        client = async_client(server.url)
        consumer = StreamConsumer(client, keys, "m", 1, "c")
        try:
            await consumer.join()
            await consumer.read(0, 10, None)  # the read's link connected
            reading = asyncio.ensure_future(consumer.read(0, 10, 5000, ride_s=10.0))
            await asyncio.sleep(0.1)
            server.stop()
            with pytest.raises(RedisError):
                await consumer.write([(keys.reply("g"), ReplyEnvelope(id="r1", error_code="X"))], [])
            with pytest.raises((RedisError, OSError)):
                await asyncio.wait_for(reading, 5)
            server.restart()
            await consumer.join()
            got = await asyncio.wait_for(consumer.read(0, 10, 100, ride_s=0.01), 5)
            assert got == []
        finally:
            await consumer.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_worker_sends_a_lone_requests_next_read_with_its_reply(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    """Requests one at a time to the sleeper (one instance): once its batches are lone requests, each reply
    goes out in one send with the worker's next read of the lane, and every request is answered."""
    repo = sleeper_repository(tmp_path, "slow", sleep_ms=1, dynamic_batching="", max_batch_size=8)
    settings = Settings(redis_url=redis_server.url, key_prefix=key_prefix, model_repositories=(repo,), block_ms=2000)
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    lane = keys.queue("slow", 0, version=1)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            for i in range(4):  # the worker's last batches become lone requests (workers/inline.py LONE_BATCHES)
                client.xadd(lane, {b"d": envelope(f"w{i}", keys, i)})
                await wait_for_replies(client, keys, i + 1)
            with monitored(redis_server.url) as seen:
                for i in range(4, 8):
                    client.xadd(lane, {b"d": envelope(f"r{i}", keys, i)})
                    await wait_for_replies(client, keys, i + 1)
                await asyncio.sleep(0.1)
            reply_key = keys.reply("lanes")
            commands = [(c["client_port"], words(c)) for c in seen]
            for i, (port, w) in enumerate(commands):
                if w[0] == 'XADD' and reply_key in w[1]:
                    after = [w2[0] for p2, w2 in commands[i + 1:] if p2 == port]
                    assert 'XREADGROUP' in after[:6], (w, after)  # (the statistics, TTL and acks come between)
            assert sum(1 for _, w in commands if w[0] == 'XADD' and reply_key in w[1]) == 4
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    try:
        asyncio.run(main())
    finally:
        client.close()
