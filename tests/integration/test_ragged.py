"""Ragged batching end to end (protocol.md §3.6): requests whose allow_ragged_batch input differs in length
run in one batch, and the model finds each request's elements through its batch input.

* Python backend, through the gateway and a real worker on the session's Redis: the test model
  (tests/support/ragged_model.py) answers each request with its [start, end) offsets read from
  BATCH_ACCUMULATED_ELEMENT_COUNT and the number of requests in its execute().
* TorchScript backend, run directly: the model receives the ragged input as one 1-D tensor with the
  offsets beside it, and its outputs are split (or scattered, batch_output) back per request.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleet.envelope import RequestEnvelope, WireTensor
from fleet.model_config import parse_config
from fleet.redis_server import LocalServer
from tests.support.system import in_process_system
from workers.backends.base import LoadContext
from workers.execute import run_batch

RAGGED_MODEL = Path(__file__).resolve().parents[1] / "support" / "ragged_model.py"
PY_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT, target_name: "INDEX", data_type: TYPE_INT32,
                source_input: "IN" } ]
# A batch closes at 4 rows, which the three requests below make together; the delay only bounds a
# failure.
dynamic_batching { preferred_batch_size: [ 4 ], max_queue_delay_microseconds: 10000000 }
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""
# Three requests of different lengths (rows x elements): 1x2, 1x3 and 2x4.
REQUESTS = [np.arange(2, dtype=np.float32).reshape(1, 2) + 1,
            np.arange(3, dtype=np.float32).reshape(1, 3) + 10,
            np.arange(8, dtype=np.float32).reshape(2, 4) + 100]


def infer_body(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "IN", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}


def test_python_model_reads_its_offsets_in_one_ragged_batch(redis_server: LocalServer, key_prefix: str,
                                                            tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "ragged" / "1").mkdir(parents=True)
    shutil.copy(RAGGED_MODEL, repo / "ragged" / "1" / "model.py")
    (repo / "ragged" / "config.pbtxt").write_text(PY_CONFIG)

    async def main() -> list[np.ndarray]:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            config = (await s.client.get("/v2/models/ragged/config")).json()
            assert config["batch_input"] == [{"kind": "BATCH_ACCUMULATED_ELEMENT_COUNT", "target_name": ["INDEX"],
                                              "data_type": "TYPE_INT32", "source_input": ["IN"]}]
            replies = await asyncio.gather(*(s.client.post("/v2/models/ragged/infer", json=infer_body(x))
                                             for x in REQUESTS))
            outs = []
            for r in replies:
                assert r.status_code == 200, r.text
                out = r.json()["outputs"][0]
                outs.append(np.asarray(out["data"], np.float32).reshape(out["shape"]))
            return outs

    outs = asyncio.run(main())
    for x, out in zip(REQUESTS, outs, strict=True):
        assert out.shape == (x.shape[0], 4)
        start, end, requests, total = out[0]
        assert requests == 3, "the three requests did not run in one execute()"
        assert end - start == x.size and total == x.sum()
    # The offsets tile the batch's concatenation: [0, 13) without gaps or overlaps, in batch order.
    spans = sorted((int(o[0, 0]), int(o[0, 1])) for o in outs)
    assert spans[0][0] == 0 and spans[-1][1] == sum(x.size for x in REQUESTS)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


TORCH_CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true } ]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 1 ] }, { name: "TWICE", data_type: TYPE_FP32, dims: [ -1 ] } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO, target_name: "OFFSETS", data_type: TYPE_INT32,
                source_input: "IN" } ]
batch_output [ { target_name: "TWICE", kind: BATCH_SCATTER_WITH_INPUT_SHAPE, source_input: "IN" } ]
"""


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.(script|load)` is deprecated:DeprecationWarning")
def test_torchscript_gets_a_1d_ragged_input_and_its_offsets(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from tests.support.ragged_torch import RaggedModel
    from workers.backends.torch_backend import TorchBackend

    model_dir = tmp_path / "ragged_pt"
    (model_dir / "1").mkdir(parents=True)
    torch.jit.script(RaggedModel()).save(str(model_dir / "1" / "model.pt"))
    spec = parse_config(TORCH_CONFIG, source="ragged_pt", model_name="ragged_pt")

    backend = TorchBackend(LoadContext(spec=spec, model_dir=model_dir, version=1, instance_name="ragged_pt_0",
                                       device="cpu"))
    xs = [np.arange(n, dtype=np.float32).reshape(1, n) + n for n in (2, 5, 3)]
    envs = [RequestEnvelope(id=str(i), model="ragged_pt", version=1, reply_to="r", enqueued_at_us=0,
                            inputs=[WireTensor("IN", "FP32", x.shape, x.tobytes())]) for i, x in enumerate(xs)]
    try:
        outcome = run_batch(spec, backend, envs)
    finally:
        backend.close()
    for x, reply in zip(xs, outcome.replies, strict=True):
        assert reply.ok, reply.error_message
        assert reply.outputs is not None
        got = {t.name: np.frombuffer(t.data, "<f4").reshape(t.shape) for t in reply.outputs}
        assert got["SUM"].tolist() == [[x.sum()]]
        np.testing.assert_array_equal(got["TWICE"], x * 2)  # scattered back into the request's own shape
