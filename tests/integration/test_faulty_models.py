"""Misbehaving Python-backend models (tests/models/misbehaving): a model that raises, returns too few or
too many responses, an output of the wrong type or shape, or segfaults its instance costs only the
request at fault. Batch-mates and later requests are answered, and the worker lives on."""

from __future__ import annotations

import asyncio
import re
import shutil
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from fleet.envelope import RequestEnvelope, WireTensor
from fleet.errors import PoisonRequest
from fleet.keys import Keys
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from fleet.redis_server import LocalServer
from tests.support.system import InProcessSystem, in_process_system
from workers.backends import python_backend
from workers.backends.base import LoadContext
from workers.backends.python_backend import PythonBackend
from workers.execute import run_batch

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "misbehaving"
NAME = "misbehaving"

# IN value -> what the error reply must say (see the model's docstring).
RAISES, TOO_FEW, TOO_MANY, FP64, WRONG_SHAPE, SEGFAULT, NOT_A_RESPONSE = -1, -2, -3, -4, -5, -6, -7
EXPECTED = {
    RAISES: "the model raised on purpose",
    TOO_FEW: "execute() returned 0 responses for 1 requests",
    TOO_MANY: "execute() returned 2 responses for 1 requests",
    FP64: "returned output 'OUT' as FP64, but its config declares INT32",
    WRONG_SHAPE: "returned output 'OUT' with shape [1, 3]",
    NOT_A_RESPONSE: "execute() returned a str where an InferenceResponse was expected",
}
POISON = re.compile(r"the request crashed the model instance \d+ times; moved to the dead letters "
                    r"\(last: the Python model instance .* stopped: killed by SIGSEGV\)")


def spec() -> ModelSpec:
    return parse_config((MODEL_DIR / "config.pbtxt").read_text(), source=str(MODEL_DIR), model_name=NAME)


def envelope(rid: str, value: int) -> RequestEnvelope:
    return RequestEnvelope(id=rid, model=NAME, version=1, reply_to="r", enqueued_at_us=0,
                           inputs=[WireTensor("IN", "INT32", (1, 1), struct.pack("<i", value))])


@pytest.fixture
def backend() -> Iterator[PythonBackend]:
    ctx = LoadContext(spec=spec(), model_dir=MODEL_DIR, version=1, instance_name=f"{NAME}_0", device="cpu",
                      max_deliveries=2)
    b = PythonBackend(ctx)
    try:
        yield b
    finally:
        b.close()


def test_a_batch_isolates_the_request_at_fault(backend: PythonBackend) -> None:
    """Straight through run_batch (no Redis): one error per culprit, innocent batch-mates answered."""
    values = [1, RAISES, 2, TOO_FEW, 3, TOO_MANY, FP64, WRONG_SHAPE, NOT_A_RESPONSE, 4]
    outcome = run_batch(spec(), backend, [envelope(f"r{i}", v) for i, v in enumerate(values)])
    assert [r.id for r in outcome.replies] == [f"r{i}" for i in range(len(values))]
    for value, reply in zip(values, outcome.replies, strict=True):
        if value >= 0:
            assert reply.ok and reply.outputs is not None, reply.error_message
            assert struct.unpack("<i", reply.outputs[0].data) == (value,)
        else:
            assert reply.error_code == "INTERNAL" and EXPECTED[value] in reply.error_message
    assert outcome.poisoned == []


def test_a_crashing_request_is_retried_alone_then_poison(backend: PythonBackend) -> None:
    outcome = run_batch(spec(), backend, [envelope("a", 5), envelope("crash", SEGFAULT), envelope("b", 6)])
    a, crash, b = outcome.replies
    assert a.ok and b.ok and a.outputs and b.outputs
    assert struct.unpack("<i", b.outputs[0].data) == (6,)
    assert crash.error_code == "INTERNAL" and POISON.fullmatch(crash.error_message), crash.error_message
    assert "2 times" in crash.error_message  # max_deliveries of the LoadContext
    assert outcome.poisoned == [1]
    # The restarted instance serves the next batch.
    after = run_batch(spec(), backend, [envelope("c", 7)])
    assert after.replies[0].ok and after.poisoned == []
    assert isinstance(PoisonRequest(3), Exception) and PoisonRequest(3).code.value == "INTERNAL"


def test_an_instance_restarting_after_a_crash_stays_alive(backend: PythonBackend,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog stops advertising a model whose instance is not alive (workers/watchdog.py). A restart
    after a crash is no failed restart: while it runs, here with each stub's spawn slowed as a loaded host
    slows it, the instance stays alive, so requests wait for it instead of finding the model unadvertised."""
    spawning = threading.Event()
    spawn = python_backend._spawn

    def slow_spawn(argv: list[str], pass_fds: tuple[int, ...]) -> Any:
        spawning.set()
        time.sleep(0.5)
        return spawn(argv, pass_fds)

    monkeypatch.setattr(python_backend, "_spawn", slow_spawn)
    seen = set()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_batch, spec(), backend, [envelope("crash", SEGFAULT)])
        assert spawning.wait(30), "the instance was never restarted"
        while not running.done():
            seen.add(backend.alive)
            time.sleep(0.01)
        outcome = running.result()
    assert seen == {True}
    assert POISON.fullmatch(outcome.replies[0].error_message), outcome.replies[0].error_message
    assert run_batch(spec(), backend, [envelope("after", 8)]).replies[0].ok


# --- through the gateway, Redis and the worker loop --------------------------------------------------


def run(redis_server: LocalServer, key_prefix: str, tmp_path: Path,
        body: Callable[[InProcessSystem], Awaitable[None]]) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_DIR, repo / NAME)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as system:
            await body(system)

    asyncio.run(main())


def infer(s: InProcessSystem, value: int) -> Awaitable[httpx.Response]:
    return s.client.post(f"/v2/models/{NAME}/infer",
                         json={"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1, 1], "data": [value]}]})


def assert_served(r: httpx.Response, value: int) -> None:
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [value]


def test_each_misbehaviour_costs_only_its_request(redis_server: LocalServer, key_prefix: str,
                                                  tmp_path: Path) -> None:
    async def body(s: InProcessSystem) -> None:
        for n, value in enumerate(EXPECTED):
            r = await infer(s, value)
            assert r.status_code == 500, r.text
            assert EXPECTED[value] in r.json()["error"]
            assert_served(await infer(s, 100 + n), 100 + n)  # the next request is served normally
        r = await infer(s, SEGFAULT)
        assert r.status_code == 500 and POISON.fullmatch(r.json()["error"]), r.text
        assert_served(await infer(s, 7), 7)  # the instance was restarted
        assert (await s.client.get(f"/v2/models/{NAME}/ready")).status_code == 200

    run(redis_server, key_prefix, tmp_path, body)


def test_batch_mates_of_a_crash_are_served(redis_server: LocalServer, key_prefix: str, tmp_path: Path) -> None:
    async def body(s: InProcessSystem) -> None:
        values = [1, 2, SEGFAULT, 3, RAISES, 4, TOO_FEW, 5]
        responses = await asyncio.gather(*(infer(s, v) for v in values))
        for value, r in zip(values, responses, strict=True):
            if value >= 0:
                assert_served(r, value)
            elif value == SEGFAULT:
                assert r.status_code == 500 and POISON.fullmatch(r.json()["error"]), r.text
            else:
                assert r.status_code == 500 and EXPECTED[value] in r.json()["error"], r.text
        stats = (await s.client.get(f"/v2/models/{NAME}/stats")).json()["model_stats"][0]
        assert stats["execution_count"] < len(values)  # the requests did share batches
        # Later batches are served by the restarted instance.
        later = await asyncio.gather(*(infer(s, v) for v in range(10, 14)))
        for value, r in zip(range(10, 14), later, strict=True):
            assert_served(r, value)

    run(redis_server, key_prefix, tmp_path, body)


def test_a_poison_request_ends_in_the_dead_letters(redis_server: LocalServer, key_prefix: str,
                                                   tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    keys = Keys(key_prefix)

    async def body(s: InProcessSystem) -> None:
        r = await infer(s, SEGFAULT)
        assert r.status_code == 500 and POISON.fullmatch(r.json()["error"]), r.text
        for _ in range(100):  # the reply may reach the caller just before the dead letter is written
            if client.xlen(keys.dead(NAME)):
                break
            await asyncio.sleep(0.02)
        assert client.xlen(keys.dead(NAME)) == 1
        assert_served(await infer(s, 9), 9)

    run(redis_server, key_prefix, tmp_path, body)
