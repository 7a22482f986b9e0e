"""Fault injection against real processes: Redis (AOF), one gateway and two workers, each signalled by
PID. Every accepted request must end in exactly one reply with its own value, whatever is killed.

Workers are frozen with SIGSTOP (as a stalled host would be) to pile requests up deterministically
before a fault; their heartbeat TTL is long enough that the gateway keeps routing to them meanwhile.
Freezing one worker for longer than a read's BLOCK also chooses which worker reads what comes next.
Computations are counted with the models' statistics (`inference_count`, summed across workers), so
a request computed twice shows even when the gateway drops the duplicate reply.
The figures each test prints (`-s`) are the ones quoted in bench/RESULTS.md, "Reliability".
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.rawhttp import Connection
from fleet.keys import GROUP, Keys
from fleet.redis_server import free_port, start_server
from tests.support.processes import Cluster
from tests.support.queue_models import SLEEPER
from tests.support.timed_repo import TIMED

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
# Timed models (tests/support/timed_model.py): each execution sleeps IN[0] ms; OUT = IN, with the stub's
# PID and the execution's CLOCK_MONOTONIC interval. Requests here send IN = [sleep ms, value]. One model
# per test: a worker's claim timeout follows the longest batch it has seen of a model (4x, floor 1 s),
# so a model no claimer has run yet is claimed after 1 s.
DRAIN = "drain"  # batches of up to 8 (a worker drained under load)
LONG = "long"  # one request at a time (keepalive: a batch 3x the claim timeout)
LONG_DRAIN = "long_drain"  # the same, for a worker draining one
HANDOVER = "handover"  # batches of up to 4 (a frozen worker taken over)
ORPHANS = "orphans"  # batches of up to 8 (a dead worker's messages under saturation)
WRITES = "writes"  # batches of up to 8 (replies written after an outage, refused for memory)
DELAYED = "delayed"  # waits max_queue_delay (200 ms) for a batch of 16 that never comes
DEADLINE = "deadline"  # REJECT after 300 ms in the queue
BATCHERS = {
    DRAIN: (8, "preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 100000"),
    LONG: (1, None),
    LONG_DRAIN: (1, None),
    HANDOVER: (4, "preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100000"),
    ORPHANS: (8, "preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 100000"),
    WRITES: (8, "preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 100000"),
    DELAYED: (16, "preferred_batch_size: [ 16 ] max_queue_delay_microseconds: 200000"),
    DEADLINE: (4, "default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 300000 }"),
}
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
CLAIMED = "after another worker left it"  # what a worker logs for each message it claims
# FLEET_CLAIM_MIN_MS: the claim timeout for a model the claimer has not seen run long (4x its longest recent
# batch otherwise, fleet/claims.py: a lower bound either way)
CLAIM_TIMEOUT_S = 1.0
BLOCK_S = 0.2  # FLEET_BLOCK_MS
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


def _timed_model(repo: Path, name: str, *, max_batch_size: int, batcher: str | None) -> None:
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(TIMED, repo / name / "1" / "model.py")
    scalars = ", ".join(f'{{ name: "{n}", data_type: TYPE_INT64, dims: [ 1 ] }}'
                        for n in ("PID", "START_NS", "END_NS", "POSITION"))
    (repo / name / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }}, {scalars} ]
{"" if batcher is None else f"dynamic_batching {{ {batcher} }}"}
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
""")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("faults")
    repo = tmp / "models"
    _model(repo, MODEL, sleep_ms=20, max_batch_size=16)
    _model(repo, SLOW, sleep_ms=1000, max_batch_size=1)
    _model(repo, KILLER, sleep_ms=0, max_batch_size=1)
    (repo / KILLER / "1" / "model.py").write_text(KILLER_PY)
    for name, (max_batch_size, batcher) in BATCHERS.items():
        _timed_model(repo, name, max_batch_size=max_batch_size, batcher=batcher)
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
def _restored(cluster: Cluster) -> Iterator[None]:
    """Whatever a test does, the next one finds the cluster whole: no worker frozen, Redis up, the
    gateway and two workers running (a test that kills one and fails must not cascade)."""
    yield
    _freeze(cluster, False)
    changed = False
    if cluster.redis is None or cluster.redis.process.poll() is not None:
        cluster.redis = start_server(cluster.tmp / "redis", cluster.redis_port, appendonly=True)
        changed = True
    for gone in [w for w in cluster.workers if w.poll() is not None]:
        cluster.workers.remove(gone)
    while len(cluster.workers) < 2:
        cluster.start_worker()
        changed = True
    if cluster.gateway is None or cluster.gateway.poll() is not None:
        cluster.start_gateway()
        changed = True
    if changed:
        cluster.wait_ready()


def _body(value: float) -> dict[str, object]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}


async def _post(port: int, model: str, body: dict[str, Any], *, conn: Connection | None = None,
                timeout_s: float = 60) -> tuple[int, Any, float]:
    """(status, response document or transport error, seconds) on `conn` or a connection of its own; a
    transport error or giving up after timeout_s (the connection is then closed: a client that went
    away) is status 0."""
    own = conn is None
    conn = conn or Connection("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        status, _, payload = await asyncio.wait_for(conn.post(f"/v2/models/{model}/infer", body), timeout_s)
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        conn.close()
        return 0, repr(exc), time.monotonic() - t0
    finally:
        if own:
            conn.close()
    return status, json.loads(payload), time.monotonic() - t0


async def _infer(c: Cluster, value: float, model: str = MODEL, *, conn: Connection | None = None,
                 timeout_s: float = 60, port: int | None = None) -> tuple[int, object, float]:
    """(status, OUT value or error, seconds): see _post."""
    status, doc, took = await _post(port or c.http_port, model, _body(value), conn=conn, timeout_s=timeout_s)
    if status == 0:
        return status, doc, took
    out = doc["outputs"][0]["data"][0] if status == 200 else doc.get("error")
    return status, out, took


@dataclass(frozen=True)
class Ran:
    """A timed model's answer: status, OUT's value (or the error), when the caller got it (monotonic), and
    where and when it was computed (the stub's PID; CLOCK_MONOTONIC, the same clock as time.monotonic)."""

    status: int
    value: object
    took_s: float
    done_at: float
    pid: int = 0
    start_s: float = 0.0
    end_s: float = 0.0


async def _timed(c: Cluster, model: str, sleep_ms: float, value: float, *, port: int | None = None,
                 conn: Connection | None = None) -> Ran:
    body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [sleep_ms, value]}]}
    status, doc, took = await _post(port or c.http_port, model, body, conn=conn)
    if status != 200:
        return Ran(status, doc if status == 0 else doc.get("error"), took, time.monotonic())
    out = {o["name"]: o["data"] for o in doc["outputs"]}
    return Ran(status, out["OUT"][1], took, time.monotonic(), int(out["PID"][0]), out["START_NS"][0] / 1e9,
               out["END_NS"][0] / 1e9)


def _redis(c: Cluster) -> redis.Redis:
    return redis.Redis.from_url(c.redis_url, protocol=2, decode_responses=True)


def _stop_redis(c: Cluster) -> None:
    assert c.redis is not None
    c.redis.stop()  # SIGTERM: the server writes its AOF out and exits


def _freeze(c: Cluster, frozen: bool) -> None:
    for w in c.workers:
        if w.poll() is None:
            w.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)


async def _freeze_one(worker: subprocess.Popen[bytes]) -> None:
    """Freeze `worker` and wait until its reads in flight (XREADGROUP ... BLOCK) have timed out: from then
    on it takes nothing new, so the other worker reads what is sent next."""
    worker.send_signal(signal.SIGSTOP)
    await asyncio.sleep(BLOCK_S + 0.15)


def _thaw(worker: subprocess.Popen[bytes]) -> None:
    worker.send_signal(signal.SIGCONT)


def _held_by(r: redis.Redis, model: str, worker: subprocess.Popen[bytes]) -> int:
    """Messages of `model` pending for `worker` (its consumer name carries its PID) in Redis."""
    held = 0
    for lane in range(2):
        try:
            consumers: Any = r.xinfo_consumers(KEYS.queue(model, lane, version=1), GROUP)
        except redis.ResponseError:
            continue  # no group yet
        held += sum(int(x["pending"]) for x in consumers if f"-{worker.pid}-" in x["name"])
    return held


def _pending(r: redis.Redis, model: str) -> int:
    return sum(int(r.xpending(KEYS.queue(model, lane, version=1), GROUP)["pending"]) for lane in range(2)
               if r.exists(KEYS.queue(model, lane, version=1)))


def _log_marks(c: Cluster) -> dict[int, int]:
    """Where each worker's log ends now: what `_logged_since` looks at."""
    return {w.pid: len(c.log_of(w)) for w in c.workers}


def _logged_since(c: Cluster, marks: dict[int, int]) -> str:
    return "".join(c.log_of(w)[marks.get(w.pid, 0):] for w in c.workers)


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
        return bool(r.xlen(KEYS.queue(MODEL, version=1)) == n)

    try:
        await _until(queued, 60, f"{n} requests queued")
    except AssertionError:
        queued_now = r.xlen(KEYS.queue(MODEL, version=1))
        raise AssertionError(f"{queued_now} of {n} requests queued after 60 s:\n{c.logs()}") from None
    finally:
        r.close()
    return tasks


def _assert_drained(r: redis.Redis, model: str = MODEL) -> None:
    """Nothing left behind: no queued or pending message, no dead letter. A worker acknowledges a message
    once its reply is written, a round trip after its caller may have it: allowed a moment."""
    deadline = time.monotonic() + 5
    for lane in range(2):
        stream = KEYS.queue(model, lane, version=1)
        while r.xlen(stream) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.xlen(stream) == 0, f"{stream} still holds {r.xlen(stream)} entries"
        if r.exists(stream):
            assert r.xpending(stream, GROUP)["pending"] == 0
    assert r.xlen(KEYS.dead(model)) == 0


def _unclaimed_replies(c: Cluster, base_url: str | None = None) -> int:
    """Replies the gateway (the cluster's, or the one at base_url) dropped because nobody waited for them
    any more (duplicates, or late)."""
    text = httpx.get(f"{base_url or c.base_url}/metrics").text
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
        stream = KEYS.queue(MODEL, version=1)

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


def test_a_dead_workers_messages_are_served_first_by_a_saturated_worker(cluster: Cluster) -> None:
    """A worker holding 24 requests (3 claim rounds: a saturated worker claims one batch past its bound
    at a time) is SIGKILLed while the other is saturated by 40 clients sending without pause. The orphans
    are older than anything new: each is answered within the claim timeout plus a few batch times, not
    once the new traffic stops; every answer, orphan or new, carries its own value."""
    victim, heir = cluster.workers
    r = _redis(cluster)

    async def client(k: int, stop: asyncio.Event, out: list[tuple[Ran, float]]) -> None:
        conn = Connection("127.0.0.1", cluster.http_port)
        try:
            for j in range(100_000):
                if stop.is_set():
                    return
                value = float(1000 * (k + 1) + j)
                out.append((await _timed(cluster, ORPHANS, 100, value, conn=conn), value))
        finally:
            conn.close()

    async def main() -> tuple[list[Ran], float, list[tuple[Ran, float]], int]:
        await _freeze_one(heir)
        orphans = [asyncio.create_task(_timed(cluster, ORPHANS, 100, float(i))) for i in range(24)]
        await _until(lambda: _held_by(r, ORPHANS, victim) == 24, 10, "the victim to read all 24")
        victim.kill()
        killed_at = time.monotonic()
        stop, traffic = asyncio.Event(), list[tuple[Ran, float]]()
        clients = [asyncio.create_task(client(k, stop, traffic)) for k in range(40)]
        await asyncio.sleep(0.2)  # the new traffic is queued before the heir thaws
        _thaw(heir)
        await asyncio.wait(orphans, timeout=12)
        stop.set()
        unanswered = sum(not t.done() for t in orphans)
        await asyncio.gather(*clients)
        return list(await asyncio.wait_for(asyncio.gather(*orphans), 30)), killed_at, traffic, unanswered

    runs, killed_at, traffic, unanswered = asyncio.run(main())
    victim.wait(10)
    assert unanswered == 0, (f"{unanswered} of 24 orphans unanswered 12 s after the kill while new traffic "
                             f"was served; the last answered {max(x.done_at for x in runs) - killed_at:.1f} s "
                             "after the kill, once the traffic stopped")
    assert [(x.status, x.value) for x in runs] == [(200, float(i)) for i in range(24)], runs
    assert all(ran.status == 200 and ran.value == value for ran, value in traffic), \
        [x for x in traffic if x[0].status != 200 or x[0].value != x[1]][:3]
    latest = max(x.done_at for x in runs) - killed_at
    new_meanwhile = sum(1 for ran, _ in traffic if ran.done_at < killed_at + latest)
    # Claimable once idle for the claim timeout (counted from the victim's last keepalive, 0.25 s before
    # at most); then 3 rounds, each a claim interval (0.25 s) and a batch (0.1 s), and room to spare for
    # a loaded host: still below the ~12 s the traffic runs, after which "served first" would be moot.
    bound_s = CLAIM_TIMEOUT_S + 3 * (0.25 + 0.1) + 7.0
    print(f"\nSIGKILL with the heir saturated: 24 orphans, all answered {latest:.2f} s after the kill "
          f"(bound {bound_s:.2f} s), {new_meanwhile} new requests answered meanwhile, {len(traffic)} in all")
    assert latest < bound_s, (latest, cluster.log_of(heir)[-3000:])
    assert new_meanwhile > 0  # the heir was serving new traffic all along
    _assert_drained(r, ORPHANS)  # and none was dead-lettered: delivery counts are exact


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
        # Counted from each request's send, before Redis stopped: far below their 30 s timeout either way.
        assert max(t for _, _, t in results) < 10, max(t for _, _, t in results)
        print(f"\nRedis away > FLEET_REDIS_OUTAGE_S=2: 50 waiting callers got 503 after "
              f"{min(t for _, _, t in results):.2f}-{max(t for _, _, t in results):.2f} s (their timeout: 30 s)")
        cluster.redis = start_server(cluster.tmp / "redis", cluster.redis_port, appendonly=True)
        _freeze(cluster, False)

    asyncio.run(main())
    cluster.wait_ready()
    assert asyncio.run(_infer(cluster, 5.0))[:2] == (200, 5.0)
    r = _redis(cluster)
    asyncio.run(_until(lambda: r.xlen(KEYS.queue(MODEL, version=1)) == 0, 10, "the queued ones to be computed anyway"))


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


def test_replies_computed_while_redis_is_away_are_written_after_it(cluster: Cluster) -> None:
    """A batch executing when Redis stops (SIGTERM: its AOF is written) finishes while Redis is away; once
    Redis is back (within FLEET_REDIS_OUTAGE_S) its replies are written and each caller gets the one
    computed during the outage. The other worker is frozen meanwhile: nobody else could answer them."""
    computer, other = cluster.workers
    r = _redis(cluster)
    before, dropped_before = _executions(cluster, WRITES), _unclaimed_replies(cluster)

    async def main() -> tuple[list[Ran], float, float]:
        await _freeze_one(other)
        tasks = [asyncio.create_task(_timed(cluster, WRITES, 1000, float(i))) for i in range(8)]
        await _until(lambda: _held_by(r, WRITES, computer) == 8, 10, "the worker to read all 8")
        await asyncio.sleep(0.1)  # the batch of 8 is executing
        _stop_redis(cluster)
        down_at = time.monotonic()
        await asyncio.sleep(1.3)  # the batch ends at ~1 s, with Redis away
        cluster.redis = start_server(cluster.tmp / "redis", cluster.redis_port, appendonly=True)
        up_at = time.monotonic()
        runs = list(await asyncio.gather(*tasks))
        _thaw(other)
        return runs, down_at, up_at

    runs, down_at, up_at = asyncio.run(main())
    assert [(x.status, x.value) for x in runs] == [(200, float(i)) for i in range(8)], (runs, cluster.logs())
    # Computed across the outage (ended while Redis was away; on a loaded host the batch may have started
    # just after Redis stopped, which changes nothing here: the worker holds the messages either way).
    assert all(down_at < x.end_s < up_at for x in runs), (down_at, up_at, runs)
    print(f"\nbatch computed across a {up_at - down_at:.2f} s Redis outage: its 8 replies written "
          f"{max(x.done_at for x in runs) - up_at:.2f} s after Redis was back")
    r = _redis(cluster)
    assert (_executions(cluster, WRITES) - before, _unclaimed_replies(cluster) - dropped_before) == (8, 0)
    _assert_drained(r, WRITES)
    cluster.wait_ready()


def test_replies_refused_for_memory_stay_pending_until_written(cluster: Cluster) -> None:
    """Redis over maxmemory (noeviction; set well below the memory in use, so that no write slips through
    as client buffers come and go) while a batch computes: its replies are refused, so its messages stay
    pending, neither acknowledged nor deleted. Once maxmemory is lifted every request is answered once,
    with its value, from that one computation."""
    r = _redis(cluster)
    before, dropped_before = _executions(cluster, WRITES), _unclaimed_replies(cluster)
    policy = str(r.config_get("maxmemory-policy")["maxmemory-policy"])

    async def main() -> tuple[list[Ran], float]:
        tasks = [asyncio.create_task(_timed(cluster, WRITES, 1000, float(i))) for i in range(8)]
        await _until(lambda: _pending(r, WRITES) == 8, 10, "all 8 to be read")
        await asyncio.sleep(0.1)  # the batch of 8 is executing
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) // 2))
        try:
            with pytest.raises(redis.ResponseError, match="maxmemory"):
                r.xadd(f"{KEYS.prefix}:probe", {"x": "1"})
            await asyncio.sleep(2.0)  # the batch ended 1 s ago: its replies have been refused since
            assert not [t.result() for t in tasks if t.done()]
            # not acknowledged, not deleted
            assert _pending(r, WRITES) == 8 and r.xlen(KEYS.queue(WRITES, version=1)) == 8
        finally:
            r.config_set("maxmemory", "0")
            r.config_set("maxmemory-policy", policy)
        lifted_at = time.monotonic()
        return list(await asyncio.gather(*tasks)), lifted_at

    runs, lifted_at = asyncio.run(main())
    assert [(x.status, x.value) for x in runs] == [(200, float(i)) for i in range(8)], runs
    assert all(x.end_s < lifted_at for x in runs)
    print(f"\nreplies refused for memory for 2 s: 8 pending meanwhile, all answered "
          f"{max(x.done_at for x in runs) - lifted_at:.2f} s after maxmemory was lifted")
    assert (_executions(cluster, WRITES) - before, _unclaimed_replies(cluster) - dropped_before) == (8, 0)
    _assert_drained(r, WRITES)


def test_client_disconnect_cancels_the_request(cluster: Cluster) -> None:
    """A caller that goes away: its request is deleted from the stream if unread, or dropped from the
    worker's queue if read ahead; either way never computed."""
    r = _redis(cluster)
    before = _executions(cluster, SLOW)

    async def main() -> None:
        # Both instances busy for 1 s or more before the callers that go away send anything: a worker
        # reads at most 3 of these 4 (its read-ahead), so each gets one (two sent would both go to one
        # worker now and then, and the idle other would compute an abandoned request at once).
        first = [asyncio.create_task(_infer(cluster, 1.0, SLOW)) for _ in range(4)]
        await _until(lambda: all(_held_by(r, SLOW, w) >= 1 for w in cluster.workers), 5, "each worker to take one")
        gone = await asyncio.gather(*(_infer(cluster, 2.0, SLOW, timeout_s=0.5) for _ in range(4)))
        assert all(s == 0 for s, _, _ in gone)  # the client gave up
        await _until(lambda: r.xlen(KEYS.queue(SLOW, version=1)) <= 4, 5, "the abandoned requests to be dropped")
        assert [x[:2] for x in await asyncio.gather(*first)] == [(200, 1.0)] * 4
        await asyncio.sleep(1.5)  # an abandoned request queued behind them would have run by now

    asyncio.run(main())
    assert _executions(cluster, SLOW) - before == 4
    _assert_drained(r, SLOW)


def test_sigterm_a_worker_under_load_loses_nothing(cluster: Cluster) -> None:
    """The worker drains: it answers what it holds and exits 0 (only the gateway re-raises the signal);
    the other serves the rest; nothing is computed twice. The worker leaving reads far ahead
    (FLEET_READ_AHEAD_BATCHES=20: 168 requests, 2 s of batches), so it drains for longer than the claim
    timeout, and the other worker is idle well before: the leaving one's keepalive must go on while it
    drains, or the other claims and computes again what it still holds."""
    spare, other = cluster.workers
    leaving = cluster.start_worker({"FLEET_READ_AHEAD_BATCHES": "20"})
    cluster.wait_ready()
    r = _redis(cluster)
    marks, before, dropped_before = _log_marks(cluster), _executions(cluster, DRAIN), _unclaimed_replies(cluster)

    async def main() -> tuple[list[Ran], int, float]:
        await _freeze_one(spare)  # two workers serve: the one leaving and the other
        tasks = [asyncio.create_task(_timed(cluster, DRAIN, 100, float(i))) for i in range(200)]
        await _until(lambda: _held_by(r, DRAIN, leaving) >= 100, 10, "the worker to hold 100 or more")
        held = _held_by(r, DRAIN, leaving)
        leaving.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        runs = list(await asyncio.gather(*tasks))
        _thaw(spare)
        return runs, held, signalled_at

    runs, held, signalled_at = asyncio.run(main())
    assert [(x.status, x.value) for x in runs] == [(200, float(i)) for i in range(200)], \
        [x for x in runs if x.status != 200][:3]
    assert leaving.wait(15) == 0, cluster.logs()
    claims = _logged_since(cluster, marks).count(CLAIMED)
    cluster.workers.remove(leaving)
    _assert_drained(r, DRAIN)
    computed, dropped = _executions(cluster, DRAIN) - before, _unclaimed_replies(cluster) - dropped_before
    print(f"\nSIGTERM worker: it held {held} of 200 when signalled, drained for "
          f"{max(x.done_at for x in runs) - signalled_at:.2f} s, exited 0; {claims} claimed by the other, "
          f"{computed - 200} computed twice")
    assert (claims, computed, dropped) == (0, 200, 0)


def test_a_batch_longer_than_the_claim_timeout_is_never_claimed(cluster: Cluster) -> None:
    """Keepalive: a request executing for 3x the claim timeout, with the other worker idle and able to
    claim, is computed once, by the worker that read it; nobody claims it."""
    runner, idle = cluster.workers
    marks, before, dropped_before = _log_marks(cluster), _executions(cluster, LONG), _unclaimed_replies(cluster)
    r = _redis(cluster)

    async def main() -> Ran:
        await _freeze_one(idle)
        task = asyncio.create_task(_timed(cluster, LONG, 3000 * CLAIM_TIMEOUT_S, 1.0))
        await _until(lambda: _held_by(r, LONG, runner) == 1, 10, "the runner to read the request")
        _thaw(idle)
        return await task

    ran = asyncio.run(main())
    assert (ran.status, ran.value) == (200, 1.0), ran
    assert ran.end_s - ran.start_s >= 3 * CLAIM_TIMEOUT_S
    assert CLAIMED not in _logged_since(cluster, marks)
    assert (_executions(cluster, LONG) - before, _unclaimed_replies(cluster) - dropped_before) == (1, 0)
    _assert_drained(r, LONG)


def test_a_draining_worker_keeps_its_messages_until_answered(cluster: Cluster) -> None:
    """SIGTERM while a long batch executes and another waits behind it: keepalive goes on until the last
    held message is acknowledged (3 s, 3x the claim timeout), so the idle worker never claims them;
    each is computed once and the worker exits 0."""
    leaving, idle = cluster.workers
    marks, before, dropped_before = _log_marks(cluster), _executions(cluster, LONG_DRAIN), _unclaimed_replies(cluster)
    r = _redis(cluster)

    async def main() -> list[Ran]:
        await _freeze_one(idle)
        tasks = [asyncio.create_task(_timed(cluster, LONG_DRAIN, 1500 * CLAIM_TIMEOUT_S, float(i))) for i in range(2)]
        await _until(lambda: _held_by(r, LONG_DRAIN, leaving) == 2, 10, "the worker to read both")
        _thaw(idle)
        await asyncio.sleep(0.1)  # the first one is executing
        leaving.send_signal(signal.SIGTERM)
        return list(await asyncio.gather(*tasks))

    runs = asyncio.run(main())
    assert [(x.status, x.value) for x in runs] == [(200, 0.0), (200, 1.0)], runs
    assert leaving.wait(15) == 0, cluster.logs()
    assert {x.pid for x in runs} == {runs[0].pid}  # both computed by the worker that was draining
    assert CLAIMED not in _logged_since(cluster, marks)
    assert (_executions(cluster, LONG_DRAIN) - before, _unclaimed_replies(cluster) - dropped_before) == (2, 0)
    _assert_drained(r, LONG_DRAIN)


@pytest.mark.parametrize("thaw", ["while-the-heir-computes", "after-all-are-answered"])
def test_a_frozen_worker_is_taken_over_and_computes_nothing_again(cluster: Cluster, thaw: str) -> None:
    """One worker frozen (SIGSTOP) while it holds 12 requests (a batch of 4 executing, 4 staged behind it,
    4 queued): the other claims them after the claim timeout and answers each once with its value.
    Thawed - as soon as the other has claimed them (it still computes them: the frozen one must not take
    them back), or once all are answered - the frozen one computes nothing more: at most the batch it
    was executing when frozen is computed twice (its duplicate replies are dropped by the gateway)."""
    frozen, heir = cluster.workers
    r = _redis(cluster)
    before, dropped_before = _executions(cluster, HANDOVER), _unclaimed_replies(cluster)

    async def main() -> tuple[list[Ran], float]:
        await _freeze_one(heir)
        # 600 ms batches: the first (started once 4 were read) must still run when the last is read and
        # the worker is frozen, even on a loaded host.
        tasks = [asyncio.create_task(_timed(cluster, HANDOVER, 600, float(i))) for i in range(12)]
        await _until(lambda: _held_by(r, HANDOVER, frozen) == 12, 10, "the worker to read all 12")
        await asyncio.sleep(0.05)  # its first batch of 4 is executing
        frozen.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        _thaw(heir)
        # The heir claims after 4x the longest batch it has run (2.4 s once it has run this model's 600 ms
        # batches, in the second run), in two rounds: 20 s, within the requests' 30 s.
        await _until(lambda: _held_by(r, HANDOVER, frozen) == 0, 20, "the other worker to claim them")
        if thaw == "while-the-heir-computes":
            _thaw(frozen)
        runs = list(await asyncio.gather(*tasks))
        _thaw(frozen)
        await asyncio.sleep(2.0)  # a keepalive round and more than two batch times: it has done what it does
        return runs, frozen_at

    runs, frozen_at = asyncio.run(main())
    assert [(x.status, x.value) for x in runs] == [(200, float(i)) for i in range(12)], runs
    assert all(x.done_at - frozen_at >= CLAIM_TIMEOUT_S for x in runs)  # all served by the heir, claimed
    computed, dropped = _executions(cluster, HANDOVER) - before, _unclaimed_replies(cluster) - dropped_before
    print(f"\nfrozen worker ({thaw}): 12 held, all answered by the other after the claim timeout, "
          f"{computed - 12} computed twice (allowed: the 4 executing when it froze, and on a loaded machine the 4 "
          f"it had just computed whose replies were still being written)")
    # The batch executing when it froze is computed again by the heir; so is one it finished an instant before
    # if its replies had not reached Redis yet (seen once in a full-suite run, 8). Never the queued 4.
    assert dropped == computed - 12 and 12 <= computed <= 12 + 8, (computed, dropped)
    _assert_drained(r, HANDOVER)


async def _new_connection_fails(port: int) -> str:
    """How a new client fares: "refused" (nothing listens), or the request on its new connection failed
    ("closed", or its status); "" if it was served."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return "refused"
    status, doc, _ = await _post(port, MODEL, _body(9.0), timeout_s=5)
    return "" if status == 200 else ("closed" if status == 0 else str(status))


def test_sigterm_the_gateway_answers_what_it_accepted(cluster: Cluster) -> None:
    """The gateway stops accepting: a new connection is refused while it drains; it answers every
    request in flight, then exits (0, or by the SIGTERM uvicorn re-raises)."""
    gateway = cluster.gateway
    assert gateway is not None

    async def main() -> None:
        tasks = await _queue_while_frozen(cluster, 200)
        gateway.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert gateway.poll() is None  # still answering what it holds
        refused = await _new_connection_fails(cluster.http_port)
        assert refused, "a new connection was served by a gateway draining after SIGTERM"
        _freeze(cluster, False)
        results = await asyncio.gather(*tasks)
        assert [s for s, _, _ in results] == [200] * 200
        assert [v for _, v, _ in results] == [float(i) for i in range(200)]
        print(f"\nSIGTERM gateway: a new connection while it drained: {refused}; 200 in flight answered")

    asyncio.run(main())
    assert gateway.wait(15) in STOPPED_BY_SIGTERM
    cluster.start_gateway()
    cluster.wait_ready()


def test_a_gateway_restarted_with_its_id_never_takes_an_old_reply(cluster: Cluster) -> None:
    """Item 6: a gateway with a fixed FLEET_GATEWAY_ID is SIGKILLed with 50 requests queued (workers
    frozen); a new one with the same id takes 50 new requests, queued behind the old ones. Thawed, the
    workers answer the old ones first, into the same reply stream: each new caller still gets its own
    value, never an old request's."""
    port = free_port()
    env, url = {"FLEET_GATEWAY_ID": "fixed-gw"}, f"http://127.0.0.1:{port}"
    r = _redis(cluster)

    async def send(n: int, first: float) -> list[asyncio.Task[tuple[int, object, float]]]:
        tasks = [asyncio.create_task(_infer(cluster, first + i, port=port)) for i in range(n)]
        queued = r.xlen(KEYS.queue(MODEL, version=1)) + n
        await _until(lambda: r.xlen(KEYS.queue(MODEL, version=1)) == queued, 30, f"{n} requests queued")
        return tasks

    old_gateway = cluster.start_gateway(env, http_port=port)
    cluster.wait_ready(base_url=url)

    async def main() -> tuple[list[tuple[int, object, float]], int]:
        _freeze(cluster, True)
        await asyncio.sleep(BLOCK_S + 0.15)
        old = await send(50, 0.0)
        old_gateway.kill()
        assert all(status == 0 for status, _, _ in await asyncio.gather(*old))
        new_gateway = cluster.start_gateway(env, http_port=port)
        await asyncio.to_thread(cluster.wait_ready, 60.0, url)
        new = await send(50, 1000.0)
        _freeze(cluster, False)
        try:
            results = list(await asyncio.gather(*new))
            await _until(lambda: r.xlen(KEYS.queue(MODEL, version=1)) == 0, 10, "the old requests to be computed")
            await _until(lambda: _unclaimed_replies(cluster, url) >= 50, 5, "the old replies to arrive")
            return results, _unclaimed_replies(cluster, url)
        finally:
            new_gateway.terminate()
            assert new_gateway.wait(15) in STOPPED_BY_SIGTERM

    results, dropped = asyncio.run(main())
    assert [(s, v) for s, v, _ in results] == [(200, 1000.0 + i) for i in range(50)], results[:5]
    assert dropped == 50  # the old replies did reach the new gateway: it dropped them, unclaimed


@pytest.mark.parametrize("offset", ["+0.15", "-0.15"])
def test_a_gateway_clock_offset_moves_no_queue_delay_or_deadline(cluster: Cluster, offset: str) -> None:
    """Item 9: a gateway whose wall clock is 150 ms ahead of or behind the workers' (libfaketime on that
    process only). A lone request still waits max_queue_delay (200 ms) for a batch that never fills,
    not 50 or 350 ms; a REJECT request (300 ms) queued behind a busy instance is answered at 300 ms, not
    150 or 450. The offset is that large so that the bounds leave a loaded host ~90 ms for the rest of
    the path (at 50 ms they left it 35, and failed so)."""
    if not LIBFAKETIME.exists():
        pytest.skip(f"libfaketime is not installed ({LIBFAKETIME}): apt-get install faketime")
    port = free_port()
    gateway = cluster.start_gateway({"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": offset,
                                     "FAKETIME_DONT_FAKE_MONOTONIC": "1"}, http_port=port)
    busy_worker, other = cluster.workers
    r = _redis(cluster)

    async def main() -> tuple[list[float], list[Ran]]:
        waits = []
        for i in range(5):
            sent_at = time.monotonic()
            ran = await _timed(cluster, DELAYED, 0, float(i), port=port)
            assert (ran.status, ran.value) == (200, float(i)), ran
            waits.append(ran.start_s - sent_at)
        await _freeze_one(other)
        busy = asyncio.create_task(_timed(cluster, DEADLINE, 3000, 1.0, port=port))
        await _until(lambda: _held_by(r, DEADLINE, busy_worker) == 1, 10, "the busy request to be read")
        await asyncio.sleep(0.05)
        late = [await _timed(cluster, DEADLINE, 0, 2.0 + i, port=port) for i in range(5)]  # ~1.7 s in all
        _thaw(other)
        assert (await busy).status == 200
        return waits, late

    try:
        cluster.wait_ready(base_url=f"http://127.0.0.1:{port}")
        waits, late = asyncio.run(main())
    finally:
        gateway.terminate()
        gateway.wait(15)
        cluster.extra_gateways.remove(gateway)
    print(f"\ngateway clock {offset} s: lone requests waited {[round(w * 1000) for w in waits]} ms "
          f"(max_queue_delay 200 ms); REJECT requests behind a busy instance got {[x.status for x in late]} "
          f"after {[round(x.took_s * 1000) for x in late]} ms (timeout 300 ms)")
    assert all(x.status == 503 and "timeout" in str(x.value).lower() for x in late), late
    # The fastest of five: a loaded host only adds to each, an offset would move them all.
    assert 0.19 <= min(waits) <= 0.29, waits
    assert 0.29 <= min(x.took_s for x in late) <= 0.39, late


def test_an_oversized_request_head_is_431_before_it_is_buffered(cluster: Cluster) -> None:
    """uvicorn sets no limit on headers; the gateway answers 431 once a head passes FLEET_MAX_HEADER_BYTES
    (64 KiB) instead of buffering it whole, and a large but legal head still works."""
    import select

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
    # The worker parks the message in the same round trip as the caller's reply, ahead of it
    # (workers/custody.py): whoever got the error finds the letter at once.
    raw = redis.Redis.from_url(cluster.redis_url)  # bytes: the letter holds the payload
    letters: Any = raw.xrange(KEYS.dead(KILLER))
    raw.close()
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
        await _until(lambda: r.xlen(KEYS.queue(MODEL, version=1)) == 0, 30, "the queued requests to be computed")

    asyncio.run(main())
    gateway.wait(10)
    (dead_stream,) = reply_keys  # the dead gateway's: still there, holding the 50 replies, and expiring
    entries: Any = redis.Redis.from_url(cluster.redis_url).xrange(dead_stream)  # bytes: encoded replies
    assert sum(len(fields) - int(b"hello" in fields) for _, fields in entries) >= 50
    assert 0 < r.ttl(dead_stream) <= 120
    cluster.start_gateway()
    cluster.wait_ready()
    assert asyncio.run(_infer(cluster, 6.0))[:2] == (200, 6.0)
