"""Requests Redis lost with writes it had acknowledged: a real Valkey killed and restarted on an AOF cut short
(tests/support/aof.py), as a kill with `appendfsync everysec` during a slow fsync leaves it, or a failover to a
replica that lagged. The gateway's broker sends those again once Redis is back, in their order, and they are
answered; a request answered meanwhile, or still in its stream, is not sent twice."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from fleet.broker import Broker
from fleet.envelope import ReplyEnvelope, encode_reply
from fleet.keys import Keys
from fleet.redis_clients import async_client
from fleet.redis_link import entry_order
from fleet.redis_server import LocalServer, start_server
from tests.support.aof import cut_before_last
from tests.support.waiting import until


def reply(rid: str) -> dict[bytes, bytes]:
    return {b"d": encode_reply(ReplyEnvelope(id=rid, model_version=1))}


def with_broker(server: LocalServer, key_prefix: str, block_ms: int,
                test: Callable[[Broker, str, aioredis.Redis], Awaitable[None]], url: str | None = None) -> None:
    """Run `test(broker, queue, admin)` with a gateway's broker started on `server` (stopped after, as the server);
    `url`: the broker's enqueues and lookups go there (its reply reader to the server's own URL)."""

    async def main() -> None:
        keys = Keys(key_prefix)
        broker = Broker(async_client(url or server.url), async_client(server.url), keys, "gw", block_ms=block_ms,
                        request_timeout_s=30, outage_s=20)
        await broker.start()
        admin = async_client(server.url)
        try:
            await test(broker, keys.queue("m", version=1), admin)
        finally:
            await admin.aclose()
            await broker.stop()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_requests_redis_lost_are_sent_again_in_order_and_answered(tmp_path: Path, key_prefix: str) -> None:
    data = tmp_path / "valkey"
    server = start_server(data, appendonly=True)

    async def test(broker: Broker, queue: str, admin: aioredis.Redis) -> None:
        # Answered before the kill, as a worker does: its reply, then its entry deleted.
        answered = broker.submit("a", queue, b"A", model="m", version=1)
        await until(lambda: admin.xlen(queue), 5, "a's entry")
        (a_entry,) = await admin.xrange(queue)
        await admin.xadd(broker.reply_key, reply("a"))
        await admin.xdel(queue, a_entry[0])
        assert (await asyncio.wait_for(answered, 5)).id == "a"

        waiting = {rid: broker.submit(rid, queue, rid.encode(), model="m", version=1) for rid in "bcd"}

        async def three() -> bool:
            return bool(await admin.xlen(queue) == 3)

        await until(three, 5, "b, c and d in the stream")
        first = [(entry_id, fields[b"d"]) for entry_id, fields in await admin.xrange(queue)]
        assert [payload for _, payload in first] == [b"b", b"c", b"d"]

        server.process.kill()  # SIGKILL
        server.process.wait()
        cut = cut_before_last(data, b"XADD", queue, 2)  # c's and d's XADDs, and what came after
        assert [argv[-1] for argv in cut if argv[0] == b"XADD" and argv[1] == queue.encode()] == [b"c", b"d"]
        server.restart()
        await admin.connection_pool.disconnect()  # its connection died with the server

        await until(three, 15, "c and d sent again")
        entries = [(entry_id, fields[b"d"]) for entry_id, fields in await admin.xrange(queue)]
        assert entries[0] == first[0]  # b was kept: not sent twice
        assert [payload for _, payload in entries] == [b"b", b"c", b"d"]  # in their first order
        assert all(entry_order(entry_id) > entry_order(first[0][0]) for entry_id, _ in entries[1:])
        assert not any(f.done() for f in waiting.values())
        for rid in "bcd":
            await admin.xadd(broker.reply_key, reply(rid))
        for rid, future in waiting.items():
            assert (await asyncio.wait_for(future, 5)).id == rid
        await asyncio.sleep(0.2)
        assert await admin.xlen(queue) == 3 and broker.unclaimed_replies == 0  # nothing sent a third time
        assert broker.resent_requests == 2

    # Its reply read blocks longer than the test runs: the outage ends the first read there is (a reader's
    # connection made anew counts, not its first read after).
    with_broker(server, key_prefix, 60_000, test)


def test_a_request_answered_as_lost_ones_are_looked_for_is_not_sent_again(tmp_path: Path, key_prefix: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Its entry is gone (deleted after its reply was written) while its reply is still on its way to the
    reader: the broker waits until the reader has read past a marker written after it looked, and the
    request, answered by then, is not sent again. One whose entry is still there is not either, nor a decoupled
    model's or a sequence's; only the one whose entry and reply are both missing is."""

    async def test(broker: Broker, queue: str, admin: aioredis.Redis) -> None:
        futures = {rid: broker.submit(rid, queue, rid.encode(), model="m", version=1) for rid in ("done", "kept",
                                                                                                 "lost")}
        # A decoupled model's request and a sequence's, lost too: never sent again (their replies would
        # interleave with a run started before its delivery was lost; the sequence would take a step twice).
        futures["streamed"] = broker.submit("streamed", queue, b"streamed", model="m", version=1, streamed=True)
        futures["sequence"] = broker.submit("sequence", queue, b"sequence", model="m", version=1,
                                            on_enqueued=lambda: None)

        async def enqueued() -> bool:
            return bool(await admin.xlen(queue) == 5)

        await until(enqueued, 5, "the five requests in the stream")
        ids = {fields[b"d"].decode(): entry_id for entry_id, fields in await admin.xrange(queue)}
        # "lost": its entry gone with no reply, as a lost write leaves it. "done": its entry gone too, its
        # reply read only after the broker has looked (written then, here).
        await admin.xdel(queue, ids["done"], ids["lost"], ids["streamed"], ids["sequence"])
        caught_up = broker._replies.caught_up

        async def reply_read_after_the_look(timeout_s: float) -> bool:
            await admin.xadd(broker.reply_key, reply("done"))
            return await caught_up(timeout_s)

        monkeypatch.setattr(broker._replies, "caught_up", reply_read_after_the_look)
        assert await broker._send_lost_again()
        await asyncio.wait(set(broker._flushes))  # the flush sending "lost" again
        assert (await asyncio.wait_for(futures["done"], 5)).id == "done"
        entries = {fields[b"d"]: entry_id for entry_id, fields in await admin.xrange(queue)}
        assert set(entries) == {b"kept", b"lost"}
        assert entries[b"kept"] == ids["kept"] and entry_order(entries[b"lost"]) > entry_order(ids["sequence"])
        assert not any(futures[rid].done() for rid in ("kept", "lost", "streamed", "sequence"))

    with_broker(start_server(tmp_path / "valkey", appendonly=False), key_prefix, 50, test)


def test_a_lookup_redis_refuses_is_tried_again(tmp_path: Path, key_prefix: str) -> None:
    """Redis refuses the lookup (here its ACL: no XRANGE for the gateway's user; after a restart, LOADING) while
    the reply reader's connection stays up: the broker looks again after a backoff, and sends the lost request
    once Redis takes the lookup."""
    server = start_server(tmp_path / "valkey", appendonly=False)
    acl = redis.Redis.from_url(server.url)
    acl.acl_setuser("gw", enabled=True, nopass=True, keys=["*"], channels=["*"], commands=["+@all", "-xrange"])

    async def test(broker: Broker, queue: str, admin: aioredis.Redis) -> None:
        lost = broker.submit("lost", queue, b"lost", model="m", version=1)
        await until(lambda: admin.xlen(queue), 5, "the request in the stream")
        (entry,) = await admin.xrange(queue)
        await admin.xdel(queue, entry[0])  # as a lost write leaves it
        broker._look_for_lost()  # as the reply reader's new connection does

        async def refused() -> bool:
            return any(entry["object"] == "xrange" for entry in acl.acl_log())

        await until(refused, 5, "the lookup refused (NOPERM)")
        assert await admin.xlen(queue) == 0 and broker._looking is not None  # looking again
        acl.execute_command("ACL", "SETUSER", "gw", "+xrange")  # granted, the user left as it was

        async def sent_again() -> bool:
            return bool(await admin.xlen(queue) == 1)

        await until(sent_again, 10, "the lost request sent again")
        assert not lost.done()

    try:
        with_broker(server, key_prefix, 50, test, url=f"redis://gw:x@127.0.0.1:{server.port}")
    finally:
        acl.close()


def test_a_decoupled_or_sequence_request_is_never_enqueued_twice(tmp_path: Path, key_prefix: str) -> None:
    """The requests the broker never sends again (no payload kept) are also not sent again by the link's
    retry of a round trip that may have run (fleet/redis_link.py `once`): their flush asks for it."""
    server = start_server(tmp_path / "valkey", appendonly=False)

    async def test(broker: Broker, queue: str, admin: aioredis.Redis) -> None:
        futures = [broker.submit("plain", queue, b"P", model="m", version=1),
                   broker.submit("streamed", queue, b"S", model="m", version=1, streamed=True),
                   broker.submit("step", queue, b"Q", model="m", version=1, on_enqueued=lambda: None)]
        plain, streamed, step = list(broker._outbox)  # not flushed yet: that runs on the loop's next turn
        assert not broker._enqueued_once([plain])
        assert broker._enqueued_once([streamed]) and broker._enqueued_once([plain, step])
        await until(lambda: admin.xlen(queue), 5, "the three enqueued")
        for rid in ("plain", "streamed", "step"):
            await admin.xadd(broker.reply_key, reply(rid))
        assert [(await asyncio.wait_for(f, 5)).id for f in futures] == ["plain", "streamed", "step"]

    with_broker(server, key_prefix, 50, test)
