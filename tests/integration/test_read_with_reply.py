"""A lone request's next read goes out with its reply write (workers/consumer.py `_Ride`, workers/loop.py):
one send, seen by Valkey's MONITOR as one client's commands in a row; a read no write takes goes out on
its own after its wait, or at once when told (`lapse_ride`); a write that fails lets it go out on its own.
Real Valkey; the worker's own case with the sleeper Python-backend model in process."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

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
from workers import loop as loop_module
from workers.consumer import StreamConsumer
from workers.main import run_worker


class Monitor:
    """Every command Valkey runs while it watches (MONITOR, read on a thread of its own): client port and words.
    `sync()` returns once everything run before it has been seen (a marker command sent, and waited for)."""

    def __init__(self, url: str) -> None:
        self.seen: list[tuple[str, list[str]]] = []
        self._url = url
        self._watcher = redis.Redis.from_url(url, protocol=2)
        self._client = redis.Redis.from_url(url, protocol=2)
        self._marks = 0
        self._marked = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with self._watcher.monitor() as m:
            for command in m.listen():
                text = str(command["command"])
                if text.startswith("ECHO monitor-mark-"):
                    self._marked.set()
                    if text.endswith("-end"):
                        return
                    continue
                self.seen.append((str(command["client_port"]), text.split()))

    def sync(self, end: bool = False) -> None:
        self._marks += 1
        self._marked.clear()
        deadline = time.monotonic() + 5
        while not self._marked.is_set():  # (the first marks may come before MONITOR is on)
            assert time.monotonic() < deadline, "MONITOR saw no marker"
            self._client.echo(f"monitor-mark-{self._marks}" + ("-end" if end else ""))
            self._marked.wait(0.05)

    def __enter__(self) -> Monitor:
        self._thread.start()
        self.sync()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.sync(end=True)
            self._thread.join(5)
            assert not self._thread.is_alive(), "MONITOR's thread did not end"
        finally:
            self._client.close()
            self._watcher.close()

    def about(self, key: str) -> list[tuple[str, list[str]]]:
        """The commands seen that name `key`."""
        return [(port, w) for port, w in self.seen if key in w]


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
            with Monitor(redis_server.url) as seen:
                reading = asyncio.ensure_future(consumer.read(0, 10, 5000, ride_s=10.0))
                await asyncio.sleep(0.3)
                seen.sync()
                assert not reading.done() and seen.about(lane) == []  # not sent: the message waits in the stream
                written = await consumer.write([(reply_to, ReplyEnvelope(id="r1", error_code="X"))], [])
                assert written.replies == {0} and written.error is None
                got = await asyncio.wait_for(reading, 5)
                assert [payload for _, payload in got] == [b"first"]
                assert consumer.ride_found_waiting  # it was in the stream before the write
            # The reply's XADD and the read are one client's, in a row: one send.
            (xadd_port, xadd), = seen.about(reply_to)[:1]
            (read_port, read), = seen.about(lane)
            assert (xadd[0], read[0], xadd_port) == ("XADD", "XREADGROUP", read_port)
            ours = [w[0] for port, w in seen.seen if port == xadd_port]
            assert ours[-1] == "XREADGROUP" and ours.count("XREADGROUP") == 1

            # A request that comes after the write: the read was not answered in the write's replies.
            reading = asyncio.ensure_future(consumer.read(0, 10, 5000, ride_s=10.0))
            await asyncio.sleep(0.05)
            await consumer.write([(reply_to, ReplyEnvelope(id="r2", error_code="X"))], [])
            await asyncio.sleep(0.2)
            await client.xadd(lane, {b"d": b"later"})
            got = await asyncio.wait_for(reading, 5)
            assert [payload for _, payload in got] == [b"later"] and not consumer.ride_found_waiting

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
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests one at a time to the sleeper (one instance): once its batches are lone requests, each reply
    goes out in one send with the worker's next read of the lane, and every request is answered."""
    monkeypatch.setattr(loop_module, "RIDE_WAIT_S", 2.0)  # (a loaded host: the read must not give up first)
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
            with Monitor(redis_server.url) as seen:
                for i in range(4, 8):
                    client.xadd(lane, {b"d": envelope(f"r{i}", keys, i)})
                    await wait_for_replies(client, keys, i + 1)
                await asyncio.sleep(0.1)
                seen.sync()
            reply_key = keys.reply("lanes")
            replies = 0
            for i, (port, w) in enumerate(seen.seen):
                if w[0] == "XADD" and w[1] == reply_key:
                    replies += 1
                    after = [w2 for p2, w2 in seen.seen[i + 1:] if p2 == port]
                    # (the statistics, the TTL and the acknowledgements come between, in the same send)
                    assert ["XREADGROUP", lane] in [[w2[0], w2[-2]] for w2 in after[:6]], (w, after)
            assert replies == 4
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    try:
        asyncio.run(main())
    finally:
        client.close()
