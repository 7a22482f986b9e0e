"""`reshape` on inputs and outputs, end to end through the gateway and a real worker: the client sends
and gets `dims`, the model takes and returns `reshape` (Triton applies it in its core, so for every
backend: here TorchScript and Python; ONNX shares TorchScript's path, workers/execute.py)."""

from __future__ import annotations

import asyncio
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from fleet.redis_server import LocalServer
from tests.support.system import InProcessSystem, in_process_system
from workers.generate_models import _JIT_DEPRECATED

CONFIG = """
{backend}
max_batch_size: 4
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ], reshape: {{ shape: [ 2, 2 ] }} }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 4 ], reshape: {{ shape: [ 2, 2 ] }} }} ]
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
"""
# Each model transposes its 2x2 input: a result only right if it was given [batch, 2, 2].
PYTHON_MODEL = textwrap.dedent("""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                if x.shape[1:] != (2, 2):
                    raise pb_utils.TritonModelException(f"expected [batch, 2, 2], got {list(x.shape)}")
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x.transpose(0, 2, 1).copy())]))
            return out
""")


def _repository(root: Path) -> Path:
    import torch

    class Transpose(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 3:
                raise RuntimeError("expected [batch, 2, 2]")
            return x.transpose(1, 2).contiguous()

    repo = root / "reshape-repo"
    (repo / "reshape_torch" / "1").mkdir(parents=True)
    with warnings.catch_warnings():  # TorchScript is what Triton's pytorch backend loads (workers/generate_models.py)
        warnings.filterwarnings("ignore", _JIT_DEPRECATED, DeprecationWarning)
        torch.jit.save(torch.jit.script(Transpose()), str(repo / "reshape_torch" / "1" / "model.pt"))
    (repo / "reshape_torch" / "config.pbtxt").write_text(CONFIG.format(backend='platform: "pytorch_libtorch"'))
    (repo / "reshape_python" / "1").mkdir(parents=True)
    (repo / "reshape_python" / "1" / "model.py").write_text(PYTHON_MODEL)
    (repo / "reshape_python" / "config.pbtxt").write_text(CONFIG.format(backend='backend: "python"'))
    return repo


@pytest.mark.parametrize("model", ["reshape_torch", "reshape_python"])
def test_the_client_sees_dims_and_the_model_sees_reshape(redis_server: LocalServer, key_prefix: str,
                                                         tmp_path: Path, model: str) -> None:
    repo = _repository(tmp_path)
    rows = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            await check(s)

    async def check(s: InProcessSystem) -> None:
        body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 4], "data": rows}]}
        # Several at once, so the worker batches them: the reshape holds for a merged batch too.
        answers = await asyncio.gather(*(s.client.post(f"/v2/models/{model}/infer", json=body) for _ in range(4)))
        for r in answers:
            assert r.status_code == 200, r.text
            (out,) = r.json()["outputs"]
            assert out["shape"] == [2, 4]
            expected = np.array(rows, np.float32).reshape(2, 2, 2).transpose(0, 2, 1).reshape(2, 4)
            assert out["data"] == expected.reshape(-1).tolist()
        # Metadata and config describe what the client sends: dims, with the reshape in the config.
        meta = (await s.client.get(f"/v2/models/{model}")).json()
        assert meta["inputs"][0]["shape"] == [-1, 4] and meta["outputs"][0]["shape"] == [-1, 4]
        config = (await s.client.get(f"/v2/models/{model}/config")).json()
        assert config["input"][0]["reshape"] == {"shape": [2, 2]}
        # A request that does not match dims is refused before any model sees it.
        bad = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2, 2], "data": [[[1, 2], [3, 4]]]}]}
        assert (await s.client.post(f"/v2/models/{model}/infer", json=bad)).status_code == 400

    asyncio.run(main())


def test_a_model_that_ignores_its_output_reshape_is_an_internal_error(redis_server: LocalServer, key_prefix: str,
                                                                     tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "flat" / "1").mkdir(parents=True)
    (repo / "flat" / "1" / "model.py").write_text(PYTHON_MODEL.replace(".transpose(0, 2, 1).copy()",
                                                                      ".reshape(-1, 4)"))
    (repo / "flat" / "config.pbtxt").write_text(CONFIG.format(backend='backend: "python"'))

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [[1, 2, 3, 4]]}]}
            r = await s.client.post("/v2/models/flat/infer", json=body)
            assert r.status_code == 500, r.text
            assert "returned output 'OUT' with shape [1, 4], but its config reshape makes it [batch, 2, 2]" \
                in r.json()["error"]

    asyncio.run(main())
