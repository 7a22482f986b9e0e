"""An in-process CPU model's lone requests computed by the worker's event loop itself (workers/inline.py),
its batches under load by the instance's thread. Real Redis, the gateway app and a real worker in
process (one event loop for both, on this test's thread), a TorchScript model that computes."""

from __future__ import annotations

import asyncio
import threading
import warnings
from pathlib import Path

import httpx
import pytest

from fleet.redis_server import LocalServer
from tests.support.system import InProcessSystem, in_process_system
from workers.backends.base import InferenceItem, ItemResult
from workers.backends.torch_backend import TorchBackend
from workers.generate_models import _JIT_DEPRECATED

CONFIG = """platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
"""


def _repository(root: Path) -> Path:
    import torch

    class Triple(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    (root / "triple" / "1").mkdir(parents=True)
    with warnings.catch_warnings():  # TorchScript is what Triton's pytorch backend loads (workers/generate_models.py)
        warnings.filterwarnings("ignore", _JIT_DEPRECATED, DeprecationWarning)
        torch.jit.save(torch.jit.script(Triple()), str(root / "triple" / "1" / "model.pt"))
    (root / "triple" / "config.pbtxt").write_text(CONFIG)
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


def test_lone_requests_are_computed_by_the_loop_and_batches_by_the_thread(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch)
    loop_thread = threading.current_thread().name

    async def main() -> None:
        # A generous limit: a stall of this host must not send a lone request to the thread here (the limit
        # itself is tests/unit/test_inline.py's).
        async with in_process_system(redis_server.url, key_prefix, [_repository(tmp_path)], inline_max_us=200_000) as s:
            for v in range(8):  # one at a time
                _check(float(v), await _infer(s, float(v)))
            # The instance's thread computes the first two (one at a time is not yet a pattern; the first is
            # measured); the loop computes every one after.
            assert calls == [("triple_0_0", 1)] * 2 + [(loop_thread, 1)] * 6

            # Many at once: they queue behind one another, so the thread computes them, batched.
            before = len(calls)
            values = [float(10 + k) for k in range(16)]
            for v, r in zip(values, await asyncio.gather(*(_infer(s, v) for v in values)), strict=True):
                _check(v, r)
            wave = calls[before:]
            assert sum(n for _, n in wave) == 16 and len(wave) < 16
            assert all(name.startswith("triple_0") for name, n in wave if n > 1)

            # One at a time again: the loop's again, once three batches in a row were lone requests (the wave
            # may have ended with one or two).
            before = len(calls)
            for v in range(5):
                _check(float(v), await _infer(s, float(v)))
            names = [name for name, _ in calls[before:]]
            first = names.index(loop_thread)
            assert first <= 2 and all(n.startswith("triple_0") for n in names[:first])
            assert names[first:] == [loop_thread] * (5 - first)

            # A larger request than any measured goes to the thread (and is measured); then the loop again.
            before = len(calls)
            _check(2.0, await _infer(s, 2.0, rows=3), rows=3)
            _check(1.0, await _infer(s, 1.0))
            assert calls[before:] == [("triple_0_0", 1), (loop_thread, 1)]
            stats = (await s.client.get("/v2/models/triple/stats")).json()["model_stats"][0]
            assert stats["inference_count"] == 33 and stats["execution_count"] == len(calls)

    asyncio.run(main())


def test_inline_max_us_0_keeps_every_batch_on_the_thread(
        redis_server: LocalServer, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(monkeypatch)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [_repository(tmp_path)], inline_max_us=0) as s:
            for v in range(4):
                _check(float(v), await _infer(s, float(v)))
        assert len(calls) == 4 and all(name.startswith("triple_0") for name, _ in calls)

    asyncio.run(main())
