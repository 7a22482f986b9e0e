"""Fault injection against real processes: Redis (AOF), one gateway and two workers, each signalled by
PID. Every accepted request must end in exactly one reply with its own value, whatever is killed.

Workers are frozen with SIGSTOP (as a stalled host would be) to pile requests up deterministically
before a fault; their heartbeat TTL is long enough that the gateway keeps routing to them meanwhile.
The figures each test prints (`-s`) are the ones quoted in bench/RESULTS.md, "Reliability".
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.rawhttp import Connection
from fleet.keys import GROUP, Keys
from fleet.redis_server import start_server
from tests.support.processes import Cluster
from tests.support.queue_models import SLEEPER

MODEL = "echo"  # OUT = IN after SLEEP_MS per batch of up to 16
SLOW = "slow"  # OUT = IN after 1 s, one request at a time
KILLER = "killer"  # OUT = IN; a negative IN kills the worker process that runs it (SIGKILL to the stub's parent)
KILLER_PY = """
import os
import signal
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        if x[0][0] < 0:
            os.kill(os.getppid(), signal.SIGKILL)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)])]
"""
ENV = {
    "FLEET_CLAIM_MIN_MS": "1000",
    "FLEET_CLAIM_KEEPALIVE_S": "0.25",
    "FLEET_CLAIM_INTERVAL_S": "0.25",
    "FLEET_HEARTBEAT_TTL_S": "60",  # frozen (SIGSTOP) workers stay routable
    "FLEET_REQUEST_TIMEOUT_S": "30",
    "FLEET_BLOCK_MS": "200",
    "FLEET_KEY_PREFIX": "faults",
    "FLEET_REDIS_OUTAGE_S": "2",  # waiting callers get 503 once Redis has been away this long
}
KEYS = Keys("faults")
# After a graceful stop, uvicorn re-raises the SIGTERM it caught, so the exit status says how it ended.
STOPPED_BY_SIGTERM = (0, -signal.SIGTERM)


def _model(repo: Path, name: str, *, sleep_ms: int, max_batch_size: int) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_bytes(SLEEPER.read_bytes())
    (repo / name / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
parameters {{ key: "SLEEP_MS" value: {{ string_value: "{sleep_ms}" }} }}
""")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("faults")
    repo = tmp / "models"
    _model(repo, MODEL, sleep_ms=20, max_batch_size=16)
    _model(repo, SLOW, sleep_ms=1000, max_batch_size=1)
    _model(repo, KILLER, sleep_ms=0, max_batch_size=1)
    (repo / KILLER / "1" / "model.py").write_text(KILLER_PY)
    c = Cluster(tmp, repo, ENV)
    c.start_redis()
    c.start_gateway()
    c.start_worker()
    c.start_worker()
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def _thawed(cluster: Cluster) -> Iterator[None]:
    """Whatever a test does, it leaves no worker frozen: a failure must not cascade into the next tests."""
    yield
    _freeze(cluster, False)


def _body(value: float) -> dict[str, object]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}


async def _infer(c: Cluster, value: float, model: str = MODEL, *, conn: Connection | None = None,
                 timeout_s: float = 60) -> tuple[int, object, float]:
    """(status, OUT value or error, seconds) on `conn` or a connection of its own; a transport error or
    giving up after timeout_s (the connection is then closed: a client that went away) is status 0."""
    own = conn is None
    conn = conn or Connection("127.0.0.1", c.http_port)
    t0 = time.monotonic()
    try:
        status, _, payload = await asyncio.wait_for(conn.post(f"/v2/models/{model}/infer", _body(value)), timeout_s)
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        conn.close()
        return 0, repr(exc), time.monotonic() - t0
    finally:
        if own:
            conn.close()
    doc = json.loads(payload)
    out = doc["outputs"][0]["data"][0] if status == 200 else doc.get("error")
    return status, out, time.monotonic() - t0


def _redis(c: Cluster) -> redis.Redis:
    return redis.Redis.from_url(c.redis_url, protocol=2, decode_responses=True)


def _stop_redis(c: Cluster) -> None:
    assert c.redis is not None
    c.redis.stop()  # SIGTERM: the server writes its AOF out and exits


def _freeze(c: Cluster, frozen: bool) -> None:
    for w in c.workers:
        if w.poll() is None:
            w.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)


async def _until(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _queue_while_frozen(c: Cluster, n: int) -> list[asyncio.Task[tuple[int, object, float]]]:
    """Freeze the workers and send n requests (values 0..n-1); returns once all n are queued in Redis."""
    _freeze(c, True)
    tasks = [asyncio.create_task(_infer(c, float(i))) for i in range(n)]
    r = _redis(c)

    def queued() -> bool:
        early = [t.result() for t in tasks if t.done()]
        assert not early, f"answered before any worker could run them: {early[:3]}"
        return bool(r.xlen(KEYS.queue(MODEL)) == n)

    try:
        await _until(queued, 60, f"{n} requests queued")
    except AssertionError:
        raise AssertionError(f"{r.xlen(KEYS.queue(MODEL))} of {n} requests queued after 60 s:\n{c.logs()}") from None
    finally:
        r.close()
    return tasks


def _assert_drained(r: redis.Redis, model: str = MODEL) -> None:
    """Nothing left behind: no queued or pending message, no dead letter."""
    for lane in range(2):
        stream = KEYS.queue(model, lane)
        assert r.xlen(stream) == 0, f"{stream} still holds {r.xlen(stream)} entries"
        if r.exists(stream):
            assert r.xpending(stream, GROUP)["pending"] == 0
    assert r.xlen(KEYS.dead(model)) == 0


def _unclaimed_replies(c: Cluster) -> int:
    """Replies the gateway dropped because nobody waited for them any more (duplicates, or late)."""
    text = httpx.get(f"{c.base_url}/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("fleet_unclaimed_replies_total")]
    return int(float(line.split()[-1]))


def _executions(c: Cluster, model: str = MODEL) -> int:
    doc = httpx.get(f"{c.base_url}/v2/models/{model}/stats").json()
    return int(doc["model_stats"][0]["inference_count"])


def test_sigkill_a_worker_with_1000_requests_in_flight(cluster: Cluster) -> None:
    """All 1,000 answered, each once, each with its own value; the victim's messages are claimed."""
    r = _redis(cluster)
    victim = cluster.workers[1]
    before, dropped_before = _executions(cluster), _unclaimed_replies(cluster)

    async def main() -> dict[str, float]:
        tasks = await _queue_while_frozen(cluster, 1000)
        _freeze(cluster, False)
        stream = KEYS.queue(MODEL)

        def victim_holds() -> int:
            return sum(int(x["pending"]) for x in r.xinfo_consumers(stream, GROUP)
                       if f"-{victim.pid}-" in x["name"])

        await _until(lambda: victim_holds() >= 16, 10, "the victim to hold a batch or more")
        held = victim_holds()
        victim.kill()
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks)
        recovered_s = time.monotonic() - killed_at
        assert [s for s, _, _ in results] == [200] * 1000, {s for s, _, _ in results}
        assert [v for _, v, _ in results] == [float(i) for i in range(1000)]
        return {"held_by_victim": held, "recovery_s": recovered_s}

    figures = asyncio.run(main())
    victim.wait(10)
    cluster.workers.remove(victim)
    _assert_drained(r)
    computed = _executions(cluster) - before
    dropped = _unclaimed_replies(cluster) - dropped_before
    print(f"\nSIGKILL worker: 1000 in flight, {figures['held_by_victim']:.0f} held by the victim, "
          f"0 lost, each answered once, {computed - 1000} computed twice ({dropped} duplicate replies dropped "
          f"by the gateway), all answered {figures['recovery_s']:.2f} s after the kill")
    assert computed >= 1000 and dropped == computed - 1000
    cluster.start_worker()  # back to two for the next tests
    cluster.wait_ready()


def test_redis_restart_with_aof_loses_nothing_queued(cluster: Cluster) -> None:
    """Requests queued when Redis restarts are answered after it; requests sent while it is down fail
    fast with 503; nothing hangs."""
    assert cluster.redis is not None

    async def main() -> None:
        queued = await _queue_while_frozen(cluster, 300)
        _stop_redis(cluster)  # SIGTERM: the server writes its AOF out and exits
        down_at = time.monotonic()
        during = await asyncio.gather(*(_infer(cluster, -1.0) for _ in range(20)))
        assert all(s == 503 and t < 1.0 for s, _, t in during), during
        await asyncio.sleep(1.0 - (time.monotonic() - down_at))  # a 1 s outage (< FLEET_REDIS_OUTAGE_S)
        cluster.redis = start_server(cluster.tmp / "redis", cluster.redis_port, appendonly=True)
        outage_s = time.monotonic() - down_at
        _freeze(cluster, False)
        results = await asyncio.gather(*queued)
        assert [s for s, _, _ in results] == [200] * 300, [x for x in results if x[0] != 200][:3]
        assert [v for _, v, _ in results] == [float(i) for i in range(300)]
        print(f"\nRedis restart (AOF): 300 queued, {outage_s:.2f} s down, 300 answered after it, "
              f"20 sent meanwhile got 503 in at most {max(t for _, _, t in during) * 1000:.0f} ms")

    asyncio.run(main())
    _assert_drained(_redis(cluster))


def test_a_long_redis_outage_fails_waiting_requests_fast(cluster: Cluster) -> None:
    """Redis away longer than FLEET_REDIS_OUTAGE_S (2 s here): callers waiting get 503 then, not at their
    30 s timeout; once it is back, requests are served again."""
    assert cluster.redis is not None

    async def main() -> None:
        waiting = await _queue_while_frozen(cluster, 50)
        _stop_redis(cluster)
        results = await asyncio.gather(*waiting)
        assert all(s == 503 and "unreachable" in str(v) for s, v, _ in results), results[:3]
        assert max(t for _, _, t in results) < 5, max(t for _, _, t in results)
        print(f"\nRedis away > FLEET_REDIS_OUTAGE_S=2: 50 waiting callers got 503 after "
              f"{min(t for _, _, t in results):.2f}-{max(t for _, _, t in results):.2f} s (their timeout: 30 s)")
        cluster.redis = start_server(cluster.tmp / "redis", cluster.redis_port, appendonly=True)
        _freeze(cluster, False)

    asyncio.run(main())
    cluster.wait_ready()
    assert asyncio.run(_infer(cluster, 5.0))[:2] == (200, 5.0)
    r = _redis(cluster)
    asyncio.run(_until(lambda: r.xlen(KEYS.queue(MODEL)) == 0, 10, "the queued ones to be computed anyway"))


def test_redis_restart_under_live_load_never_hangs(cluster: Cluster) -> None:
    """Load running through a restart: each request is answered with its value or 503, within its
    timeout, and service resumes."""
    assert cluster.redis is not None
    outcomes: list[tuple[int, object, float]] = []

    async def load(start: int, stop_at: float) -> None:
        conn = Connection("127.0.0.1", cluster.http_port)
        i = start
        try:
            while time.monotonic() < stop_at:
                status, value, took = await _infer(cluster, float(i), conn=conn)
                outcomes.append((status, value == float(i), took))
                i += 1000
                if status != 200:
                    await asyncio.sleep(0.05)  # a client backing off, not spinning on 503s
        finally:
            conn.close()

    async def main() -> None:
        stop_at = time.monotonic() + 6
        loaders = [asyncio.create_task(load(k, stop_at)) for k in range(32)]
        await asyncio.sleep(1.5)
        _stop_redis(cluster)
        await asyncio.sleep(1.0)
        cluster.redis = start_server(cluster.tmp / "redis", cluster.redis_port, appendonly=True)
        await asyncio.wait_for(asyncio.gather(*loaders), 60)
        assert (await _infer(cluster, 7.0))[:2] == (200, 7.0)

    asyncio.run(main())
    statuses = {s for s, _, _ in outcomes}
    assert statuses <= {200, 503}, statuses
    assert all(ok for s, ok, _ in outcomes if s == 200)
    assert max(t for _, _, t in outcomes) < 30
    ok = sum(1 for s, _, _ in outcomes if s == 200)
    print(f"\nRedis restart under load: {len(outcomes)} requests, {ok} answered, {len(outcomes) - ok} 503, "
          f"slowest {max(t for _, _, t in outcomes):.2f} s")
    cluster.wait_ready()


def test_client_disconnect_cancels_the_request(cluster: Cluster) -> None:
    """A caller that goes away: its request is deleted from the stream if unread, or dropped from the
    worker's queue if read ahead; either way never computed."""
    r = _redis(cluster)
    before = _executions(cluster, SLOW)

    async def main() -> None:
        # One per worker: both instances are busy for 1 s.
        first = [asyncio.create_task(_infer(cluster, 1.0, SLOW)) for _ in range(2)]
        await asyncio.sleep(0.2)
        gone = await asyncio.gather(*(_infer(cluster, 2.0, SLOW, timeout_s=0.5) for _ in range(4)))
        assert all(s == 0 for s, _, _ in gone)  # the client gave up
        await _until(lambda: r.xlen(KEYS.queue(SLOW)) <= 2, 5, "the abandoned requests to be dropped")
        assert [x[:2] for x in await asyncio.gather(*first)] == [(200, 1.0)] * 2
        await asyncio.sleep(1.5)

    asyncio.run(main())
    assert _executions(cluster, SLOW) - before == 2
    _assert_drained(r, SLOW)


def test_sigterm_a_worker_under_load_loses_nothing(cluster: Cluster) -> None:
    """The worker drains: it answers what it holds and exits 0; the other serves the rest."""
    leaving = cluster.workers[0]

    async def main() -> None:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(_infer(cluster, float(i))) for i in range(600)]
        await asyncio.sleep(0.5)
        leaving.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
        took = time.monotonic() - t0
        assert [s for s, _, _ in results] == [200] * 600, ([x for x in results if x[0] != 200], took,
                                                           sorted(t for _, _, t in results)[-10:])
        assert [v for _, v, _ in results] == [float(i) for i in range(600)]

    asyncio.run(main())
    assert leaving.wait(15) in STOPPED_BY_SIGTERM, cluster.logs()
    cluster.workers.remove(leaving)
    _assert_drained(_redis(cluster))
    cluster.start_worker()
    cluster.wait_ready()


def test_sigterm_the_gateway_answers_what_it_accepted(cluster: Cluster) -> None:
    """The gateway stops accepting, answers every request in flight, then exits 0."""
    gateway = cluster.gateway
    assert gateway is not None

    async def main() -> None:
        tasks = await _queue_while_frozen(cluster, 200)
        gateway.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert gateway.poll() is None  # still answering what it holds
        _freeze(cluster, False)
        results = await asyncio.gather(*tasks)
        assert [s for s, _, _ in results] == [200] * 200
        assert [v for _, v, _ in results] == [float(i) for i in range(200)]

    asyncio.run(main())
    assert gateway.wait(15) in STOPPED_BY_SIGTERM
    cluster.start_gateway()
    cluster.wait_ready()



def test_an_oversized_request_head_is_431_before_it_is_buffered(cluster: Cluster) -> None:
    """uvicorn sets no limit on headers; the gateway answers 431 once a head passes FLEET_MAX_HEADER_BYTES
    (64 KiB) instead of buffering it whole, and a large but legal head still works."""
    import select
    import socket

    def send_head(header_bytes: int) -> tuple[bytes, int]:
        """(the answer, bytes sent before it came): the head goes out in 64 KiB pieces, stopping as soon
        as the gateway has answered (it closes the connection after a 431)."""
        head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * header_bytes + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=10) as s:
            sent = 0
            while sent < len(head) and not select.select([s], [], [], 0.01)[0]:
                sent += s.send(head[sent:sent + 65536])
            return s.recv(4096), sent

    assert send_head(8_000)[0].startswith(b"HTTP/1.1 200")
    answer, sent = send_head(20_000_000)
    assert answer.startswith(b"HTTP/1.1 431") and b"exceed the limit of 65536 bytes" in answer
    assert sent < 2_000_000  # answered long before the 20 MB head was through
    assert asyncio.run(_infer(cluster, 3.0))[:2] == (200, 3.0)


def test_a_request_that_kills_every_worker_ends_in_the_dead_letters(cluster: Cluster) -> None:
    """Each worker that takes it dies (SIGKILL); the test restarts them as a supervisor would. After
    max_deliveries (3) the next claimer dead-letters it and its caller gets a clear error, not a loop."""
    r = _redis(cluster)

    async def main() -> tuple[int, object, float]:
        poison = asyncio.create_task(_infer(cluster, -1.0, KILLER))
        deaths = 0
        while not poison.done():
            for w in list(cluster.workers):
                if w.poll() is not None:
                    deaths += 1
                    cluster.workers.remove(w)
                    cluster.start_worker()  # the supervisor
            assert deaths <= 3, "delivered more than max_deliveries times"
            await asyncio.sleep(0.1)
        print(f"\nworker-killing request: {deaths} workers died, then dead-lettered; "
              f"its caller answered after {poison.result()[2]:.1f} s")
        return poison.result()

    status, error, _ = asyncio.run(main())
    assert status == 500 and "delivered 4 times" in str(error) and "dead letters" in str(error), (status, error)
    letters: Any = redis.Redis.from_url(cluster.redis_url).xrange(KEYS.dead(KILLER))  # bytes: it holds the payload
    (letter,) = letters
    assert b"delivered 4 times" in letter[1][b"reason"]
    r.delete(KEYS.dead(KILLER))
    cluster.wait_ready()
    assert asyncio.run(_infer(cluster, 4.0, KILLER))[:2] == (200, 4.0)


def test_a_killed_gateway_loses_nothing_workers_hold(cluster: Cluster) -> None:
    """SIGKILL the gateway with requests queued: its clients see their connections close; the workers
    still compute and answer what was queued (to a reply stream that expires), and a new gateway serves."""
    gateway = cluster.gateway
    assert gateway is not None
    r = _redis(cluster)
    reply_keys = set(r.keys(f"{KEYS.prefix}:reply:*"))

    async def main() -> None:
        tasks = await _queue_while_frozen(cluster, 50)
        gateway.kill()
        results = await asyncio.gather(*tasks)
        assert all(status == 0 for status, _, _ in results)  # connections closed, no answer invented
        _freeze(cluster, False)
        await _until(lambda: r.xlen(KEYS.queue(MODEL)) == 0, 30, "the queued requests to be computed")

    asyncio.run(main())
    gateway.wait(10)
    (dead_stream,) = reply_keys  # the dead gateway's: still there, holding the 50 replies, and expiring
    entries: Any = redis.Redis.from_url(cluster.redis_url).xrange(dead_stream)  # bytes: encoded replies
    assert sum(len(fields) - int(b"hello" in fields) for _, fields in entries) >= 50
    assert 0 < r.ttl(dead_stream) <= 120
    cluster.start_gateway()
    cluster.wait_ready()
    assert asyncio.run(_infer(cluster, 6.0))[:2] == (200, 6.0)
