"""fleet/unlogged.py against a real Valkey with AOF, restarted: a bulk job's requests (the runner's XADD,
fleet/jobs/feed.py) and their replies (the worker's write, workers/consumer.py) are not logged, online
replies are, and a replayed lane keeps its last id, so the workers' group reads what comes after; a replayed
job results stream keeps its last id too, so the runner, reading from the last reply it read, finds what
comes after (XADD gives ids past a stream's last one, whatever the clock says)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis

from fleet.envelope import ReplyEnvelope
from fleet.keys import GROUP, Keys
from fleet.redis_clients import async_client
from fleet.redis_link import entry_order
from fleet.redis_server import LocalServer, start_server
from fleet.unlogged import UNLOGGED_XADD
from workers.backends.base import InferenceItem
from workers.consumer import StreamConsumer
from workers.replies import ReplyWriter

REQUEST = b"job-request-payload|" * 50
JOB_REPLY = "job-reply-message|" * 50
ONLINE_REPLY = "online-reply-message|" * 50
STREAMED_JOB_REPLY = "streamed-job-reply|" * 50  # a decoupled model's response before its last


def aof_bytes(data_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((data_dir / "appendonlydir").iterdir()))


def test_a_jobs_requests_and_replies_stay_out_of_the_aof_and_its_streams_keep_their_ids(tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = Keys("unlogged")
    lane = keys.queue("m", 0, version=1)
    results, online = keys.job_results("j1"), keys.reply("gw")
    server = start_server(data)
    try:
        second, last_reply = written_before_restart(server.url, keys, lane, results, online)
        port = server.port
    finally:
        server.stop()  # SIGTERM: the AOF is written out
    log = aof_bytes(data)
    logged = [m for m in (REQUEST, JOB_REPLY.encode(), STREAMED_JOB_REPLY.encode()) if m in log]
    assert not logged, f"a job's request or reply reached the AOF: {[m[:20] for m in logged]}"
    assert ONLINE_REPLY.encode() in log and b"XSETID" in log

    server = start_server(data, port)
    try:
        client = redis.Redis.from_url(server.url, protocol=2)
        assert client.xlen(online) == 1
        replies = client.xinfo_stream(results)
        assert replies["length"] == 0 and replies["last-generated-id"] == last_reply  # the replies are gone
        assert entry_order(client.eval(UNLOGGED_XADD, 1, results, "*", "d0", b"after")) > entry_order(last_reply)
        info = client.xinfo_stream(lane)
        assert info["length"] == 0 and info["last-generated-id"] == second  # the unread request is gone
        (group,) = client.xinfo_groups(lane)
        assert group["last-delivered-id"] == info["last-generated-id"]
        after = client.xadd(lane, {b"d": b"online"})
        assert client.xreadgroup(GROUP, "c", {lane: ">"}) == [[lane.encode(), [(after, {b"d": b"online"})]]]
        client.close()
    finally:
        server.stop()


def written_before_restart(url: str, keys: Keys, lane: str, results: str, online: str) -> tuple[bytes, bytes]:
    """Two job requests (the first creates the lane), both read by a worker, replies to the job (the first
    creates its results stream) and to a gateway, the first request acknowledged. Returns the second
    request's entry id and the last reply's."""
    client = redis.Redis.from_url(url, protocol=2)
    pipe = client.pipeline(transaction=False)
    for _ in range(2):
        pipe.eval(UNLOGGED_XADD, 1, lane, "*", "d", REQUEST)  # the first creates the lane (no worker joined yet)
    first, second = pipe.execute()

    async def worker() -> None:
        r = async_client(url)
        consumer = StreamConsumer(r, keys, "m", 1, "c")
        try:
            await consumer.join()
            read = await consumer.read(0, 10, 0)
            assert [(m, payload) for m, payload in read] == [((0, first), REQUEST), ((0, second), REQUEST)]
            replies = [(results, ReplyEnvelope(id="r1", error_code="X", error_message=JOB_REPLY)),
                       (online, ReplyEnvelope(id="r2", error_code="X", error_message=ONLINE_REPLY))]
            written = await consumer.write(replies, [], acks=[(0, first)])
            assert written.replies == {0, 1} and written.acked and written.error is None
        finally:
            await consumer.close()
            await r.aclose()

    asyncio.run(worker())
    writer = ReplyWriter(url, keys)  # the decoupled responses' writer (workers/replies.py)
    writer.emit(InferenceItem({}, key="r3", reply_to=results), {"e": ["X", STREAMED_JOB_REPLY]})
    writer.close()
    assert client.xlen(results) == 2 and client.xlen(online) == 1 and client.xlen(lane) == 1  # all in memory
    last_reply = client.xinfo_stream(results)["last-generated-id"]
    client.close()
    return bytes(second), bytes(last_reply)


def test_a_jobs_results_stream_recreated_by_a_late_reply_expires(redis_server: LocalServer, key_prefix: str) -> None:
    """A job's run deletes its results stream when it ends; a reply that comes after (a duplicate) creates it
    again, logged (UNLOGGED_XADD), so it must get a TTL however recently the worker wrote to that stream:
    each write to a job's stream asks for one (EXPIRE NX), not once a minute as for a gateway's."""
    keys = Keys(key_prefix)
    results = keys.job_results("late")
    client = redis.Redis.from_url(redis_server.url, protocol=2)

    async def main() -> None:
        r = async_client(redis_server.url)
        consumer = StreamConsumer(r, keys, "m", 1, "c")
        try:
            for n in range(2):
                reply = ReplyEnvelope(id=f"r{n}", error_code="X", error_message="late")
                written = await consumer.write([(results, reply)], [], acks=[])
                assert written.replies == {0} and written.error is None
                assert client.pttl(results) > 0, f"write {n}: the results stream has no TTL"
                client.delete(results)  # the run ends
        finally:
            await consumer.close()
            await r.aclose()

    asyncio.run(main())
    client.close()
