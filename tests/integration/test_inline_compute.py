"""An in-process CPU model's batches computed by the worker's event loop itself (workers/inline.py): every
batch where the model version has one instance, only lone requests of clients sending one at a time where it
has more, never a bulk job's, and none while another model of the worker holds a request. Real Redis, the
gateway app and a real worker in process (one event loop for both, on this test's thread), a TorchScript model
that computes."""

from __future__ import annotations

import asyncio
import struct
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis

from fleet.admission import bulk_lane
from fleet.envelope import RequestEnvelope, WireTensor, decode_reply, encode_request
from fleet.keys import GROUP, Keys
from fleet.model_config import load_config
from fleet.redis_server import LocalServer
from tests.support.queue_models import sleeper_repository
from tests.support.system import InProcessSystem, in_process_system
from workers.backends.base import InferenceItem, ItemResult
from workers.backends.torch_backend import TorchBackend
from workers.generate_models import _JIT_DEPRECATED

CONFIG = """platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [ { count: %d, kind: KIND_CPU } ]
"""
# No limit a stall of this host could pass: which batches the loop computes must not depend on how long
# they took here (the limit itself is tests/unit/test_inline.py's).
GENEROUS_US = 60_000_000
T = TypeVar("T")


def _repository(root: Path, instances: int = 1) -> Path:
    import torch

    class Triple(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    (root / "triple" / "1").mkdir(parents=True)
    with warnings.catch_warnings():  # TorchScript is what Triton's pytorch backend loads (workers/generate_models.py)
        warnings.filterwarnings("ignore", _JIT_DEPRECATED, DeprecationWarning)
        torch.jit.save(torch.jit.script(Triple()), str(root / "triple" / "1" / "model.pt"))
    (root / "triple" / "config.pbtxt").write_text(CONFIG % instances)
    return root


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each execute() of the model: the thread it ran on, and how many requests it computed."""
    calls: list[tuple[str, int]] = []
    execute = TorchBackend.execute

    def recorded(self: TorchBackend, items: list[InferenceItem]) -> list[ItemResult]:
        calls.append((threading.current_thread().name, len(items)))
        return execute(self, items)

    monkeypatch.setattr(TorchBackend, "execute", recorded)
    return calls


async def _infer(s: InProcessSystem, value: float, rows: int = 1) -> httpx.Response:
    return await s.client.post("/v2/models/triple/infer", json={
        "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [rows, 4], "data": [value] * 4 * rows}]})


def _check(value: float, r: httpx.Response, rows: int = 1) -> None:
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [3 * value] * 4 * rows


async def _wave(s: InProcessSystem, calls: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Sixteen requests at once, each answer checked: the executions that computed them (batched)."""
    before = len(calls)
    values = [float(10 + k) for k in range(16)]
    for v, r in zip(values, await asyncio.gather(*(_infer(s, v) for v in values)), strict=True):
        _check(v, r)
    wave = calls[before:]
    assert sum(n for _, n in wave) == 16 and len(wave) < 16
    return wave


async def _polled(s: InProcessSystem, probe: Callable[[redis.Redis], T | None], what: str) -> T:
    """What `probe` finds in Redis once it finds something (every 20 ms, for up to 30 s)."""
    client = redis.Redis.from_url(s.settings.redis_url, protocol=2)
    try:
        for _ in range(1500):
            found = probe(client)
            if found is not None:
                return found
            await asyncio.sleep(0.02)
        raise TimeoutError(what)
    finally:
        client.close()


async def _bulk_infer(s: InProcessSystem, root: Path, value: float) -> None:
    """One request on the model's bulk lane, as a bulk job enqueues it; checked once answered."""
    keys = Keys(s.settings.key_prefix)
    tensor = WireTensor("INPUT__0", "FP32", (1, 4), struct.pack("<4f", *[value] * 4))
    envelope = encode_request(RequestEnvelope(id="bulk", model="triple", version=1, inputs=[tensor],
                                              reply_to=keys.reply("bulk-test"), enqueued_at_us=time.time_ns() // 1000))

    def answered(client: redis.Redis) -> list[Any] | None:
        return client.xrange(keys.reply("bulk-test")) or None

    await _polled(s, lambda c: c.xadd(keys.queue("triple", bulk_lane(load_config(root / "triple")), version=1),
                                      {b"d": envelope}), "the request was not enqueued")
    [(_, fields)] = await _polled(s, answered, "the bulk request was not answered")
    [reply] = [decode_reply(v) for k, v in fields.items() if k.startswith(b"d")]
    assert reply.outputs is not None and not reply.error_code
    assert struct.unpack("<4f", reply.outputs[0].data) == (3 * value,) * 4


def test_a_sole_instance_has_its_batches_computed_by_the_loop_but_a_bulk_job_s(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch)
    loop_thread = threading.current_thread().name
    root = _repository(tmp_path)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [root], inline_max_us=GENEROUS_US) as s:
            for v in range(4):  # one at a time
                _check(float(v), await _infer(s, float(v)))
            # The instance's thread computes the first (nothing is measured yet, and it measures it); the loop
            # computes every one after.
            assert calls == [("triple_0_0", 1)] + [(loop_thread, 1)] * 3

            # Many at once: batched, and the loop computes the batches too (a larger one predicted from the
            # lone requests' cost, scaled by its bytes).
            wave = await _wave(s, calls)
            assert all(name == loop_thread for name, _ in wave), wave

            # A bulk job's request: the thread's (the loop writes what it finished while the thread computes).
            before = len(calls)
            await _bulk_infer(s, root, 5.0)
            _check(1.0, await _infer(s, 1.0))
            assert calls[before:] == [("triple_0_0", 1), (loop_thread, 1)]
            stats = (await s.client.get("/v2/models/triple/stats")).json()["model_stats"][0]
            assert stats["inference_count"] == 22 and stats["execution_count"] == len(calls)

    asyncio.run(main())


def test_with_two_instances_the_loop_computes_lone_requests_and_the_threads_the_batches(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch)
    loop_thread = threading.current_thread().name

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [_repository(tmp_path, instances=2)],
                                     inline_max_us=GENEROUS_US) as s:
            for v in range(8):  # one at a time
                _check(float(v), await _infer(s, float(v)))
            # The threads compute the first two (one at a time is not yet a pattern; the first is measured);
            # the loop computes every one after.
            names = [name for name, _ in calls]
            assert all(n.startswith("triple_") for n in names[:2]) and names[2:] == [loop_thread] * 6, calls

            # Many at once: they queue behind one another, so the instances' threads compute them, batched.
            wave = await _wave(s, calls)
            assert all(name.startswith("triple_") for name, n in wave if n > 1), wave

            # One at a time again: the loop's again, once three batches in a row were lone requests (the wave
            # may have ended with one or two).
            before = len(calls)
            for v in range(5):
                _check(float(v), await _infer(s, float(v)))
            names = [name for name, _ in calls[before:]]
            first = names.index(loop_thread)
            assert first <= 2 and all(n.startswith("triple_") for n in names[:first])
            assert names[first:] == [loop_thread] * (5 - first)

    asyncio.run(main())


async def _until_read(s: InProcessSystem, model: str) -> None:
    """Until a worker has read a request of `model` (it is pending in the workers' group)."""
    stream = Keys(s.settings.key_prefix).queue(model, 0, version=1)
    await _polled(s, lambda c: c.xpending(stream, GROUP)["pending"] or None, f"no worker read the request of {model}")


def test_while_another_model_of_the_worker_holds_a_request_the_thread_computes(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch)
    loop_thread = threading.current_thread().name
    repositories = [_repository(tmp_path / "torch"), sleeper_repository(tmp_path, "nap", sleep_ms=3000,
                                                                        dynamic_batching="")]

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, repositories, inline_max_us=GENEROUS_US) as s:
            for v in range(2):
                _check(float(v), await _infer(s, float(v)))
            assert calls == [("triple_0_0", 1), (loop_thread, 1)]

            # The other model holds a request (its stub sleeps 3 s on it): the loop is theirs to share.
            nap = asyncio.create_task(s.client.post("/v2/models/nap/infer", json={
                "inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}))
            await _until_read(s, "nap")
            before = len(calls)
            for v in range(3):
                _check(float(v), await _infer(s, float(v)))
            assert not nap.done(), "this host took 3 s over three requests: nothing was tested"
            assert calls[before:] == [("triple_0_0", 1)] * 3

            # Answered: the loop computes again.
            assert (await nap).status_code == 200
            before = len(calls)
            for v in range(2):
                _check(float(v), await _infer(s, float(v)))
            assert calls[before:] == [(loop_thread, 1)] * 2

    asyncio.run(main())


@pytest.mark.parametrize("inline_max_us", [0, 1])  # never; and a limit no batch computes within
def test_past_the_limit_every_batch_stays_on_the_thread(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        inline_max_us: int) -> None:
    calls = _calls(monkeypatch)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [_repository(tmp_path)],
                                     inline_max_us=inline_max_us) as s:
            for v in range(4):
                _check(float(v), await _infer(s, float(v)))
        assert len(calls) == 4 and all(name.startswith("triple_0") for name, _ in calls)

    asyncio.run(main())
