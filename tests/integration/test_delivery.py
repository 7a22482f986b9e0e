"""Delivery under faults configured in a real Valkey server: a reply Redis refuses keeps
its message until it is written, a refused write never stops a model, one refused enqueue fails only its
own caller, preserve_ordering, the pending count, the worker registry and dead-consumer pruning.

Each test that changes the server's configuration (maxmemory) runs on a server of its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fleet.broker import Broker
from fleet.envelope import ReplyEnvelope, SequenceFlags, encode_reply
from fleet.errors import BrokerUnavailable, DeadlineExceeded
from fleet.keys import GROUP, Keys
from fleet.redis_clients import async_client
from fleet.redis_server import LocalServer, start_server
from fleet.repository import scan
from gateway.catalog import Catalog
from gateway.sequences import SequenceRouter
from tests.support.queue_models import sleeper_repository
from tests.support.system import InProcessSystem, in_process_system
from tests.support.timed_repo import timed_repository, timed_request
from tests.support.waiting import until


def request(value: float) -> dict[str, Any]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}


async def post(client: httpx.AsyncClient, model: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(f"/v2/models/{model}/infer", json=body)



@asynccontextmanager
async def own_server(tmp_path: Path) -> AsyncIterator[tuple[LocalServer, aioredis.Redis]]:
    server = start_server(tmp_path / "valkey", appendonly=False)
    client = aioredis.Redis.from_url(server.url, protocol=2)
    try:
        yield server, client
    finally:
        await client.aclose()
        server.stop()


async def fill_memory(r: aioredis.Redis) -> None:
    """Over maxmemory with noeviction: a 4 MB filler key and a 1 MB limit, so every write that needs
    memory is refused (a limit just above what is used would let small writes through as client buffers
    come and go)."""
    await r.config_set("maxmemory-policy", "noeviction")
    await r.set("filler", b"x" * (4 * 1024 * 1024))
    await r.config_set("maxmemory", 1024 * 1024)
    try:
        await r.set("probe", b"x")
    except ResponseError as exc:
        assert "maxmemory" in str(exc), exc
    else:
        raise AssertionError("Redis still takes writes")


async def free_memory(r: aioredis.Redis) -> None:
    await r.config_set("maxmemory", 0)
    await r.delete("filler")


async def read_by_a_worker(s: InProcessSystem, model: str, count: int) -> None:
    """Until `count` requests of `model` have been read by a worker (started, with an instance free)."""
    queue = s.state.keys.queue(model, version=1)

    async def read() -> bool:
        try:
            return bool((await s.state.client.xpending(queue, GROUP))["pending"] >= count)
        except ResponseError as exc:  # the worker has not joined this stream yet (it creates the group)
            if "NOGROUP" not in str(exc):
                raise
            return False

    await until(read, 5, f"{count} requests of {model} to be read")


async def group_created(s: InProcessSystem, model: str) -> None:
    """Until a worker has created the model's consumer group (it may report ready a moment before)."""
    queue = s.state.keys.queue(model, version=1)

    async def exists() -> bool:
        try:
            groups = await s.state.client.xinfo_groups(queue)
        except ResponseError:  # no stream yet
            return False
        return any(g["name"] in (GROUP, GROUP.encode()) for g in groups)

    await until(exists, 10, f"the consumer group of {model} to exist")


async def stats(s: InProcessSystem, model: str) -> dict[str, Any]:
    doc = (await s.client.get(f"/v2/models/{model}/stats")).json()
    return doc["model_stats"][0]  # type: ignore[no-any-return]


def test_a_reply_redis_refuses_keeps_its_message_until_it_is_written(tmp_path: Path, key_prefix: str) -> None:
    """Out of memory (maxmemory, noeviction) when a batch's replies are written: the XADDs are refused,
    the messages are not acknowledged; once memory is freed every request is answered once, right."""
    repo = sleeper_repository(tmp_path, "oom", sleep_ms=700, max_batch_size=8,
                              dynamic_batching="preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 300000")

    async def main() -> None:
        async with own_server(tmp_path) as (server, r), \
                in_process_system(server.url, key_prefix, [repo], request_timeout_s=30) as s:
            queue = s.state.keys.queue("oom", version=1)
            tasks = [asyncio.create_task(post(s.client, "oom", request(float(i)))) for i in range(8)]

            async def held() -> bool:
                return bool((await r.xpending(queue, GROUP))["pending"] == 8)

            await until(held, 5, "the batch to be read")
            await fill_memory(r)  # the batch of 8 computes for 0.7 s meanwhile
            await asyncio.sleep(1.5)
            assert not any(t.done() for t in tasks), [t.result().text for t in tasks if t.done()]
            assert (await r.xpending(queue, GROUP))["pending"] == 8, "acknowledged without a reply"
            await free_memory(r)
            results = await asyncio.gather(*tasks)
            assert [x.status_code for x in results] == [200] * 8, [x.text for x in results]
            assert [x.json()["outputs"][0]["data"] for x in results] == [[float(i)] for i in range(8)]
            st = await stats(s, "oom")
            assert st["execution_count"] == 1 and st["inference_stats"]["success"]["count"] == 8
            async def drained() -> bool:  # acknowledged once its reply is out (a moment after it)
                return await r.xlen(queue) == 0 and (await r.xpending(queue, GROUP))["pending"] == 0

            await until(drained, 5, "the messages to be acknowledged")
            assert s.state.broker.unclaimed_replies == 0  # no reply twice

    asyncio.run(main())


def test_a_refused_timeout_reply_does_not_stop_the_model(tmp_path: Path, key_prefix: str) -> None:
    """A request times out (REJECT) while Redis refuses writes: its reply is written once Redis takes it
    again, and the model goes on serving (its scheduler did not die with the refused write)."""
    # The second request's deadline (600 ms) leaves a loaded host time to fill Redis's memory before it.
    # (A deadline past the scheduler's 1 s staging margin is staged behind the busy batch, then taken back
    # to time out in the queue: tests/unit/test_scheduler.py.)
    repo = sleeper_repository(tmp_path, "rejecting", sleep_ms=1400, dynamic_batching="""
        default_queue_policy { default_timeout_microseconds: 600000 }""")

    async def main() -> None:
        async with own_server(tmp_path) as (server, r), \
                in_process_system(server.url, key_prefix, [repo], request_timeout_s=30) as s:
            queue = s.state.keys.queue("rejecting", version=1)
            busy = asyncio.create_task(post(s.client, "rejecting", request(1.0)))
            await asyncio.sleep(0.1)
            late = asyncio.create_task(post(s.client, "rejecting", request(2.0)))

            async def read_by_worker() -> bool:
                return bool((await r.xpending(queue, GROUP))["pending"] == 2)

            await until(read_by_worker, 5, "the second request to be read")
            await fill_memory(r)
            await asyncio.sleep(0.8)  # past its deadline: the worker's timeout reply is refused
            assert not late.done()
            await free_memory(r)
            answer = await late
            assert answer.status_code == 503 and answer.json()["error"] == "Request timeout expired"
            assert (await busy).status_code == 200
            after = await post(s.client, "rejecting", request(3.0))
            assert after.status_code == 200 and after.json()["outputs"][0]["data"] == [3.0]

    asyncio.run(main())


def test_one_refused_enqueue_fails_only_its_own_request(redis_server: LocalServer, key_prefix: str,
                                                        tmp_path: Path) -> None:
    """XADDs of one event-loop turn go out as one pipeline; a command Redis refuses (here a lane key of
    the wrong type) fails its own caller, and the others, enqueued, are answered: no retry runs twice."""
    repo = sleeper_repository(tmp_path, "fine", sleep_ms=0, dynamic_batching="")

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            broker = s.state.broker
            r = s.state.client
            broken = f"{key_prefix}:broken-lane"
            await r.set(broken, "not a stream")
            from fleet.envelope import RequestEnvelope, WireTensor, encode_request

            def payload(rid: str, value: float) -> bytes:
                import numpy as np
                x = np.array([[value]], dtype=np.float32)
                return encode_request(RequestEnvelope(id=rid, model="fine", version=1, reply_to=broker.reply_key,
                                                      inputs=[WireTensor("IN", "FP32", (1, 1), x.tobytes())],
                                                      enqueued_at_us=broker.redis_clock.to_redis(
                                                          broker.redis_clock.now_us())))

            fine = s.state.keys.queue("fine", version=1)
            good = [broker.submit(f"good{i}", fine, payload(f"good{i}", i), model="fine")
                    for i in range(3)]
            bad = broker.submit("bad", broken, payload("bad", 9.0), model="fine")
            results = await asyncio.gather(*good, bad, return_exceptions=True)
            assert all(not isinstance(x, BaseException) and x.ok for x in results[:3]), results
            assert isinstance(results[3], Exception) and "WRONGTYPE" in str(results[3])
            st = await stats(s, "fine")
            assert st["inference_stats"]["success"]["count"] == 3

    asyncio.run(main())


def test_preserve_ordering_releases_replies_in_arrival_order(redis_server: LocalServer, key_prefix: str,
                                                             tmp_path: Path) -> None:
    """Two instances; the first request takes 600 ms, the second 50 ms. With preserve_ordering the second
    reply is released only after the first, though it was computed long before."""
    repo = timed_repository(tmp_path, "ordered", max_batch_size=1, instances=2,
                            dynamic_batching="preserve_ordering: true")

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            done: list[str] = []

            async def call(tag: str, sleep_ms: float) -> dict[str, Any]:
                response = await post(s.client, "ordered", timed_request(sleep_ms))
                assert response.status_code == 200, response.text
                done.append(tag)
                return {o["name"]: o["data"][0] for o in response.json()["outputs"]}

            slow = asyncio.create_task(call("slow", 600))
            await read_by_a_worker(s, "ordered", 1)
            quick = await call("quick", 50)
            first = await slow
            assert done == ["slow", "quick"]
            assert quick["PID"] != first["PID"]  # computed on the other instance, at the same time
            assert quick["END_NS"] < first["END_NS"]  # ... and finished first

    asyncio.run(main())


def test_without_preserve_ordering_a_quick_reply_does_not_wait(redis_server: LocalServer, key_prefix: str,
                                                               tmp_path: Path) -> None:
    repo = timed_repository(tmp_path, "unordered", max_batch_size=1, instances=2, dynamic_batching="")

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            done: list[str] = []

            async def call(tag: str, sleep_ms: float) -> None:
                assert (await post(s.client, "unordered", timed_request(sleep_ms))).status_code == 200
                done.append(tag)

            slow = asyncio.create_task(call("slow", 600))
            await read_by_a_worker(s, "unordered", 1)
            await call("quick", 50)
            await slow
            assert done == ["quick", "slow"]

    asyncio.run(main())


def test_pending_count_is_queued_requests_once_per_version(redis_server: LocalServer, key_prefix: str,
                                                           tmp_path: Path) -> None:
    """nv_inference_pending_request_count: accepted and not yet executing (Triton's meaning, the
    autoscaling signal), once per model version, not the executing ones, not repeated per version."""
    repo = sleeper_repository(tmp_path, "pend", sleep_ms=800, dynamic_batching="")
    (repo / "pend" / "2").mkdir()
    (repo / "pend" / "2" / "model.py").write_bytes((repo / "pend" / "1" / "model.py").read_bytes())
    config = repo / "pend" / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy: { all { } }\n")

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            tasks = [asyncio.create_task(post(s.client, "pend", request(float(i)))) for i in range(4)]

            async def pending() -> dict[str, float]:
                await s.state.refresh_readiness()
                text = (await s.client.get("/metrics")).text
                return {line.split('version="')[1].split('"')[0]: float(line.split()[-1])
                        for line in text.splitlines() if line.startswith("nv_inference_pending_request_count{")}

            async def three_waiting() -> bool:
                # Read-ahead requests count from the worker's next heartbeat on (until then they are in
                # neither count): wait for it, or a moment before the read would pass and one after fail.
                return sum((await pending()).values()) == 3 and any(s.state.catalog.queued.values())

            # One executes (800 ms); three wait, whether still in Redis or read ahead by the worker.
            await until(three_waiting, 3, "three pending requests")
            counts = await pending()
            assert sorted(counts.values()) == [0.0, 3.0], counts
            assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4
            assert sum((await pending()).values()) == 0

    asyncio.run(main())


def test_gateways_find_workers_without_scanning_the_keyspace(tmp_path: Path, key_prefix: str) -> None:
    """The registry (a sorted set) replaces SCAN: a gateway whose ACL user may not SCAN or KEYS still sees
    the workers, and a worker that stops leaves the registry."""
    repo = sleeper_repository(tmp_path, "reg", sleep_ms=0, dynamic_batching="")

    async def main() -> None:
        async with own_server(tmp_path) as (server, r):
            await r.acl_setuser("noscan", enabled=True, passwords=["+secret"], keys=["*"], channels=["*"],
                                commands=["+@all", "-scan", "-keys"])
            url = f"redis://noscan:secret@127.0.0.1:{server.port}/0"
            async with in_process_system(url, key_prefix, [repo]) as s:
                assert (await post(s.client, "reg", request(4.0))).status_code == 200
                assert s.state.catalog.workers == 1
                assert await r.zcard(s.state.keys.workers()) == 1
            assert await r.zcard(f"{key_prefix}:workers") == 0  # a worker that stops unregisters

    asyncio.run(main())


def test_consumers_of_dead_workers_are_removed_once_they_hold_nothing(redis_server: LocalServer, key_prefix: str,
                                                                     tmp_path: Path) -> None:
    repo = sleeper_repository(tmp_path, "prune", sleep_ms=0, dynamic_batching="")

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo], dead_consumer_idle_s=0.5,
                                     claim_interval_s=0.1) as s:
            r = s.state.client
            queue = s.state.keys.queue("prune", version=1)
            await group_created(s, "prune")
            await r.xreadgroup(GROUP, "ghost-holding-nothing", {queue: ">"}, count=1, block=10)
            await r.xadd(queue, {b"x": b"1"})
            await r.xreadgroup(GROUP, "ghost-holding-one", {queue: ">"}, count=1)  # holds an unreadable one

            async def names() -> set[str]:
                return {c["name"].decode() for c in await r.xinfo_consumers(queue, GROUP)}

            assert {"ghost-holding-nothing", "ghost-holding-one"} <= await names()

            async def pruned() -> bool:
                return "ghost-holding-nothing" not in await names()

            await until(pruned, 10, "the idle consumer holding nothing to be removed")
            # The live worker's own consumer stays, however idle.
            assert await names() - {"ghost-holding-one"}
            assert (await post(s.client, "prune", request(5.0))).status_code == 200

    asyncio.run(main())


async def started_broker(url: str, keys: Keys, gateway_id: str) -> Broker:
    """A gateway's broker on the test's Valkey, started (the caller stops it)."""
    broker = Broker(async_client(url), async_client(url), keys, gateway_id, block_ms=50, request_timeout_s=10)
    await broker.start()
    return broker


def test_a_reply_written_the_moment_a_broker_starts_is_not_missed(redis_server: LocalServer,
                                                                    key_prefix: str) -> None:
    """A worker's BLS broker starts on its first call and submits at once: the callee's first reply may
    land before the reply reader's first read. start() writes the marker the reader starts after."""

    async def main() -> None:
        keys = Keys(key_prefix)
        broker = await started_broker(redis_server.url, keys, "early")
        try:
            future = broker.submit("r1", keys.queue("m", version=1), b"x", model="m", version=1)
            # The reply, written before the reader task has run at all.
            writer = async_client(redis_server.url)
            await writer.xadd(broker.reply_key, {b"d": encode_reply(ReplyEnvelope(id="r1", model_version=1))})
            await writer.aclose()
            reply = await asyncio.wait_for(future, 5)
            assert reply.id == "r1" and reply.ok
        finally:
            await broker.stop()

    asyncio.run(main())


def test_a_sequence_caller_gone_while_its_xadd_is_on_its_way_releases_its_next_only_once_it_is_back(
        redis_server: LocalServer, key_prefix: str) -> None:
    """fleet/broker.py: flushes go out on several connections and reach Redis in any order, so a sequence's
    next request is routed only once the XADD of the one before it has come back (gateway/sequences.py).
    One whose caller is gone (cancelled) while its XADD is still on its way releases it only then too."""

    async def main() -> None:
        keys = Keys(key_prefix)
        broker = await started_broker(redis_server.url, keys, "seq")
        admin = async_client(redis_server.url)
        released: list[str] = []
        try:
            await admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")  # the XADD waits in Redis meanwhile
            broker.submit("s1", keys.queue("m", version=1), b"x", model="m", version=1,
                          on_enqueued=lambda: released.append("flush"))
            await asyncio.sleep(0.1)
            broker.forget("s1")  # the caller went away, as the data plane's `finally` does
            broker.after_enqueue("s1", lambda: released.append("caller"))
            assert released == []
            await admin.execute_command("CLIENT", "UNPAUSE")
            deadline = time.monotonic() + 3
            while not released and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert released == ["flush"]
            assert await admin.xlen(keys.queue("m", version=1)) == 1
            broker.after_enqueue("s1", lambda: released.append("now"))  # back already: at once
            assert released == ["flush", "now"]
        finally:
            try:
                await admin.execute_command("CLIENT", "UNPAUSE")
            finally:
                await admin.aclose()
                await broker.stop()

    asyncio.run(main())


def test_a_sequence_request_waits_for_the_one_before_it_no_longer_than_the_request_timeout(
        redis_server: LocalServer, key_prefix: str) -> None:
    """gateway/sequences.py: a sequence's next request is routed once the one before it is released. One that
    never is (no path does that now; a defect could) fails it after the request timeout, as a request with no
    reply does, and the sequence's requests after it are routed again."""

    async def main() -> None:
        repository = scan([Path(__file__).parents[1] / "composition_models"])
        spec = repository.models["accumulate"].spec
        catalog = Catalog.from_repository(repository)
        catalog.serving[("accumulate", 1)] = ["w1"]
        client = async_client(redis_server.url)
        router = SequenceRouter(client, Keys(key_prefix), catalog, request_timeout_s=0.3)
        try:
            first = await router.route("accumulate", 1, spec, SequenceFlags(7, start=True))  # never released
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="previous request was not enqueued within 0.3s"):
                await router.route("accumulate", 1, spec, SequenceFlags(7))
            assert 0.25 < time.monotonic() - started < 2
            third = await asyncio.wait_for(router.route("accumulate", 1, spec, SequenceFlags(7)), 1)
            assert third.stream == first.stream
        finally:
            await client.aclose()

    asyncio.run(main())


def test_requests_whose_flush_was_cancelled_waiting_for_a_link_go_in_another(redis_server: LocalServer,
                                                                            key_prefix: str) -> None:
    """fleet/broker.py: a flush waits for an idle link while all have a round trip; cancelled meanwhile, the
    requests it was to take (and those added after it, which start no flush of their own) go in another."""

    async def main() -> None:
        keys = Keys(key_prefix)
        broker = await started_broker(redis_server.url, keys, "strand")
        pool = broker._enqueue
        held = [await pool.take() for _ in pool.links]  # every link busy
        try:
            broker.submit("a", keys.queue("m", version=1), b"x", model="m", version=1)
            await asyncio.sleep(0.05)
            (flush,) = broker._flushes
            broker.submit("b", keys.queue("m", version=1), b"y", model="m", version=1)
            flush.cancel()
            await asyncio.sleep(0.05)
            for link in held:
                pool.give(link)
            held = []
            deadline = time.monotonic() + 5
            while await broker._client.xlen(keys.queue("m", version=1)) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert await broker._client.xlen(keys.queue("m", version=1)) == 2
        finally:
            for link in held:
                pool.give(link)
            await broker.stop()

    asyncio.run(main())


def test_a_broker_stopped_with_round_trips_on_their_way_leaves_nothing_running(redis_server: LocalServer,
                                                                               key_prefix: str) -> None:
    """fleet/broker.py `stop`: round trips still on their way (here held in Valkey by CLIENT PAUSE WRITE, one
    on each enqueue link, and a flush waiting for a link) are given STOP_FLUSHES_S, then cancelled: their
    requests fail instead of waiting for ever, as does one enqueued before whose reply nothing reads any
    more; no flush is left to take and reconnect a link once they are closed, and a request submitted after
    the stop fails at once."""

    async def main() -> None:
        keys = Keys(key_prefix)
        name = f"{key_prefix}-stopping"

        def client() -> aioredis.Redis:
            return aioredis.Redis.from_url(redis_server.url, protocol=2, client_name=name)

        broker = Broker(client(), client(), keys, "stopping", block_ms=50, request_timeout_s=10)
        await broker.start()
        admin = async_client(redis_server.url)
        try:
            enqueued = broker.submit("e", keys.queue("m", version=1), b"x", model="m", version=1)
            streamed = broker.submit("s", keys.queue("m", version=1), b"x", model="m", version=1, streamed=True)
            later = broker.later("s")
            first = ReplyEnvelope(id="s", model_version=1, final=False)
            await admin.xadd(broker.reply_key, {b"d": encode_reply(first)})
            assert (await asyncio.wait_for(streamed, 5)).final is False  # a stream past its first response
            deadline = time.monotonic() + 5
            while await admin.xlen(keys.queue("m", version=1)) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
            futures = []
            for i in range(len(broker._enqueue.links) + 1):  # one flush per link, then one waiting for a link
                futures.append(broker.submit(f"r{i}", keys.queue("m", version=1), b"x", model="m", version=1))
                await asyncio.sleep(0.05)
            assert len(broker._flushes) == len(futures) and not any(f.done() for f in futures)
            await broker.stop()  # waits out the pause (its reply stream's DELETE is a write)
            assert not broker._flushes
            for future in futures:
                assert future.done() and isinstance(future.exception(), BrokerUnavailable)
                assert "the gateway is stopping" in str(future.exception())
            assert enqueued.done() and "no reply will be read" in str(enqueued.exception())
            last = later.get_nowait()
            assert last.error_code == "UNAVAILABLE" and "no reply will be read" in last.error_message
            late = broker.submit("late", keys.queue("m", version=1), b"x", model="m", version=1)
            assert late.done() and isinstance(late.exception(), BrokerUnavailable)
            await asyncio.sleep(0.3)
            clients = (await admin.execute_command("CLIENT", "LIST")).decode()
            assert f"name={name} " not in clients
        finally:
            try:
                await admin.execute_command("CLIENT", "UNPAUSE")
            finally:
                await admin.aclose()

    asyncio.run(main())


def test_a_dead_letter_goes_ahead_of_its_reply_and_is_reported_on_its_own(redis_server: LocalServer,
                                                                          key_prefix: str) -> None:
    """StreamConsumer.write parks a poison message in the same round trip as its caller's reply, ahead of
    it (whoever got the error finds the letter), and reports each letter on its own: one Redis refuses is
    retried by workers/custody.py without writing the reply again."""
    from fleet.stats import DEAD_LETTERED
    from workers.consumer import Letter, StreamConsumer

    keys = Keys(key_prefix)

    async def main() -> None:
        r = async_client(redis_server.url)
        consumer = StreamConsumer(r, keys, "poison", 1, "c")
        try:
            await consumer.join()
            queue = keys.queue("poison", version=1)
            entry = await r.xadd(queue, {b"d": b"payload"})
            await r.xreadgroup(GROUP, "c", {queue: ">"}, count=1)
            reply_to = f"{key_prefix}:reply:p"
            w = await consumer.write([(reply_to, ReplyEnvelope(id="p1", model_version=1, error_code="INTERNAL",
                                                               error_message="poison"))],
                                     [], (), [Letter((0, entry), "poison", b"payload")])
            assert w.replies == frozenset({0}) and w.letters == frozenset({0}) and w.error is None
            (_, letter), = await r.xrange(keys.dead("poison"))
            assert await r.xlen(reply_to) == 1
            assert letter[b"reason"] == b"poison" and letter[b"d"] == b"payload" and letter[b"id"] == entry
            assert int(await r.hget(keys.stats("poison"), DEAD_LETTERED) or 0) == 1

            await r.delete(keys.dead("poison"))
            await r.set(keys.dead("poison"), "not a stream")
            w = await consumer.write([(reply_to, ReplyEnvelope(id="p2", model_version=1))], [], (),
                                     [Letter((0, entry), "poison", None)])
            assert w.replies == frozenset({0}) and w.letters == frozenset() and "WRONGTYPE" in str(w.error)
        finally:
            await consumer.close()
            await r.aclose()

    asyncio.run(main())


def _custody(r: aioredis.Redis, keys: Keys, model: str, config: Any, lost: Any = None) -> tuple[Any, Any, Any]:
    """A consumer of `model`'s streams, its holding and its custody (`config`: a CustodyConfig), as a worker's."""
    from batching.holding import Holding
    from workers.consumer import StreamConsumer
    from workers.custody import Custody

    consumer = StreamConsumer(r, keys, model, 1, "c")
    holding = Holding(1, 4, 16)
    custody = Custody(consumer, holding, config, admit=lambda m, p: None, lost=lost or (lambda ms: None),
                      released=lambda: None)
    return consumer, holding, custody


def test_a_letter_redis_refuses_keeps_only_its_own_message_pending(redis_server: LocalServer,
                                                                   key_prefix: str) -> None:
    """workers/custody.py: a poison message in a batch whose dead letter Redis keeps refusing (a wrong-type
    key here) stays pending, to be claimed and parked again, while its batch-mate, answered, is
    acknowledged; both callers have their replies. An unreadable message (nobody to reply to) is
    acknowledged only once Redis has its letter."""
    from redis.exceptions import ResponseError as Refused

    from workers.consumer import Letter
    from workers.custody import Answer, CustodyConfig

    keys = Keys(key_prefix)

    async def main() -> None:
        r = async_client(redis_server.url)
        consumer, holding, custody = _custody(r, keys, "mixed", CustodyConfig(finish_retry_s=0.5))
        try:
            await consumer.join()
            queue = keys.queue("mixed", version=1)
            await r.set(keys.dead("mixed"), "not a stream")
            ids = [await r.xadd(queue, {b"d": b"%d" % i}) for i in range(3)]
            await r.xreadgroup(GROUP, "c", {queue: ">"}, count=3)
            ok, poison, unreadable = [(0, i) for i in ids]
            for m in (ok, poison):
                holding.hold(m, 1)
            reply_to = f"{key_prefix}:reply:mixed"
            custody.finish([Answer(ok, reply_to, ReplyEnvelope(id="ok", model_version=1)),
                            Answer(poison, reply_to, ReplyEnvelope(id="bad", model_version=1, error_code="INTERNAL",
                                                                   error_message="poison"),
                                   park="poison", payload=b"1")])
            await custody.drained()
            assert await r.xlen(reply_to) == 1  # one entry, both replies (d0, d1)

            async def only_poison_pending() -> bool:
                rows = await r.xpending_range(queue, GROUP, min="-", max="+", count=10)
                return {row["message_id"] for row in rows} == {poison[1], unreadable[1]}

            assert poison not in holding  # left pending, released once given up (drained above)

            async def ok_acknowledged() -> bool:
                # Released once the acknowledgement's result is read (workers/acks.py), which may come just
                # after Redis has run it: wait for both, not the pending list alone.
                return await only_poison_pending() and ok not in holding

            await until(ok_acknowledged, 5, "the answered batch-mate to be acknowledged and released")

            try:
                await consumer.dead_letter(Letter(unreadable, "unreadable", b"2"))
                raise AssertionError("a refused letter must raise")
            except Refused:
                pass
            assert await only_poison_pending()  # not acknowledged without its letter
            await r.delete(keys.dead("mixed"))
            await consumer.dead_letter(Letter(unreadable, "unreadable", b"2"))
            assert await r.xlen(keys.dead("mixed")) == 1
            assert [row["message_id"] for row in await r.xpending_range(queue, GROUP, min="-", max="+", count=10)] \
                == [poison[1]]
        finally:
            await consumer.close()
            await r.aclose()

    asyncio.run(main())


def test_a_keepalive_round_reports_lost_only_what_was_not_answered(redis_server: LocalServer,
                                                                   key_prefix: str) -> None:
    """workers/custody.py: a held message gone from the group is reported lost (and dropped if not
    started) unless its reply is written. An answered one is gone because its acknowledgement, riding on
    a reply write, landed before the round while its release had not run yet: not lost, and not worth
    the warning every benchmark logged. One deleted unanswered (its caller gone) is."""
    from workers.custody import CustodyConfig

    keys = Keys(key_prefix)

    async def main() -> None:
        r = async_client(redis_server.url)
        reported: list[list[tuple[int, bytes]]] = []
        # Rounds every 50 ms: the first round that finds `unanswered` deleted only drops it from the group's
        # pending list (XCLAIM JUSTID of a deleted entry); the next one reports it.
        consumer, holding, custody = _custody(r, keys, "kept", CustodyConfig(keepalive_s=0.05), reported.append)
        keeper: asyncio.Task[None] | None = None
        try:
            await consumer.join()
            queue = keys.queue("kept", version=1)
            ids = [await r.xadd(queue, {b"d": b"%d" % i}) for i in range(3)]
            await r.xreadgroup(GROUP, "c", {queue: ">"}, count=3)
            answered, unanswered, kept = [(0, i) for i in ids]
            for m in (answered, unanswered, kept):
                holding.hold(m, 1)
            holding.answered([answered])  # its reply is written, its acknowledgement on the way
            await r.xack(queue, GROUP, answered[1])
            await r.xdel(queue, answered[1], unanswered[1])
            keeper = asyncio.create_task(custody.keep_alive())
            custody.verify_soon()

            async def reported_once() -> bool:
                return bool(reported)

            await until(reported_once, 5, "a keepalive round")
            assert reported == [[unanswered]]
            assert answered in holding and kept in holding  # the answered one is released once acknowledged
        finally:
            if keeper is not None:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
            await consumer.close()
            await r.aclose()

    asyncio.run(main())


def test_a_stopping_workers_keepalive_ends_only_once_its_answered_messages_are_acknowledged(
        redis_server: LocalServer, key_prefix: str) -> None:
    """workers/custody.py: answered messages wait for their acknowledgement (workers/acks.py, ACK_DELAY_S
    for a ride); a worker that stops meanwhile keeps them held, and its keepalive (what the model's run
    waits for before its connections close) ends only once they are acknowledged, not with them pending,
    to be claimed and computed again by another worker."""
    from workers.custody import Answer, CustodyConfig

    keys = Keys(key_prefix)

    async def main() -> None:
        r = async_client(redis_server.url)
        consumer, holding, custody = _custody(r, keys, "stopping", CustodyConfig(keepalive_s=5.0))
        try:
            await consumer.join()
            queue = keys.queue("stopping", version=1)
            entry = await r.xadd(queue, {b"d": b"x"})
            await r.xreadgroup(GROUP, "c", {queue: ">"}, count=1)
            message = (0, entry)
            holding.hold(message, 1)
            custody.finish([Answer(message, f"{key_prefix}:reply:stopping",
                                   ReplyEnvelope(id="a", model_version=1))])
            custody.stop()
            await custody.drained()  # the reply is written; its acknowledgement waits for a ride
            assert holding.rows() == 0 and holding.held() == 1
            started = time.monotonic()
            await asyncio.wait_for(custody.keep_alive(), 3.0)  # not a keepalive_s (5 s) round later either
            assert time.monotonic() - started < 2.0
            assert (await r.xpending(queue, GROUP))["pending"] == 0 and await r.xlen(queue) == 0
            assert holding.held() == 0
        finally:
            await consumer.close()
            await r.aclose()

    asyncio.run(main())
