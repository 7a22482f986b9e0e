"""An ensemble against the same three models called one after another by the client (issue 13's bar).

    .venv/bin/python bench/ensemble.py [--url 127.0.0.1:8000] [--conc 32] [--seconds 10] [--passes 3]

Against a running fleet serving model_repository (`make up`, or `fleet up --http-port P`): C concurrent
clients, each in a loop for --seconds, either one `mlp_pipeline` request (mlp_pre -> mlp -> mlp_post, driven
by the gateway) or the three requests in turn from the client (the client forwards each step's output as the
next input, binary tensors both ways). The two modes alternate --passes times. Prints requests/s and the p50 /
p99 of a whole pipeline call for each pass. Only the given address is contacted; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp
import numpy as np
import tritonclient.http as th

Client = th.InferenceServerClient


def body(inputs: dict[str, np.ndarray], outputs: list[str]) -> tuple[bytes, int | None]:
    tensors = []
    for name, array in inputs.items():
        t = th.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT32")
        t.set_data_from_numpy(array, binary_data=True)
        tensors.append(t)
    wanted = [th.InferRequestedOutput(o, binary_data=True) for o in outputs]
    raw, header_length = Client.generate_request_body(tensors, outputs=wanted)
    return raw, header_length


async def call(session: aiohttp.ClientSession, url: str, model: str, inputs: dict[str, np.ndarray],
               outputs: list[str]) -> Any:
    raw, header_length = body(inputs, outputs)
    headers = {"Content-Type": "application/octet-stream"}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    async with session.post(f"http://{url}/v2/models/{model}/infer", data=raw, headers=headers) as r:
        content = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{model}: {r.status} {content[:200]!r}")
        length = r.headers.get("Inference-Header-Content-Length")
        return Client.parse_response_body(content, header_length=int(length) if length else None)


async def pipeline(session: aiohttp.ClientSession, url: str, raw: np.ndarray, chained: bool) -> np.ndarray:
    if not chained:
        return (await call(session, url, "mlp_pipeline", {"RAW": raw}, ["CLASS"])).as_numpy("CLASS")
    pre = (await call(session, url, "mlp_pre", {"RAW": raw}, ["INPUT0"])).as_numpy("INPUT0")
    logits = (await call(session, url, "mlp", {"INPUT0": pre}, ["OUTPUT0"])).as_numpy("OUTPUT0")
    return (await call(session, url, "mlp_post", {"LOGITS": logits}, ["CLASS"])).as_numpy("CLASS")


async def measure(url: str, conc: int, seconds: float, chained: bool) -> tuple[float, float, float]:
    latencies: list[float] = []
    raw = np.random.default_rng(0).normal(size=(1, 256)).astype(np.float32)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as session:
        await pipeline(session, url, raw, chained)  # warm
        stop_at = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                await pipeline(session, url, raw, chained)
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(conc)))
        took = time.perf_counter() - started
    latencies.sort()
    return len(latencies) / took, statistics.median(latencies) * 1000, latencies[int(len(latencies) * 0.99)] * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="127.0.0.1:8000")
    parser.add_argument("--conc", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    print(f"{'pass':>4} {'mode':<28} {'pipelines/s':>11} {'p50 ms':>8} {'p99 ms':>8}")
    for p in range(1, args.passes + 1):
        order = [False, True] if p % 2 else [True, False]
        for chained in order:
            rate, p50, p99 = asyncio.run(measure(args.url, args.conc, args.seconds, chained))
            mode = "client calls 3 models" if chained else "ensemble mlp_pipeline"
            print(f"{p:>4} {mode:<28} {rate:>11.0f} {p50:>8.2f} {p99:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
