"""fleet/redis_link.py against a real server: replies in order with error replies in place, a blocking read
within its deadline, a cancelled round trip leaving nothing behind, a Redis restarted or frozen; a pool's
(fleet/link_pool.py) round trip going out while another is in flight, and waiting only while every link has
one."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fleet.envelope import RequestEnvelope, WireTensor, decode_request, request_payload
from fleet.link_pool import LinkPool
from fleet.parts import Parts
from fleet.redis_clients import async_client
from fleet.redis_link import _BIG_ARG, RedisLink, entry_field, raise_first
from fleet.redis_server import LocalServer, start_server


def test_replies_come_in_order_with_error_replies_in_place(redis_server: LocalServer, key_prefix: str) -> None:
    async def main() -> None:
        client = async_client(redis_server.url)
        link = RedisLink(client)
        key = f"{key_prefix}:s"
        try:
            entry_id, bad, length, echoed = await link.execute(
                [("XADD", key, "*", "d", b"\x00payload"), ("HGET", key, "x"), ("XLEN", key), ("ECHO", b"\xff")])
            assert isinstance(entry_id, bytes) and b"-" in entry_id
            assert isinstance(bad, ResponseError) and "WRONGTYPE" in str(bad)
            assert (length, echoed) == (1, b"\xff")
            with pytest.raises(ResponseError, match="WRONGTYPE"):
                raise_first([entry_id, bad])
            assert await link.execute([]) == []
            (read,) = await link.execute([("XREAD", "COUNT", 10, "STREAMS", key, "0-0")])
            [[stream, [[got_id, fields]]]] = read
            assert (stream, got_id, entry_field(fields, b"d"), entry_field(fields, b"e")) == \
                (key.encode(), entry_id, b"\x00payload", None)
        finally:
            await link.aclose()
            await client.delete(key)
            await client.aclose()

    asyncio.run(main())


def test_long_arguments_are_written_from_their_own_buffers_and_arrive_whole(
        redis_server: LocalServer, key_prefix: str) -> None:
    """Arguments of _BIG_ARG bytes or more go out as buffers of their own (bytes or a memoryview, beside
    small commands in the same round trip); Redis stores exactly them, and a 3 MiB reply reads back whole."""
    big = os.urandom(3 << 20)
    view = memoryview(bytearray(os.urandom(_BIG_ARG)))  # just at the threshold, from a writable buffer

    async def main() -> None:
        client = async_client(redis_server.url)
        link = RedisLink(client)
        key = f"{key_prefix}:big"
        try:
            replies = await link.execute([("PING",), ("XADD", key, "MAXLEN", "~", 10, "*", "a", big, "b", view, "n", 7),
                                          ("SET", f"{key}:s", view), ("STRLEN", f"{key}:s"), ("ECHO", b"small")])
            assert replies[0] == b"PONG" and replies[2:] == [b"OK", _BIG_ARG, b"small"]
            (read,) = await link.execute([("XRANGE", key, "-", "+")])
            [[_, fields]] = read
            assert (entry_field(fields, b"a"), entry_field(fields, b"b"), entry_field(fields, b"n")) == \
                (big, bytes(view), b"7")
        finally:
            await link.aclose()
            await client.delete(key, f"{key}:s")
            await client.aclose()

    asyncio.run(main())


def test_an_out_of_band_envelope_goes_out_as_its_parts_and_reads_back_whole(
        redis_server: LocalServer, key_prefix: str) -> None:
    """An envelope with large tensors (fleet/envelope.py) is one argument written from its head and its
    tensors' own buffers; Redis stores the joined bytes, which decode to the same tensors."""
    image = os.urandom(3 * 224 * 224 * 4)
    body = memoryview(b"head" + image)[4:]  # an input as the gateway has it: a view of the body
    env = RequestEnvelope(id="g:1", model="m", version=1, inputs=[WireTensor("I", "FP32", (3, 224, 224), body),
                          WireTensor("S", "INT32", (1,), b"\x01\x00\x00\x00")], reply_to="r", enqueued_at_us=1)
    payload = request_payload(env)
    assert isinstance(payload, Parts)

    async def main() -> None:
        client = async_client(redis_server.url)
        link = RedisLink(client)
        key = f"{key_prefix}:oob"
        try:
            await link.execute([("XADD", key, "*", "d", payload), ("XADD", key, "*", "d", b"small")])
            (read,) = await link.execute([("XRANGE", key, "-", "+")])
            [[_, first], [_, second]] = read
            assert entry_field(first, b"d") == payload.join() and entry_field(second, b"d") == b"small"
            back = decode_request(entry_field(first, b"d"))
            assert [bytes(t.data) for t in back.inputs] == [image, b"\x01\x00\x00\x00"]
        finally:
            await link.aclose()
            await client.delete(key)
            await client.aclose()

    asyncio.run(main())


def test_a_blocking_read_waits_its_block_and_a_cancelled_one_leaves_nothing_behind(
        redis_server: LocalServer, key_prefix: str) -> None:
    async def main() -> None:
        client = async_client(redis_server.url)
        link = RedisLink(client, timeout_s=0.5)
        key = f"{key_prefix}:blocked"
        try:
            started = time.monotonic()
            # The block (800 ms) is longer than the link's timeout (500 ms): the deadline is both.
            assert await link.execute([("XREAD", "BLOCK", 800, "STREAMS", key, "$")], block_ms=800) == [None]
            assert 0.7 < time.monotonic() - started < 1.3
            read = asyncio.ensure_future(link.execute([("XREAD", "BLOCK", 5000, "STREAMS", key, "$")], block_ms=5000))
            await asyncio.sleep(0.1)
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            await client.xadd(key, {b"d": b"late"})  # what the cancelled read would have got
            assert await link.execute([("PING",)]) == [b"PONG"]  # its own reply, not the stale one
        finally:
            await link.aclose()
            await client.delete(key)
            await client.aclose()

    asyncio.run(main())


def test_a_pools_round_trip_goes_out_while_another_is_in_flight_and_waits_only_when_all_are(
        redis_server: LocalServer, key_prefix: str) -> None:
    async def main() -> None:
        client = async_client(redis_server.url)
        pool = LinkPool(client, 2)
        key = f"{key_prefix}:pool"
        # Blocks until `key` (empty) gets an entry, however late the read reaches Redis.
        block = [("XREAD", "BLOCK", 5000, "STREAMS", key, "0-0")]

        async def blocked() -> list[Any]:  # a round trip in flight until `key` gets an entry
            link = await pool.take()
            try:
                return await link.execute(block, block_ms=5000)
            finally:
                pool.give(link)

        try:
            first = asyncio.ensure_future(blocked())
            await asyncio.sleep(0.1)
            # One link has a round trip in flight: the other takes this one at once.
            assert await asyncio.wait_for(pool.execute([("PING",)]), 5.0) == [b"PONG"]
            second = asyncio.ensure_future(blocked())
            await asyncio.sleep(0.1)
            # Both in flight: these wait for a link. One waiter gives up (cancelled); the other goes once an
            # entry ends both reads.
            gone = asyncio.ensure_future(pool.execute([("PING",)]))
            ping = asyncio.ensure_future(pool.execute([("PING",)]))
            await asyncio.sleep(0.2)
            assert not ping.done()
            gone.cancel()
            await client.xadd(key, {b"d": b"x"})
            assert await asyncio.wait_for(ping, 2.0) == [b"PONG"]
            assert gone.cancelled()
            for read in (first, second):
                [[[stream, [[_, fields]]]]] = await read
                assert (stream, entry_field(fields, b"d")) == (key.encode(), b"x")
            assert all(link._conn.is_connected for link in pool.links)  # each had a connection of its own

            # A link given back goes to the first waiter, not to whoever asks next.
            held = [await pool.take(), await pool.take()]
            first_waiter = asyncio.ensure_future(pool.take())
            await asyncio.sleep(0.05)
            pool.give(held.pop())
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):  # (in this task: no task of its own, which would run later)
                    await pool.take()
            pool.give(await asyncio.wait_for(first_waiter, 1.0))
            pool.give(held.pop())

            # A waiter woken for a link that goes away before it runs passes the link on.
            held = [await pool.take(), await pool.take()]
            woken, next_one = asyncio.ensure_future(pool.take()), asyncio.ensure_future(pool.take())
            await asyncio.sleep(0.05)  # both waiting
            pool.give(held.pop())
            woken.cancel()
            pool.give(await asyncio.wait_for(next_one, 1.0))
            pool.give(held.pop())
            assert woken.cancelled()

            # A round trip cancelled in flight closes its link's connection; the link given back opens
            # another, and every link is still there to take.
            link = await pool.take()
            read = asyncio.ensure_future(link.execute([("XREAD", "BLOCK", 5000, "STREAMS", key, "$")],
                                                      block_ms=5000))
            await asyncio.sleep(0.1)
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read
            pool.give(link)
            assert not link._conn.is_connected
            both = [await pool.take(), await pool.take()]
            assert {id(x) for x in both} == {id(x) for x in pool.links}
            assert [await x.execute([("PING",)]) for x in both] == [[b"PONG"], [b"PONG"]]
            for x in both:
                pool.give(x)
        finally:
            await pool.aclose()
            await client.delete(key)
            await client.aclose()

    asyncio.run(main())


# The event loops a link runs on: asyncio's own (the tests' default) and uvloop (every fleet process's), which
# differ where a connection ends (uvloop refuses a write on a closed transport; asyncio drops it).
LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


def _on_own_server(tmp_path: Path, timeout_s: float,
                   body: Callable[[LocalServer, RedisLink], Awaitable[None]], loop: str = "asyncio") -> None:
    """`body` with a link (timeout `timeout_s`) to a Valkey of its own, which it may stop, restart or freeze."""
    server = start_server(tmp_path / "valkey", appendonly=False)

    async def main() -> None:
        client = async_client(server.url)
        link = RedisLink(client, timeout_s=timeout_s)
        try:
            await body(server, link)
        finally:
            await link.aclose()
            await client.aclose()

    try:
        LOOPS[loop](main())
    finally:
        server.stop()


async def _times_out_while_frozen(server: LocalServer, link: RedisLink) -> float:
    """A PING sent to a Redis frozen with SIGSTOP fails with redis-py's TimeoutError: after how long."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            await link.execute([("PING",)])
        return time.monotonic() - started
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_restarted_redis_is_reached_again_and_a_frozen_one_times_out(tmp_path: Path, loop: str) -> None:
    async def body(server: LocalServer, link: RedisLink) -> None:
        assert await link.execute([("PING",)]) == [b"PONG"]
        server.stop()
        with pytest.raises(RedisConnectionError):
            await link.execute([("PING",)])  # away: an error at once, not a hang
        server.restart()
        assert await link.execute([("PING",)]) == [b"PONG"]
        server.stop()
        server.restart()  # closed while idle: the link finds out and reconnects, no error
        assert await link.execute([("SET", "k", "v"), ("GET", "k")]) == [b"OK", b"v"]
        server.stop()
        await asyncio.sleep(0.2)  # the loop sees the close this time (the transport ends) before the next call
        server.restart()
        assert await link.execute([("SET", "k", "v"), ("GET", "k")]) == [b"OK", b"v"]
        assert await _times_out_while_frozen(server, link) < 2.0
        assert await link.execute([("GET", "k")]) == [b"v"]

    _on_own_server(tmp_path, 0.5, body, loop)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_busy_links_deadline_follows_its_round_trips_and_a_large_write_goes_whole(tmp_path: Path, loop: str) -> None:
    """The deadline's one timer, re-armed by the round trips that outlive it, still ends the one Redis leaves
    unanswered on time; a write larger than the socket takes at once goes out whole (the rest queued)."""
    async def body(server: LocalServer, link: RedisLink) -> None:
        big = os.urandom(2 << 20)  # far past a socket buffer; small enough for a 0.3 s deadline on a busy host
        assert await link.execute([("SET", "big", big), ("STRLEN", "big")]) == [b"OK", len(big)]
        assert await link.execute([("GET", "big")]) == [big]
        ended = time.monotonic() + 1.0  # past three timeouts: the timer fires early and re-arms
        while time.monotonic() < ended:
            assert await link.execute([("PING",)]) == [b"PONG"]
            await asyncio.sleep(0.01)
        # A long blocking read, then a short command: its earlier deadline moves the timer back.
        assert await link.execute([("XREAD", "BLOCK", 400, "STREAMS", "s", "$")], block_ms=400) == [None]
        assert 0.25 < await _times_out_while_frozen(server, link) < 1.0
        assert await link.execute([("STRLEN", "big")]) == [len(big)]

    _on_own_server(tmp_path, 0.3, body, loop)


@pytest.mark.parametrize("once", [False, True])
def test_a_round_trip_that_may_have_run_is_sent_again_only_where_it_may_run_twice(tmp_path: Path, once: bool) -> None:
    """A reused connection dropped mid-round-trip, after Redis ran its XADD: sent again on a new one as
    redis-py does (two entries), unless `once` (fleet/broker.py: a decoupled model's or a sequence's
    request), which fails instead; one found closed before anything was written is sent again either way."""
    async def body(server: LocalServer, link: RedisLink) -> None:
        client = async_client(server.url)
        try:
            (own_id,) = await link.execute([("CLIENT", "ID")])  # connected: the next round trip reuses it

            async def kill_soon() -> None:
                # Once the XADD ran and the BLPOP behind it waits (however slow the host), not before.
                while b"cmd=blpop" not in next(line for line in (await client.execute_command("CLIENT", "LIST"))
                                               .splitlines() if b"id=%d " % own_id in line):
                    await asyncio.sleep(0.02)
                await client.execute_command("CLIENT", "KILL", "ID", own_id)

            killer = asyncio.ensure_future(kill_soon())
            commands = [("XADD", "jobs", "*", "d", "x"), ("BLPOP", "nothing", 5)]
            if once:
                with pytest.raises(RedisConnectionError):
                    await link.execute(commands, block_ms=5000, once=True)
            else:  # sent again, its BLPOP short this time (`resend`: what goes instead)
                got = await link.execute(commands, block_ms=5000,
                                         resend=lambda: [commands[0], ("BLPOP", "nothing", 0.1)])
                assert got[1] is None
            await killer
            assert await client.xlen("jobs") == (1 if once else 2)

            # Closed while idle (Redis restarted): found before writing, so sent again even `once`.
            assert await link.execute([("PING",)]) == [b"PONG"]  # connected again, to be found closed
            server.stop()
            await asyncio.sleep(0.2)
            server.restart()
            assert await link.execute([("XADD", "idle", "*", "d", "x")], once=True)
            assert await client.xlen("idle") == 1
        finally:
            await client.aclose()

    _on_own_server(tmp_path, 2.0, body)
