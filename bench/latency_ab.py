"""C=1 latency of this checkout's fleet against another's (--base-root), both running at once, the requests
alternated between them in short blocks, so that this host's drift (2x between passes a minute apart on a
bad day) falls on both alike. perf_analyzer's passes run one system after the other, and at C=1 on a noisy
host their difference is mostly when each ran.

    .venv/bin/python bench/latency_ab.py --base-root CHECKOUT [--models "mlp double"] [--protocols "http grpc"]
                                         [--blocks 40] [--block 50] [--port 18100] [--out DIR]

One request at a time from Triton's own clients (tritonclient.http / .grpc, one 1-row request, binary
tensors), `--blocks` blocks of `--block` requests per system, model and protocol, after a warm-up. Prints
each system's p50 / p90 / mean (ms) and the ratio of p50s. Both fleets are started by bench/served.py's
Fleet and stopped by their PIDs; only 127.0.0.1 is contacted; every loop is bounded.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from served import HOST, ROOT, Fleet  # bench/served.py

SHAPES = {"mlp": ("INPUT0", [1, 256], "FP32"), "double": ("INPUT0", [1, 16], "FP32")}


def client_for(protocol: str, port: int) -> Any:
    if protocol == "grpc":
        return grpcclient.InferenceServerClient(f"{HOST}:{port + 1}")  # gRPC on the port after HTTP's
    return httpclient.InferenceServerClient(f"{HOST}:{port}")


def request(protocol: str, model: str) -> tuple[list[Any], list[Any]]:
    """One request's inputs and outputs, built once: only the round trip is timed."""
    name, shape, dtype = SHAPES[model]
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    mod = grpcclient if protocol == "grpc" else httpclient
    tensor = mod.InferInput(name, shape, dtype)
    if protocol == "grpc":
        tensor.set_data_from_numpy(data)
        outputs = [mod.InferRequestedOutput("OUTPUT0")]
    else:
        tensor.set_data_from_numpy(data, binary_data=True)
        outputs = [mod.InferRequestedOutput("OUTPUT0", binary_data=True)]
    return [tensor], outputs


def block(client: Any, model: str, inputs: list[Any], outputs: list[Any], n: int) -> list[float]:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.infer(model, inputs, outputs=outputs)
        took.append((time.perf_counter() - t0) * 1000)
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-root", type=Path, required=True)
    p.add_argument("--models", default="mlp double")
    p.add_argument("--protocols", default="http grpc")
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--port", type=int, default=18100, help="this checkout's HTTP port; the base's is port + 10")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / f"latency-ab-{time.strftime('%Y%m%d-%H%M%S')}")
    a = p.parse_args()
    models = a.models.split()
    systems = {"fleet": (ROOT, a.port), "fleet-base": (a.base_root, a.port + 10)}
    fleets = []
    try:
        for name, (root, port) in systems.items():
            out = a.out / name
            out.mkdir(parents=True, exist_ok=True)
            # A checkout that serves no gRPC is refused up front when gRPC is measured.
            fleets.append(Fleet(port, out, 120, models, root=root,
                                protocol="grpc" if "grpc" in a.protocols.split() else "http"))
            fleets[-1].start()
        for protocol in a.protocols.split():
            for model in models:
                clients = {name: client_for(protocol, port) for name, (_, port) in systems.items()}
                inputs, outputs = request(protocol, model)
                for name in systems:
                    block(clients[name], model, inputs, outputs, 200)  # warm-up
                took: dict[str, list[float]] = {name: [] for name in systems}
                for i in range(a.blocks):
                    order = list(systems) if i % 2 == 0 else list(reversed(systems))
                    for name in order:
                        took[name] += block(clients[name], model, inputs, outputs, a.block)
                p50 = {}
                for name, ms in took.items():
                    q = statistics.quantiles(ms, n=10)
                    p50[name] = statistics.median(ms)
                    print(f"{protocol:4s} {model:7s} {name:10s} p50 {p50[name]:.3f} ms  p90 {q[8]:.3f}  "
                          f"mean {statistics.fmean(ms):.3f}  ({len(ms)} requests)", flush=True)
                print(f"{protocol:4s} {model:7s} p50 fleet / fleet-base = {p50['fleet'] / p50['fleet-base']:.3f}",
                      flush=True)
                for c in clients.values():
                    c.close()
    finally:
        for f in fleets:
            f.stop(30)


if __name__ == "__main__":
    main()
