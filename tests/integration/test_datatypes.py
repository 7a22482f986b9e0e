"""BF16 through a real worker (README: "every datatype incl. BF16"): Triton's own client encodes BF16
inputs and decodes the outputs; the model computes in float32 and answers BF16, which must be the float32
result rounded to nearest even, as Triton's client (ml_dtypes) and torch convert it, not truncated.
Real Redis, the gateway app and a real worker with its Python stub."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as http

from fleet.redis_server import LocalServer
from tests.support.system import in_process_system

MODEL = Path(__file__).resolve().parents[1] / "models" / "bf16_scale"
OUTPUTS = ("OUT_CAST", "OUT_TAGGED")


def bf16_round_to_nearest_even(y: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (uint16), round to nearest, ties to even; NaN stays NaN."""
    bits = np.ascontiguousarray(y, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(y), np.uint16(0x7FC0), rounded)


def bf16_truncated(y: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(y, dtype="<f4").view("<u4") >> 16).astype(np.uint16)


def inputs_where_rounding_matters() -> np.ndarray:
    """BF16 values over the whole range (every 7th bit pattern: both signs, zeros, subnormals, the largest
    finite values, whose triples overflow, infinities, NaNs) plus 1 + k/128, whose triples hit every
    rounding case: exact, below, tie (to even, down and up) and above half a BF16 step."""
    sweep = np.arange(0, 0x10000, 7, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    near_one = (1 + np.arange(128, dtype=np.float32) / 128).astype(ml_dtypes.bfloat16)
    return np.concatenate([sweep, near_one, -near_one])


async def infer(client: httpx.AsyncClient, x: np.ndarray, binary_output: bool) -> http.InferResult:
    inp = http.InferInput("IN", [1, x.size], "BF16")
    inp.set_data_from_numpy(x.reshape(1, -1), binary_data=True)  # BF16 inputs travel only as binary
    outputs = [http.InferRequestedOutput(name, binary_data=binary_output) for name in OUTPUTS]
    body, json_size = http.InferenceServerClient.generate_request_body([inp], outputs=outputs)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    r = await client.post("/v2/models/bf16_scale/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    length = r.headers.get("Inference-Header-Content-Length")
    return http.InferenceServerClient.parse_response_body(r.content, header_length=int(length) if length else None)


def test_bf16_outputs_are_rounded_to_nearest_even(redis_server: LocalServer, key_prefix: str,
                                                  tmp_path: Path) -> None:
    shutil.copytree(MODEL, tmp_path / "repo" / "bf16_scale")
    x = inputs_where_rounding_matters()
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32) * np.float32(3)
    expected = bf16_round_to_nearest_even(y)
    finite = np.isfinite(expected.view(ml_dtypes.bfloat16).astype(np.float32))
    # The reference is Triton's client's conversion (ml_dtypes), and the data tells rounding from truncation.
    np.testing.assert_array_equal(expected[~np.isnan(y)], y[~np.isnan(y)].astype(ml_dtypes.bfloat16).view(np.uint16))
    differ = (expected != bf16_truncated(y)) & ~np.isnan(y)
    assert differ.sum() > 1000 and differ[finite].sum() > 1000, differ.sum()
    ties = (np.ascontiguousarray(y, "<f4").view("<u4") & 0xFFFF) == 0x8000
    assert (ties & differ).any() and (ties & ~differ & finite).any()  # ties rounded up and down to even

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [tmp_path / "repo"]) as s:
            binary = await infer(s.client, x, binary_output=True)
            for name in OUTPUTS:
                got = binary.as_numpy(name)
                assert got.dtype == ml_dtypes.bfloat16 and got.shape == (1, x.size)
                bits = got.reshape(-1).view(np.uint16)
                nan = np.isnan(y)
                np.testing.assert_array_equal(np.isnan(got.reshape(-1).astype(np.float32)), nan, err_msg=name)
                wrong = np.flatnonzero(bits[~nan] != expected[~nan])
                assert wrong.size == 0, (f"{name}: {wrong.size} values differ from round-to-nearest-even, e.g. "
                                         f"3 * {x[~nan][wrong[:3]]} = {y[~nan][wrong[:3]]} -> "
                                         f"{got.reshape(-1)[~nan][wrong[:3]]}")
            # JSON outputs carry the same BF16 values as numbers (finite ones: JSON has no NaN or infinity).
            values = x[finite]
            as_json = await infer(s.client, values, binary_output=False)
            for name in OUTPUTS:
                got = np.asarray(as_json.get_output(name)["data"], dtype=np.float32)
                np.testing.assert_array_equal(got, expected[finite].view(ml_dtypes.bfloat16).astype(np.float32),
                                              err_msg=name)

    asyncio.run(main())


@pytest.mark.parametrize("value,expected", [(1.00390625, 0x3F80), (1.01171875, 0x3F82), (1.0078125 + 2**-9, 0x3F81),
                                            (3.0234375, 0x4042), (-3.0234375, 0xC042)])
def test_the_reference_rounds_to_nearest_even(value: float, expected: int) -> None:
    assert int(bf16_round_to_nearest_even(np.array([value], np.float32))[0]) == expected
