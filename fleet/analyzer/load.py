"""`fleet analyze`'s load: perf_analyzer's concurrency mode, in process.

C keep-alive HTTP/1.1 connections each send one request at a time, back to back (a closed loop, like
`perf_analyzer --concurrency-range C -b 1`), with one prepared body: the model's inputs as KServe binary
tensors of random data, outputs asked for in binary. After a warm-up, every answer within the window
counts: infer/s = answers / window, p50/p99 from each request's latency; an answer other than 200 is an
error (the window's rate then means nothing: the analyzer does not pick that point).

Raw asyncio streams instead of an HTTP client library: the generator shares the machine with the server it
measures, and a cheap client leaves more of it to the server (bench/rawhttp.py says why).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleet.datatypes import BY_NAME
from fleet.tensors import serialize_bytes, to_bytes

HEADER_LENGTH = "Inference-Header-Content-Length"
ANSWER_GRACE_S = 30.0  # how long past the window a request may take before it counts as lost


class LoadError(RuntimeError):
    """The load cannot be built or run (an input shape left open, the server gone)."""


@dataclass(frozen=True, slots=True)
class Window:
    answers: int
    errors: int
    seconds: float
    latencies_s: tuple[float, ...]
    first_error: str = ""

    @property
    def infer_s(self) -> float:
        return self.answers / self.seconds if self.seconds > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return 0.0
        return float(np.percentile(np.asarray(self.latencies_s), q)) * 1000


def request_body(metadata: Mapping[str, Any], batching: bool, shapes: Mapping[str, Sequence[int]],
                 seed: int = 0) -> tuple[bytes, int]:
    """(body, JSON header length) of one request of batch 1 with random inputs, from the model's metadata
    (`GET /v2/models/M`). A variable dim other than the batch dim needs `shapes[name]` (perf_analyzer's
    --shape: the dims without the batch dim)."""
    rng = np.random.default_rng(seed)
    inputs, blobs = [], []
    for spec in metadata.get("inputs", []):
        name, dt = str(spec["name"]), BY_NAME.get(str(spec["datatype"]))
        if dt is None:
            raise LoadError(f"input '{name}' has datatype {spec['datatype']!r}, which the load cannot make")
        dims = [int(d) for d in spec["shape"]]
        if batching:
            dims = dims[1:]
        if name in shapes:
            given = [int(d) for d in shapes[name]]
            if len(given) != len(dims) or any(d != -1 and d != g for d, g in zip(dims, given, strict=True)):
                raise LoadError(f"--shape {name}:{','.join(map(str, given))} does not fit the model's dims {dims}")
            dims = given
        if any(d < 0 for d in dims):
            raise LoadError(f"input '{name}' has variable dims {dims}: give them with --shape {name}:D1,D2,...")
        shape = ([1] if batching else []) + dims
        count = int(np.prod(shape)) if shape else 1
        if dt.name == "BYTES":
            blob = serialize_bytes(np.array([str(i % 10).encode() for i in range(count)], dtype=object))
        elif dt.name == "BOOL":
            blob = to_bytes(rng.integers(0, 2, count).astype(np.bool_), dt)
        elif dt.numpy.kind == "f":
            blob = to_bytes(rng.random(count, dtype=np.float64).astype(dt.numpy), dt)
        else:
            blob = to_bytes(rng.integers(0, 8, count).astype(dt.numpy), dt)
        inputs.append({"name": name, "shape": shape, "datatype": dt.name,
                       "parameters": {"binary_data_size": len(blob)}})
        blobs.append(blob)
    outputs = [{"name": str(o["name"]), "parameters": {"binary_data": True}} for o in metadata.get("outputs", [])]
    header = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
    return header + b"".join(blobs), len(header)


class _Conn:
    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def once(self) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length, close = 0, False
        for line in lines[1:]:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "content-length":
                length = int(value)
            elif key == "connection" and value.strip().lower() == "close":
                close = True
        payload = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def http_request(host: str, port: int, model: str, body: bytes, header_length: int,
                 headers: Mapping[str, str]) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/octet-stream\r\n{HEADER_LENGTH}: {header_length}\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def run_window(host: str, port: int, request: bytes, concurrency: int, warmup_s: float,
                     seconds: float) -> Window:
    """`concurrency` closed loops for warmup_s + seconds; what finished inside the window counts."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    window_start, window_end = start + warmup_s, start + warmup_s + seconds
    latencies: list[float] = []
    errors = [0]
    first_error = [""]

    async def client() -> None:
        conn = _Conn(host, port, request)
        try:
            while (now := loop.time()) < window_end:
                try:
                    # bounded: a server that stops answering ends the window instead of holding it open
                    status, payload = await asyncio.wait_for(conn.once(), window_end - now + ANSWER_GRACE_S)
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError, TimeoutError) as exc:
                    conn.close()
                    errors[0] += 1
                    first_error[0] = first_error[0] or f"{type(exc).__name__}: {exc}"
                    await asyncio.sleep(0.05)  # the server is going: do not spin
                    continue
                done = loop.time()
                if done < window_start or done > window_end:
                    continue
                if status == 200:
                    latencies.append(done - now)
                else:
                    errors[0] += 1
                    first_error[0] = first_error[0] or f"HTTP {status}: {payload[:200].decode(errors='replace')}"
        finally:
            conn.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return Window(len(latencies), errors[0], seconds, tuple(latencies), first_error[0])


def measure(host: str, port: int, request: bytes, concurrency: int, warmup_s: float, seconds: float) -> Window:
    """run_window on a loop of its own (the CLI is synchronous)."""
    return asyncio.run(run_window(host, port, request, concurrency, warmup_s, seconds))
