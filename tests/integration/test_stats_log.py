"""The statistics log (fleet/stats.py) against a real Redis: whatever batches the workers log and however
the folds fall between them (several at once, partial ones), the stats hash ends with exactly the sums
the old per-batch increments gave, the latest finish time, and an empty log."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import msgpack
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.keys import Keys
from fleet.redis_server import LocalServer
from fleet.stats import (
    COPY_FIELD,
    FOLD_CHUNK,
    FOLD_MAX,
    FOLDED_ROTATE_S,
    LAST_INFERENCE,
    LOG_FIELD,
    TOKEN_FIELD,
    BatchSample,
    LoggedBatch,
    field,
    fold_args,
    increments,
    log_entry,
    logged_batches,
)

MODEL = "m"


@st.composite
def samples(draw: st.DrawFn) -> BatchSample:
    ok = draw(st.integers(0, 4))
    return BatchSample(
        version=draw(st.integers(1, 2)), batch_size=draw(st.integers(1, 64)) if ok else 0, requests_ok=ok,
        requests_failed=draw(st.integers(0, 2)), request_ns_ok=draw(st.integers(0, 2**40)),
        request_ns_failed=draw(st.integers(0, 10**9)), queue_ns=draw(st.integers(0, 10**9)),
        compute_input_ns=draw(st.integers(0, 10**6)), compute_infer_ns=draw(st.integers(0, 10**9)),
        compute_output_ns=draw(st.integers(0, 10**6)), finished_ms=draw(st.integers(1, 2**42)),
        request_us=tuple(draw(st.lists(st.integers(0, 10**6), min_size=ok, max_size=ok))),
        queue_us=tuple(draw(st.lists(st.integers(0, 10**6), min_size=ok, max_size=ok))),
        resource_wait_ns=draw(st.integers(-1, 10**6)))


def one_row(finished_ms: int) -> BatchSample:
    """A batch of one successful request, finished at `finished_ms`."""
    return BatchSample(version=1, batch_size=1, requests_ok=1, requests_failed=0, request_ns_ok=10,
                       request_ns_failed=0, queue_ns=1, compute_input_ns=1, compute_infer_ns=1,
                       compute_output_ns=1, finished_ms=finished_ms)


def expected(batches: list[BatchSample], before: dict[str, int]) -> dict[str, int]:
    sums = Counter(before)
    for s in batches:
        sums.update(increments(s))
        if s.requests_ok:
            last = field(s.version, LAST_INFERENCE)
            sums[last] = max(sums[last], s.finished_ms)
    return {k: v for k, v in sums.items() if v}


def add_backlog(client: redis.Redis, keys: Keys, n: int) -> None:
    """`n` entries of one success each on the model's stats log, as if nobody had folded it for a while."""
    entry = msgpack.packb({field(1, "success:count"): 1})
    pipe = client.pipeline(transaction=False)
    for _ in range(n):
        pipe.xadd(keys.stats_log(MODEL), {LOG_FIELD: entry})
    pipe.execute()


def stats(client: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in client.hgetall(keys.stats(MODEL)).items()}


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(samples(), max_size=25), folds_at=st.sets(st.integers(0, 25)),
       limit=st.integers(1, 6), earlier=st.integers(0, 100))
def test_folding_the_log_at_any_points_gives_the_sums(redis_server: LocalServer, batches: list[BatchSample],
                                                      folds_at: set[int], limit: int, earlier: int) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    # What other writers put straight into the hash (claims, the gateway's counts, an older worker).
    before = {"model:claimed": earlier, field(1, "success:count"): earlier} if earlier else {}
    if before:
        client.hset(keys.stats(MODEL), mapping=before)  # type: ignore[arg-type]
    for i, s in enumerate(batches):
        if i in folds_at:  # a partial fold: at most `limit` entries, the rest stay for the next
            left = client.xlen(keys.stats_log(MODEL))
            assert client.eval(*fold_args(keys, MODEL, limit)) == min(left, limit)
        entry = log_entry(s)
        if entry is not None:
            client.xadd(keys.stats_log(MODEL), {LOG_FIELD: entry})
    client.eval(*fold_args(keys, MODEL))
    assert stats(client, keys) == expected(batches, before)
    assert client.xlen(keys.stats_log(MODEL)) == 0
    client.close()


def test_concurrent_folds_count_each_batch_once(redis_server: LocalServer, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    batch = BatchSample(version=1, batch_size=3, requests_ok=3, requests_failed=0, request_ns_ok=3_000,
                        request_ns_failed=0, queue_ns=300, compute_input_ns=10, compute_infer_ns=100,
                        compute_output_ns=10, finished_ms=5, request_us=(1, 1, 1), queue_us=(0, 0, 0))
    n, writers = 400, 2
    done = threading.Event()

    def write() -> None:
        c = redis.Redis.from_url(redis_server.url, protocol=2)
        entry = log_entry(batch)
        assert entry is not None
        for _ in range(n):
            c.xadd(keys.stats_log(MODEL), {LOG_FIELD: entry})
        c.close()

    def fold() -> None:
        c = redis.Redis.from_url(redis_server.url, protocol=2)
        while not done.is_set():
            c.eval(*fold_args(keys, MODEL, 7))
        c.close()

    folders = [threading.Thread(target=fold) for _ in range(3)]
    feeders = [threading.Thread(target=write) for _ in range(writers)]
    for t in folders + feeders:
        t.start()
    for t in feeders:
        t.join(60)
    done.set()
    for t in folders:
        t.join(60)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    client.eval(*fold_args(keys, MODEL))
    got = stats(client, keys)
    assert got[field(1, "success:count")] == 3 * n * writers
    assert got[field(1, "execution_count")] == n * writers
    assert got[field(1, "compute_infer:ns")] == 300 * n * writers
    assert got[field(1, LAST_INFERENCE)] == 5
    client.close()


def test_a_later_finish_time_never_goes_back(redis_server: LocalServer, key_prefix: str) -> None:
    """The log's entries arrive from several workers whose clocks and batches interleave: the hash keeps the
    latest time, not the last folded."""
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    last = field(1, LAST_INFERENCE)
    client.hset(keys.stats(MODEL), last, 2_000)
    for t in (1_500, 2_500, 1_000):
        client.xadd(keys.stats_log(MODEL), {LOG_FIELD: msgpack.packb({last: t, field(1, "success:count"): 1})})
    client.eval(*fold_args(keys, MODEL))
    assert stats(client, keys) == {last: 2_500, field(1, "success:count"): 3}
    assert client.eval(*fold_args(keys, MODEL)) == 0  # nothing left: a no-op
    client.close()


def test_a_backlog_past_one_fold_is_folded_in_turns(redis_server: LocalServer, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    entry = msgpack.packb({field(1, "success:count"): 2, field(1, "execution_count"): 1})
    pipe = client.pipeline(transaction=False)
    for _ in range(FOLD_MAX + 500):
        pipe.xadd(keys.stats_log(MODEL), {LOG_FIELD: entry})
    pipe.execute()
    assert client.eval(*fold_args(keys, MODEL)) == FOLD_MAX  # deleted in chunks of 500 ids
    assert client.xlen(keys.stats_log(MODEL)) == 500
    assert client.eval(*fold_args(keys, MODEL)) == 500
    assert stats(client, keys) == {field(1, "success:count"): 2 * (FOLD_MAX + 500),
                                   field(1, "execution_count"): FOLD_MAX + 500}
    client.close()


def test_a_worker_folds_its_log_a_chunk_at_a_time_and_a_backlog_at_once(redis_server: LocalServer,
                                                                           key_prefix: str) -> None:
    """A worker's own folds (custody's statistics task) take FOLD_CHUNK entries each, so that none holds
    Redis long (one second's log in one fold was the slowest 1 % of requests); a backlog is folded chunk
    after chunk as soon as the task starts; a fold that Redis refuses does not end the task."""
    import asyncio

    import redis.asyncio as aioredis

    from batching.holding import Holding
    from workers.consumer import StreamConsumer
    from workers.custody import Custody, CustodyConfig

    keys = Keys(key_prefix)
    sync = redis.Redis.from_url(redis_server.url, protocol=2)

    def backlog(n: int) -> None:
        add_backlog(sync, keys, n)

    async def main() -> list[int]:
        client = aioredis.Redis.from_url(redis_server.url, protocol=2)
        consumer = StreamConsumer(client, keys, MODEL, 1, "c")
        custody = Custody(consumer, Holding(1, 4, 16), CustodyConfig(), admit=lambda m, p: None,
                          lost=lambda ms: None, released=lambda: None)
        folds: list[int] = []
        refused: list[BaseException] = []
        fold = consumer.fold_stats

        async def recorded(most: int) -> int:
            try:
                folds.append(await fold(most))
            except Exception as exc:
                refused.append(exc)
                raise
            return folds[-1]

        async def until(done: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 10
            while not done():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.005)

        consumer.fold_stats = recorded  # type: ignore[method-assign]
        backlog(3 * FOLD_CHUNK + 5)
        task = asyncio.create_task(custody.fold_statistics())
        try:
            await until(lambda: len(folds) >= 4, "the backlog folded as soon as the task started")
            assert sync.xlen(keys.stats_log(MODEL)) == 0
            sync.delete(keys.stats_log(MODEL))
            sync.set(keys.stats_log(MODEL), "not a stream")  # every fold refused from here
            await until(lambda: bool(refused), "a fold tried on the broken log")
            await asyncio.sleep(0.05)
            assert not task.done()
        finally:
            custody.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await consumer.close()
            await client.aclose()
        return folds

    assert asyncio.run(main())[:4] == [FOLD_CHUNK, FOLD_CHUNK, FOLD_CHUNK, 5]
    assert stats(sync, keys)[field(1, "success:count")] == 3 * FOLD_CHUNK + 5
    sync.delete(keys.stats_log(MODEL))
    sync.close()


def test_an_unreadable_entry_is_dropped_not_left_to_stop_the_fold(redis_server: LocalServer, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    good = {LOG_FIELD: msgpack.packb({field(1, "success:count"): 1})}
    for fields in (good, {"x": b"1"}, {LOG_FIELD: b"\xc1not msgpack"}, {LOG_FIELD: msgpack.packb([1, 2])},
                   {LOG_FIELD: msgpack.packb({"a": "text", 7: 1})}, good):
        client.xadd(keys.stats_log(MODEL), fields)  # type: ignore[arg-type]
    client.hset(keys.stats(MODEL), field(1, LAST_INFERENCE), "not a number")  # what a fold reads before writing
    client.xadd(keys.stats_log(MODEL), {LOG_FIELD: msgpack.packb({field(1, LAST_INFERENCE): 9})})
    assert client.eval(*fold_args(keys, MODEL)) == 7
    assert client.xlen(keys.stats_log(MODEL)) == 0
    assert client.hget(keys.stats(MODEL), field(1, "success:count")) == b"2"
    assert client.hget(keys.stats(MODEL), field(1, LAST_INFERENCE)) == b"9"
    client.close()


def test_the_worker_writes_counts_before_replies_and_reports_each_part(redis_server: LocalServer,
                                                                      key_prefix: str) -> None:
    """StreamConsumer.write: a reply Redis refuses is
    reported as not written while its batch is counted, and a log Redis refuses as not counted while the
    replies are written (workers/custody.py retries each part on its own)."""
    import asyncio

    import redis.asyncio as aioredis

    from fleet.envelope import ReplyEnvelope
    from workers.consumer import StreamConsumer

    keys = Keys(key_prefix)
    batch = one_row(42)
    sync = redis.Redis.from_url(redis_server.url, protocol=2)
    sync.set(f"{key_prefix}:broken-reply", "not a stream")

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url, protocol=2)
        consumer = StreamConsumer(client, keys, MODEL, 1, "c")
        try:
            replies = [(f"{key_prefix}:reply:a", ReplyEnvelope(id="r1", model_version=1)),
                       (f"{key_prefix}:broken-reply", ReplyEnvelope(id="r2", model_version=1))]
            w = await consumer.write(replies, logged_batches([batch]))
            assert w.replies == frozenset({0}) and w.uncounted == () and "WRONGTYPE" in str(w.error)
            assert sync.xlen(keys.stats_log(MODEL)) == 1 and sync.xlen(f"{key_prefix}:reply:a") == 1
            assert await consumer.fold_stats() == 1
            sync.delete(keys.stats_log(MODEL))
            sync.set(keys.stats_log(MODEL), "not a stream")
            nothing = replace(batch, requests_ok=0, batch_size=0, request_ns_ok=0, queue_ns=0)  # no entry to log
            assert log_entry(nothing) is None
            counts = logged_batches([nothing, batch, nothing])
            assert len(counts) == 1
            w = await consumer.write(replies[:1], counts)
            assert w.replies == frozenset({0}) and w.uncounted == tuple(counts) and "WRONGTYPE" in str(w.error)
        finally:
            await consumer.close()

    asyncio.run(main())
    assert stats(sync, keys)[field(1, "success:count")] == 1
    sync.close()


def test_the_gateways_counts_go_through_the_log_and_keep_the_latest_time(redis_server: LocalServer,
                                                                         key_prefix: str) -> None:
    """gateway/counters.py: a cache hit's or an ensemble's counts are log entries (summed by the fold),
    its `last_inference` never sets back a worker's later one, a failed request stamps none, and the
    gateway folds a log no worker folds (an ensemble's) with a write at most once a fold interval."""
    import asyncio
    import time

    import redis.asyncio as aioredis

    from gateway.counters import Counters

    every = 60.0  # the fold interval, on the injected clock (the fold after a quiet spell: far off, in real s)
    keys = Keys(key_prefix)
    sync = redis.Redis.from_url(redis_server.url, protocol=2)
    later_ms = int(time.time() * 1000) + 3_600_000  # a worker's batch that finished "later"
    worker = one_row(later_ms)
    entry = log_entry(worker)
    assert entry is not None
    sync.xadd(keys.stats_log(MODEL), {LOG_FIELD: entry})
    clock = [100.0]

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url, protocol=2)
        counters = Counters(client, keys, monotonic=lambda: clock[0], fold_every_s=every)
        try:
            counters.add(MODEL, 1, {"success:count": 1, "cache_hit:count": 1})  # folds: the first write
            await counters.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 0
            for _ in range(3):  # within the interval: logged, not folded
                clock[0] += every / 10
                counters.add(MODEL, 1, {"success:count": 1})
                await counters.drain()
            counters.add(MODEL, 2, {"fail:count": 1}, last_inference=False)
            await counters.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 4
            clock[0] += every
            counters.add(MODEL, 1, {"cache_hit:count": 2})
            await counters.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 0
        finally:
            await client.aclose()

    asyncio.run(main())
    got = stats(sync, keys)
    assert got[field(1, "success:count")] == 5 and got[field(1, "cache_hit:count")] == 3
    assert got[field(2, "fail:count")] == 1 and field(2, LAST_INFERENCE) not in got
    assert got[field(1, LAST_INFERENCE)] == later_ms
    sync.close()


def test_the_gateway_folds_on_while_its_fold_comes_back_full(redis_server: LocalServer, key_prefix: str) -> None:
    """An ensemble's log past FOLD_MAX (nobody read it for a while): a write's full fold (a chunk, FOLD_CHUNK)
    folds on at once, whatever FOLD_EVERY_S says, a chunk a round trip until one comes back short or
    FOLD_ROUNDS folds in a row, as a worker's."""
    import asyncio

    import redis.asyncio as aioredis

    from gateway.counters import FOLD_ROUNDS, Counters

    keys = Keys(key_prefix)
    sync = redis.Redis.from_url(redis_server.url, protocol=2)

    def backlog(n: int) -> None:
        add_backlog(sync, keys, n)

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url, protocol=2)
        try:
            backlog(FOLD_MAX + 10)
            counters = Counters(client, keys, monotonic=lambda: 5.0, fold_every_s=60.0)  # the clock never moves on
            counters.add(MODEL, 1, {"success:count": 1})
            await counters.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 0  # a chunk with the write, the rest right after it

            backlog(FOLD_ROUNDS * FOLD_CHUNK + 5)
            capped = Counters(client, keys, monotonic=lambda: 5.0, fold_every_s=60.0)
            capped.add(MODEL, 1, {"success:count": 1})
            await capped.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 6  # FOLD_ROUNDS full folds, then it stopped
            capped.add(MODEL, 1, {"success:count": 1})
            await capped.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 7  # within the interval: logged only
        finally:
            await client.aclose()

    asyncio.run(main())
    sync.eval(*fold_args(keys, MODEL))
    assert stats(sync, keys)[field(1, "success:count")] == FOLD_MAX + FOLD_ROUNDS * FOLD_CHUNK + 18
    sync.close()


def test_the_gateway_folds_what_it_logged_before_a_quiet_spell(redis_server: LocalServer, key_prefix: str) -> None:
    """An entry the gateway did not fold with its write is folded one interval later with no write after
    it, and at once when the gateway closes."""
    import asyncio

    import redis.asyncio as aioredis

    from gateway.counters import Counters

    keys = Keys(key_prefix)
    sync = redis.Redis.from_url(redis_server.url, protocol=2)

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url, protocol=2)
        try:
            # Each write drained before the next: two writes in flight go out on two pooled connections in
            # either order, and the first one's fold may take the second's entry too (it failed CI so).
            # The later fold runs on the loop's own timer, so the interval is real time: long enough that a
            # loaded host still looks at the log before it, short enough to wait out.
            counters = Counters(client, keys, fold_every_s=2.0)
            counters.add(MODEL, 1, {"success:count": 1})  # folded with its write
            await counters.drain()
            counters.add(MODEL, 1, {"success:count": 1})  # within the interval: logged only
            await counters.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 1
            for _ in range(100):  # bounded: 10 s
                if sync.xlen(keys.stats_log(MODEL)) == 0:
                    break
                await asyncio.sleep(0.1)
            assert sync.xlen(keys.stats_log(MODEL)) == 0
            assert stats(sync, keys)[field(1, "success:count")] == 2

            closing = Counters(client, keys, fold_every_s=3600.0)
            closing.add(MODEL, 1, {"success:count": 1})
            await closing.drain()
            closing.add(MODEL, 1, {"success:count": 1})
            await closing.drain()
            assert sync.xlen(keys.stats_log(MODEL)) == 1
            await closing.close()
            assert sync.xlen(keys.stats_log(MODEL)) == 0
        finally:
            await client.aclose()

    asyncio.run(main())
    assert stats(sync, keys)[field(1, "success:count")] == 4
    sync.close()


# --- a batch written again after a write whose outcome is unknown ------------------------------------------


@settings(max_examples=60, deadline=None)
@given(plan=st.lists(st.tuples(samples(), st.booleans(), st.integers(0, 2)), max_size=10),
       data=st.data(), limit=st.integers(1, 5), untokened=st.integers(0, 3))
def test_a_batch_written_again_counts_once(redis_server: LocalServer, plan: list[tuple[BatchSample, bool, int]],
                                           data: st.DataObject, limit: int, untokened: int) -> None:
    """A batch's first write lands or not (the connection dropped after or before Redis ran it); then, its
    outcome unknown, it is written again as a copy 0-2 times (a copy's outcome may be unknown too). They
    reach Redis in any order (a first delayed in the network may come after its copies), among the other
    batches', with folds anywhere between them, partial ones included. Every batch with an entry in the
    log counts exactly once, and an entry without a token (from a worker before tokens) counts as before."""
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    writes: list[dict[str, bytes]] = []
    counted: list[BatchSample] = []
    for sample, landed, copies in plan:
        for logged in logged_batches([sample]):
            if landed or copies:
                writes += [{LOG_FIELD: logged.entry, TOKEN_FIELD: logged.token}] if landed else []
                writes += [{LOG_FIELD: logged.entry, COPY_FIELD: logged.token}] * copies
                counted.append(sample)
    old = BatchSample(version=1, batch_size=2, requests_ok=2, requests_failed=0, request_ns_ok=5,
                      request_ns_failed=0, queue_ns=1, compute_input_ns=1, compute_infer_ns=1,
                      compute_output_ns=1, finished_ms=3)
    entry = log_entry(old)
    assert entry is not None
    writes += [{LOG_FIELD: entry}] * untokened
    counted += [old] * untokened
    order = data.draw(st.permutations(range(len(writes))), label="order")
    folds_at = data.draw(st.sets(st.integers(0, len(writes))), label="folds_at")
    for i, w in enumerate(order):
        if i in folds_at:
            client.eval(*fold_args(keys, MODEL, limit))
        client.xadd(keys.stats_log(MODEL), writes[w])  # type: ignore[arg-type]
    while client.eval(*fold_args(keys, MODEL)):
        pass
    assert stats(client, keys) == expected(counted, {})
    client.close()


def test_a_token_is_found_only_where_a_token_starts(redis_server: LocalServer, key_prefix: str) -> None:
    """The folded tokens are stored back to back: a copy whose token appears across two of them (the end of
    one and the start of the next) is not taken for one folded."""
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    batch = one_row(7)
    (logged,) = logged_batches([batch])
    a, b = b"A" * 16, b"B" * 16
    client.set(keys.stats_tokens(MODEL), a + b, ex=3 * FOLDED_ROTATE_S)  # as if made just now
    straddling = a[8:] + b[:8]
    client.xadd(keys.stats_log(MODEL), {LOG_FIELD: logged.entry, COPY_FIELD: straddling})
    client.xadd(keys.stats_log(MODEL), {LOG_FIELD: logged.entry, COPY_FIELD: b})  # folded before: not counted
    client.eval(*fold_args(keys, MODEL))
    assert stats(client, keys)[field(1, "success:count")] == 1
    assert client.get(keys.stats_tokens(MODEL)) == a + b + straddling
    client.close()


def test_folded_tokens_are_kept_for_a_rotation_and_then_forgotten(redis_server: LocalServer, key_prefix: str) -> None:
    """A copy folded one rotation after its first is still skipped (the older record); two rotations after,
    it counts again: the bound is one to three minutes in production (fleet/stats.py FOLDED_ROTATE_S), past
    a write's retries (30 s). Both records expire."""
    import time

    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    batch = one_row(7)
    first, other, third = logged_batches([batch, batch, batch])

    def write(logged: LoggedBatch, marked: str) -> None:
        client.xadd(keys.stats_log(MODEL), {LOG_FIELD: logged.entry, marked: logged.token})
        client.eval(*fold_args(keys, MODEL, rotate_s=2))

    def success() -> int:
        return stats(client, keys)[field(1, "success:count")]

    write(first, TOKEN_FIELD)
    assert 0 < client.pttl(keys.stats_tokens(MODEL)) <= 6000  # three rotations
    write(first, COPY_FIELD)
    assert success() == 1
    time.sleep(2.1)  # the current record has been current for a rotation
    write(other, TOKEN_FIELD)  # records a token: the current record becomes the older one
    assert client.get(keys.stats_tokens(MODEL, "old")) == first.token
    assert client.pttl(keys.stats_tokens(MODEL, "old")) > 0
    write(first, COPY_FIELD)
    assert success() == 2
    time.sleep(2.1)
    write(third, TOKEN_FIELD)  # a second rotation: the first token is forgotten
    write(first, COPY_FIELD)
    assert success() == 4
    client.close()


@pytest.mark.parametrize("connection", ["warm", "new"])
def test_a_write_whose_reply_is_lost_is_written_again_and_counted_once(redis_server: LocalServer,
                                                                         key_prefix: str, connection: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """workers/custody.py through a proxy that drops the connection after Redis ran the batch's write (its
    replies lost on the way back), with the log folded right then: the write goes out again on a new
    connection (on a warm one the link sends it again itself; on a new one custody retries). The caller's
    reply is there twice (the gateway drops the second), the batch is counted once, its message
    acknowledged."""
    import asyncio

    from batching.holding import Holding
    from fleet.envelope import ReplyEnvelope
    from fleet.keys import GROUP
    from fleet.redis_clients import async_client
    from workers.consumer import StreamConsumer
    from workers.custody import Answer, Custody, CustodyConfig

    keys = Keys(key_prefix)
    batch = one_row(42)
    sync = redis.Redis.from_url(redis_server.url, protocol=2)
    cut = {"armed": False, "done": 0}

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", redis_server.port)
        writing_stats = False

        async def upstream() -> None:
            nonlocal writing_stats
            while chunk := await reader.read(65536):
                writing_stats = writing_stats or bool(cut["armed"] and keys.stats_log(MODEL).encode() in chunk)
                up_writer.write(chunk)
            up_writer.close()

        async def downstream() -> None:
            while chunk := await up_reader.read(65536):
                if writing_stats:  # Redis has run the write (its replies are here): lose them, and the connection
                    cut["armed"], cut["done"] = False, cut["done"] + 1
                    sync.eval(*fold_args(keys, MODEL))  # the first counted before its copy comes
                    break
                writer.write(chunk)
            writer.close()
            up_writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        r = async_client(f"redis://127.0.0.1:{port}")
        consumer = StreamConsumer(r, keys, MODEL, 1, "c")
        holding = Holding(1, 4, 16)
        custody = Custody(consumer, holding, CustodyConfig(finish_retry_s=10), admit=lambda m, p: None,
                          lost=lambda ms: None, released=lambda: None)
        try:
            await consumer.join()
            queue = keys.queue(MODEL, version=1)
            entry_id = await r.xadd(queue, {b"d": b"x"})
            assert isinstance(entry_id, bytes)
            await r.xreadgroup(GROUP, "c", {queue: ">"}, count=1)
            holding.hold((0, entry_id), 1)
            reply_to = f"{key_prefix}:reply:lost"
            if connection == "warm":  # the writer's connection open and used once already
                await consumer.write([(f"{key_prefix}:reply:other", ReplyEnvelope(id="x", model_version=1))], [])
            cut["armed"] = True
            custody.finish([Answer((0, entry_id), reply_to, ReplyEnvelope(id="once", model_version=1))], [batch])
            await custody.drained()
            for _ in range(500):  # the acknowledgement rides on its own, 5 ms later
                if not (await r.xpending(queue, GROUP))["pending"]:
                    break
                await asyncio.sleep(0.01)
            assert (await r.xpending(queue, GROUP))["pending"] == 0
        finally:
            await consumer.close()
            await r.aclose()
            server.close()

    with caplog.at_level(logging.WARNING, logger="workers.custody"):
        asyncio.run(main())
    retried = [r for r in caplog.records if "writing replies failed" in r.getMessage()]
    assert len(retried) == (0 if connection == "warm" else 1)  # warm: the link sent it again itself
    assert cut["done"] == 1  # the first write ran, and its replies were lost
    assert sync.xlen(f"{key_prefix}:reply:lost") == 2  # written twice: Redis ran both writes
    while sync.eval(*fold_args(keys, MODEL)):
        pass
    assert stats(sync, keys)[field(1, "success:count")] == 1
    sync.close()
