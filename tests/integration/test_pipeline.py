"""Gateway -> Redis streams -> worker loop -> reply, in one process against a real Redis server."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
import redis

from fleet.envelope import ReplyEnvelope
from fleet.keys import Keys
from fleet.redis_server import LocalServer
from tests.support.model_repo import TRITON_EXAMPLES
from tests.support.system import InProcessSystem, in_process_system

MODELS = Path(__file__).resolve().parents[1] / "models"
ROOT = Path(__file__).resolve().parents[2]


def run(redis_server: LocalServer, key_prefix: str, body: Callable[[InProcessSystem], Awaitable[None]],
        repos: list[Path] | None = None, worker: bool = True) -> None:
    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, repos or [MODELS], worker=worker) as system:
            await body(system)

    asyncio.run(main())


def enqueue_directly(client: redis.Redis, keys: Keys, request_id: str, values: list[float]) -> None:
    """Put a doubler request on its stream as a gateway would, replying to the stream reply:test."""
    from fleet.envelope import RequestEnvelope, WireTensor, encode_request

    env = RequestEnvelope(id=request_id, model="doubler", version=1,
                          inputs=[WireTensor("IN", "FP32", (1, len(values)), struct.pack(f"<{len(values)}f", *values))],
                          reply_to=keys.reply("test"), enqueued_at_us=0)
    client.xadd(keys.queue("doubler", version=1), {b"d": encode_request(env)})


async def first_reply(client: redis.Redis, keys: Keys, timeout_s: float = 15.0) -> ReplyEnvelope:
    """The first reply a worker wrote to reply:test (polled: tests only)."""
    from fleet.envelope import decode_reply

    for _ in range(int(timeout_s / 0.05)):
        entries = client.xrange(keys.reply("test"))
        if entries:
            return decode_reply(entries[0][1][b"d0"])
        await asyncio.sleep(0.05)
    raise TimeoutError("no reply")


def fp32_request(values: list[list[float]]) -> dict[str, object]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [len(values), len(values[0])],
                        "data": values}]}


def test_json_inference_round_trip(redis_server: LocalServer, key_prefix: str) -> None:
    async def body(s: InProcessSystem) -> None:
        r = await s.client.post("/v2/models/doubler/infer", json={"id": "abc", **fp32_request([[1, 2, 3]])})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["id"] == "abc" and doc["model_name"] == "doubler" and doc["model_version"] == "1"
        assert doc["outputs"] == [{"name": "OUT", "datatype": "FP32", "shape": [1, 3], "data": [2.0, 4.0, 6.0]}]

    run(redis_server, key_prefix, body)


def test_binary_inference_round_trip(redis_server: LocalServer, key_prefix: str) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    header = json.dumps({
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 4], "parameters": {"binary_data_size": 32}}],
        "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
    }).encode()

    async def body(s: InProcessSystem) -> None:
        r = await s.client.post("/v2/models/doubler/infer", content=header + x.tobytes(),
                                headers={"Inference-Header-Content-Length": str(len(header))})
        assert r.status_code == 200, r.text
        n = int(r.headers["inference-header-content-length"])
        doc = json.loads(r.content[:n])
        assert doc["outputs"][0]["parameters"]["binary_data_size"] == 32
        np.testing.assert_array_equal(np.frombuffer(r.content[n:], np.float32).reshape(2, 4), x * 2)

    run(redis_server, key_prefix, body)


def test_concurrent_requests_are_batched(redis_server: LocalServer, key_prefix: str) -> None:
    async def body(s: InProcessSystem) -> None:
        reqs = [s.client.post("/v2/models/doubler/infer", json=fp32_request([[float(i)] * 4])) for i in range(16)]
        responses = await asyncio.gather(*reqs)
        for i, r in enumerate(responses):
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["data"] == [2.0 * i] * 4
        stats = (await s.client.get("/v2/models/doubler/stats")).json()["model_stats"][0]
        assert stats["inference_count"] == 16
        assert stats["execution_count"] < 16
        assert stats["inference_stats"]["success"]["count"] == 16
        assert all(b["batch_size"] <= 8 for b in stats["batch_stats"])

    run(redis_server, key_prefix, body)


def test_onnx_model_from_triton_repository(redis_server: LocalServer, key_prefix: str) -> None:
    a = list(range(16))

    async def body(s: InProcessSystem) -> None:
        req = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": a},
                          {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]}
        r = await s.client.post("/v2/models/simple/infer", json=req)
        assert r.status_code == 200, r.text
        out = {o["name"]: o["data"] for o in r.json()["outputs"]}
        assert out == {"OUTPUT0": [v + 1 for v in a], "OUTPUT1": [v - 1 for v in a]}

    run(redis_server, key_prefix, body, repos=[TRITON_EXAMPLES])


def test_model_errors_reach_only_their_request(redis_server: LocalServer, key_prefix: str) -> None:
    def req(v: int) -> dict[str, object]:
        return {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [v]}]}

    async def body(s: InProcessSystem) -> None:
        r = await s.client.post("/v2/models/faulty/infer", json=req(0))
        assert r.status_code == 400 and r.json() == {"error": "zero is not allowed"}
        r = await s.client.post("/v2/models/faulty/infer", json=req(-1))
        assert r.status_code == 500 and "negative input" in r.json()["error"]
        r = await s.client.post("/v2/models/faulty/infer", json=req(-1000))  # the stub process dies
        assert r.status_code == 500 and "stopped" in r.json()["error"]
        r = await s.client.post("/v2/models/faulty/infer", json=req(7))  # restarted instance answers
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [7]

    run(redis_server, key_prefix, body)


def test_bad_request_never_reaches_a_worker(redis_server: LocalServer, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)

    async def body(s: InProcessSystem) -> None:
        r = await s.client.post("/v2/models/doubler/infer", json=fp32_request([[1.0] * 4] * 9))
        assert r.status_code == 400 and "batch-size must be <= 8" in r.json()["error"]
        r = await s.client.post("/v2/models/doubler/infer", content=b"{not json")
        assert r.status_code == 400
        assert client.xinfo_stream(keys.queue("doubler", version=1))["entries-added"] == 0
        assert client.hgetall(keys.stats("doubler")) == {} and client.xlen(keys.stats_log("doubler")) == 0

    run(redis_server, key_prefix, body)


def test_no_ready_worker_is_503(redis_server: LocalServer, key_prefix: str) -> None:
    async def body(s: InProcessSystem) -> None:
        r = await s.client.post("/v2/models/doubler/infer", json=fp32_request([[1.0] * 4]))
        assert r.status_code == 503
        assert (await s.client.get("/v2/health/ready")).status_code == 400
        assert (await s.client.get("/v2/health/live")).status_code == 200
        assert (await s.client.get("/v2/models/doubler/ready")).status_code == 400
        # Statistics of a model no worker serves: Triton's INVALID_ARG, not a 503.
        r = await s.client.get("/v2/models/doubler/stats")
        assert (r.status_code, r.json()) == (400, {"error": "requested model 'doubler' is not available"})

    run(redis_server, key_prefix, body, worker=False)


@pytest.mark.parametrize("path,status", [
    ("/v2/models/nope/ready", 400), ("/v2/models/doubler/versions/7/ready", 400),  # Triton: "not ready", 400
    ("/v2/models/doubler/versions//ready", 404), ("/v2/models/doubler/versions/x/ready", 404),  # no such route
])
def test_readiness_of_what_is_not_there(redis_server: LocalServer, key_prefix: str, path: str, status: int) -> None:
    async def body(s: InProcessSystem) -> None:
        r = await s.client.get(path)
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json() == {"error": "Model version not ready"}

    run(redis_server, key_prefix, body)


def test_requests_enqueued_before_a_worker_exists_are_served(redis_server: LocalServer, key_prefix: str) -> None:
    """The consumer group starts at the beginning of the stream, so nothing accepted is skipped."""
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)
    enqueue_directly(client, keys, "early-1", [1.5, 2.5])

    async def body(s: InProcessSystem) -> None:
        reply = await first_reply(client, keys)
        assert reply.id == "early-1" and reply.ok
        assert struct.unpack("<2f", reply.outputs[0].data) == (3.0, 5.0)
        for _ in range(100):  # acknowledged and deleted a moment after its reply is written
            if client.xlen(keys.queue("doubler", version=1)) == 0:
                break
            await asyncio.sleep(0.02)
        assert client.xlen(keys.queue("doubler", version=1)) == 0

    run(redis_server, key_prefix, body)


@pytest.mark.parametrize("path,status", [
    ("/v2/models/nope", 404), ("/v2/models/doubler/versions/7", 404), ("/v2/models/doubler/versions/x", 404),
    ("/v2/nothing/here", 404),
])
def test_lookup_errors(redis_server: LocalServer, key_prefix: str, path: str, status: int) -> None:
    async def body(s: InProcessSystem) -> None:
        r = await s.client.get(path)
        assert r.status_code == status
        assert "error" in r.json()

    run(redis_server, key_prefix, body, worker=False)


def test_parameters_pass_through_both_ways(redis_server: LocalServer, key_prefix: str) -> None:
    async def body(s: InProcessSystem) -> None:
        req = {"parameters": {"temperature": 0.5, "mode": "fast", "flag": True, "n": 3},
               "inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [4]}]}
        r = await s.client.post("/v2/models/echo_params/infer", json=req)
        assert r.status_code == 200, r.text
        assert r.json()["parameters"] == {"temperature": "0.5", "mode": "fast", "flag": True, "n": 3}
        assert r.json()["outputs"][0]["data"] == [4]

    run(redis_server, key_prefix, body)


def test_redis_down_is_503_not_a_hang(tmp_path: Path, key_prefix: str) -> None:
    from fleet.redis_server import start_server

    server = start_server(tmp_path, appendonly=False)

    async def main() -> None:
        async with in_process_system(server.url, key_prefix, [MODELS], worker=False) as s:
            s.state.catalog.ready |= {("doubler", 1)}  # as if a worker had reported it
            server.stop()
            r = await asyncio.wait_for(
                s.client.post("/v2/models/doubler/infer", json=fp32_request([[1.0] * 4])), 10)
            assert r.status_code == 503 and "Redis" in r.json()["error"]
            assert (await s.client.get("/v2/health/ready")).status_code == 400

    try:
        asyncio.run(main())
    finally:
        server.stop()


@pytest.mark.parametrize("max_deliveries", [3, 1])
def test_messages_of_a_dead_worker_are_claimed_and_answered(redis_server: LocalServer, key_prefix: str,
                                                            max_deliveries: int) -> None:
    """A consumer that read a request and died never acks it; a live worker claims it after the idle time
    and answers it, or, past max_deliveries, dead-letters it and answers with an error."""
    from fleet.keys import GROUP
    from fleet.settings import Settings
    from workers.main import run_worker

    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)
    queue = keys.queue("doubler", version=1)
    client.xgroup_create(queue, GROUP, id="0", mkstream=True)
    enqueue_directly(client, keys, "orphan-1", [4.0])
    assert client.xreadgroup(GROUP, "dead-worker", {queue: ">"}, count=1)  # read, then "crash"

    settings = Settings(redis_url=redis_server.url, key_prefix=key_prefix, model_repositories=(MODELS,),
                        block_ms=100, claim_idle_ms=200, claim_interval_s=0.1, max_deliveries=max_deliveries)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            reply = await first_reply(client, keys)
            assert reply.id == "orphan-1"
            if max_deliveries > 1:
                assert reply.ok and struct.unpack("<f", reply.outputs[0].data) == (8.0,)
            else:
                assert not reply.ok and "delivered 2 times" in reply.error_message
                for _ in range(100):  # dead-lettered once its error reply is written
                    if client.xlen(keys.dead("doubler")) == 1:
                        break
                    await asyncio.sleep(0.02)
                assert client.xlen(keys.dead("doubler")) == 1
            for _ in range(100):  # acknowledged a moment after its reply is written
                if client.xpending(queue, GROUP)["pending"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert client.xpending(queue, GROUP)["pending"] == 0
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_dead_letters_are_listed_and_replayed(redis_server: LocalServer, key_prefix: str) -> None:
    """A message past max_deliveries is parked with its payload; `fleet dead-letters --replay` queues it
    again and a worker answers it."""
    from fleet.dead_letters import list_dead, replay
    from fleet.envelope import decode_reply
    from fleet.keys import GROUP
    from fleet.settings import Settings
    from workers.main import run_worker

    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)
    queue = keys.queue("doubler", version=1)
    client.xgroup_create(queue, GROUP, id="0", mkstream=True)
    enqueue_directly(client, keys, "poison-1", [5.0])
    assert client.xreadgroup(GROUP, "dead-worker", {queue: ">"}, count=1)
    settings = Settings(redis_url=redis_server.url, key_prefix=key_prefix, model_repositories=(MODELS,),
                        block_ms=100, claim_idle_ms=200, claim_interval_s=0.1, max_deliveries=1)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_worker(settings, "cpu", stop))
        try:
            first = await first_reply(client, keys)
            assert not first.ok and "dead letters" in first.error_message
            # The caller's error reply is written first, the dead letter right after (custody.finish).
            for _ in range(100):
                if list_dead(client, keys, "doubler"):
                    break
                await asyncio.sleep(0.05)
            (letter,) = list_dead(client, keys, "doubler")
            assert letter.request_id == "poison-1" and letter.lane == 0 and "delivered 2 times" in letter.reason
            assert replay(client, keys, "doubler", [letter]) == 1
            assert list_dead(client, keys, "doubler") == []
            for _ in range(200):
                entries = client.xrange(keys.reply("test"))
                if len(entries) == 2:
                    break
                await asyncio.sleep(0.05)
            again = decode_reply(entries[1][1][b"d0"])
            assert again.id == "poison-1" and again.ok and struct.unpack("<f", again.outputs[0].data) == (10.0,)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


def test_a_message_parked_twice_is_replayed_once(redis_server: LocalServer, key_prefix: str) -> None:
    """Letters are at least once: a worker whose ack was lost parks the message again when it is claimed.
    Replay queues such a message once and removes both of its letters; another message's letter (one with
    the same entry id too: a sequence model's lane 0 is a stream per worker), and a letter without a
    payload, are handled as before."""
    from fleet.dead_letters import list_dead, replay
    from fleet.envelope import decode_request

    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)
    queue = keys.queue("doubler", version=1)
    enqueue_directly(client, keys, "twice", [1.0])
    enqueue_directly(client, keys, "once", [2.0])
    enqueue_directly(client, keys, "same-id-elsewhere", [3.0])
    (a_id, a), (b_id, b), (_, c) = client.xrange(queue)
    client.delete(queue)
    for original, payload in ((a_id, a[b"d"]), (b_id, b[b"d"]), (a_id, a[b"d"]), (a_id, c[b"d"])):
        client.xadd(keys.dead("doubler"), {b"id": original, b"lane": 0, b"version": 1, b"reason": b"r", b"d": payload})
    client.xadd(keys.dead("doubler"), {b"id": b"9-9", b"lane": 0, b"version": 1, b"reason": b"unreadable"})
    letters = list_dead(client, keys, "doubler")
    assert [x.request_id for x in letters] == ["twice", "once", "twice", "same-id-elsewhere", ""]
    assert replay(client, keys, "doubler", letters) == 3
    assert [decode_request(fields[b"d"]).id for _, fields in client.xrange(queue)] == \
        ["twice", "once", "same-id-elsewhere"]
    assert [x.reason for x in list_dead(client, keys, "doubler")] == ["unreadable"]  # no payload: it stays
