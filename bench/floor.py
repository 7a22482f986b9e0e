"""The architecture's floor: the least a gateway → Redis stream → worker → Redis → gateway design does per
request, serving perf_analyzer `double` (FP32 [16] doubled) and `mlp` (model_repository/mlp's TorchScript,
one torch thread), so that bench/compare.sh can put it beside native Triton and fleet
(`SYSTEMS="triton-native floor fleet"`, HTTP only).

    .venv/bin/python bench/floor.py serve --port 18000      # until SIGTERM or SIGINT

It starts, as `fleet up` does, the embedded Valkey (AOF on, Unix socket) and two processes:
- a gateway: uvloop and httptools (uvicorn's parser, fleet's too) behind a bare asyncio protocol; a
  request's binary-tensor header parsed with orjson; its input's bytes XADDed to the model's stream
  (every request of a loop iteration in one pipeline); one task XREADing this gateway's reply stream
  and handing each reply to its request; the response in Triton's binary form;
- a worker: XREADGROUP of up to 64 requests per model, the batch computed in one call on the worker's
  own thread, every reply XADDed and the batch XACKed and XDELed in one pipeline.
Nothing else: no validation against a config, no statistics, no dynamic-batching delay, no custody of
messages, no deadlines, no tracing, no metrics, no Python-backend stub (native Triton and fleet run
`double` in one). What fleet spends beyond this is what its features and its structure cost; what this
spends beyond native Triton is what the architecture costs (design.md's "Performance budget" measured
the same kind of thing once, with throwaway servers). It answers the endpoints perf_analyzer calls
(bench_pa.sh): model metadata and config, server metadata without the statistics extension, infer (binary
tensors; responses in request order on a connection). tests/e2e/test_floor.py checks its answers.
Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any

import httptools
import numpy as np
import orjson
import redis
import redis.asyncio as aioredis
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.procs import stop as stop_process  # noqa: E402
from fleet.lifetime import dies_with_this_process  # noqa: E402
from fleet.redis_server import start_server  # noqa: E402

GROUP = "workers"
MAX_BATCH = 64
REPLY_MAXLEN = 10_000  # approximate trimming of each reply stream, in the worker's pipeline
MODELS = {"double": 16, "mlp": 256}  # INPUT0 -> OUTPUT0, FP32 [n]: x * 2, and the TorchScript `mlp`
MLP_FILE = ROOT / "model_repository" / "mlp" / "1" / "model.pt"


def _stream(model: str) -> str:
    return f"floor:{model}"


def _pages() -> dict[bytes, bytes]:
    pages = {b"/v2": orjson.dumps({"name": "floor", "version": "0", "extensions": []})}
    for model, n in MODELS.items():
        platform = "python" if model == "double" else "pytorch_libtorch"
        pages[f"/v2/models/{model}".encode()] = orjson.dumps({
            "name": model, "versions": ["1"], "platform": platform,
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, n]}],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, n]}]})
        pages[f"/v2/models/{model}/config".encode()] = orjson.dumps({
            "name": model, "platform": platform, "backend": "python" if model == "double" else "pytorch",
            "max_batch_size": MAX_BATCH, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [n]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [n]}],
            "dynamic_batching": {}, "instance_group": [{"kind": "KIND_CPU", "count": 1}]})
    return pages


_ROUTES = _pages()
_INFER = {f"/v2/models/{model}/infer".encode(): model for model in MODELS}


def _response(status: bytes, body: bytes, extra: bytes = b"", kind: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + kind + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


class Failed(Exception):
    """The worker could not compute a request (its reply carries `e`): a 400 for its caller."""


class Gateway:
    """The requests waiting for replies, the XADDs waiting for the next pipeline, and the reply reader."""

    def __init__(self, url: str) -> None:
        self.redis = aioredis.Redis.from_url(url, socket_timeout=None)  # XREAD blocks for as long as it takes
        self.reply_stream = f"floor:reply:{os.getpid()}"
        self.waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self.outbox: list[tuple[str, bytes, bytes]] = []
        self.numbers = 0
        self.broken = asyncio.Event()  # the reply reader or a pipeline failed: the gateway stops

    def infer(self, model: str, data: bytes) -> asyncio.Future[bytes]:
        self.numbers += 1
        number = str(self.numbers).encode()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[number] = future
        if not self.outbox:
            asyncio.get_running_loop().create_task(self._flush())
        self.outbox.append((model, number, data))
        return future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # what the other connections' data_received add in this loop iteration
        batch, self.outbox = self.outbox, []
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for model, number, data in batch:
                    pipe.xadd(_stream(model), {"r": self.reply_stream, "n": number, "d": data})
                await pipe.execute()
        except Exception as exc:  # requests that would never be answered: stop rather than hang the client
            print(f"floor: enqueueing failed: {exc!r}", file=sys.stderr, flush=True)
            self.broken.set()

    async def read_replies(self) -> None:
        try:
            await self._read_replies()
        except Exception as exc:  # the gateway cannot answer without it: say why, and stop
            print(f"floor: the reply reader stopped: {exc!r}", file=sys.stderr, flush=True)
            self.broken.set()

    async def _read_replies(self) -> None:
        last = b"0-0"
        await self.redis.delete(self.reply_stream)
        while True:
            answer: Any = await self.redis.xread({self.reply_stream: last}, count=1000, block=0)
            for _, entries in answer:
                for entry_id, fields in entries:
                    last = entry_id
                    future = self.waiting.pop(fields[b"n"], None)
                    if future is None or future.done():
                        continue
                    if b"e" in fields:
                        future.set_exception(Failed(fields[b"e"].decode(errors="replace")))
                    else:
                        future.set_result(fields[b"d"])


class Connection(asyncio.Protocol):
    """One client connection. Its responses go out in the order of its requests (a pipelining client's
    replies may complete out of order: one model's batch before another's)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None  # uvloop's TCPTransport (not an asyncio.Transport subclass)
        self.url = b""
        self.header_length = -1
        self.body: list[bytes] = []
        self.queue: deque[asyncio.Future[bytes]] = deque()  # each request's response, in request order

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._respond(_ready(_response(b"400 Bad Request", orjson.dumps({"error": repr(exc.__context__ or exc)}),
                                           b"connection: close\r\n")))
            self.queue[-1].add_done_callback(lambda _: self.transport and self.transport.close())

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"inference-header-content-length":
            self.header_length = int(value)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        body, self.body = b"".join(self.body), []
        header_length, self.header_length = self.header_length, -1
        if self.parser.get_method() == b"GET":
            page = _ROUTES.get(url.split(b"?")[0].rstrip(b"/") or b"/v2")
            self._respond(_ready(_response(b"200 OK", page) if page is not None else
                                 _response(b"404 Not Found", b'{"error":"not found"}')))
            return
        model = _INFER.get(url)
        if model is None or header_length < 0:
            self._respond(_ready(_response(b"400 Bad Request", b'{"error":"binary infer of double or mlp only"}')))
            return
        head = orjson.loads(body[:header_length])
        shape = head["inputs"][0]["shape"]
        reply = self.gateway.infer(model, body[header_length:])
        response: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        reply.add_done_callback(lambda f: response.set_result(_render(model, head.get("id", ""), shape, f)))
        self._respond(response)

    def _respond(self, response: asyncio.Future[bytes]) -> None:
        self.queue.append(response)
        response.add_done_callback(self._write_ready)

    def _write_ready(self, _: object) -> None:
        while self.queue and self.queue[0].done():
            data = self.queue.popleft().result()
            if self.transport is not None:
                self.transport.write(data)


def _ready(data: bytes) -> asyncio.Future[bytes]:
    future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    future.set_result(data)
    return future


def _render(model: str, request_id: str, shape: list[int], reply: asyncio.Future[bytes]) -> bytes:
    if (error := reply.exception()) is not None:
        return _response(b"400 Bad Request", orjson.dumps({"error": str(error)}))
    data = reply.result()
    head = orjson.dumps({"id": request_id, "model_name": model, "model_version": "1", "outputs": [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": shape, "parameters": {"binary_data_size": len(data)}}]})
    return _response(b"200 OK", head + data, b"inference-header-content-length: " + str(len(head)).encode()
                     + b"\r\n", b"application/octet-stream")


async def _gateway(url: str, port: int) -> int:
    gateway = Gateway(url)
    reader = asyncio.get_running_loop().create_task(gateway.read_replies())
    server = await asyncio.get_running_loop().create_server(lambda: Connection(gateway), "127.0.0.1", port,
                                                            backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        stopped, broken = (asyncio.create_task(e.wait()) for e in (stop, gateway.broken))
        await asyncio.wait([stopped, broken], return_when=asyncio.FIRST_COMPLETED)
    reader.cancel()
    return 1 if gateway.broken.is_set() else 0


def _worker(url: str) -> None:
    import torch  # the worker's alone: the gateway stays as light as fleet's

    torch.set_num_threads(1)
    mlp = torch.jit.load(str(MLP_FILE)).eval()

    def compute(model: str, batch: np.ndarray) -> np.ndarray:
        if model == "double":
            return batch * np.float32(2)
        with torch.inference_mode():
            out: np.ndarray = mlp(torch.from_numpy(batch)).numpy()
            return out

    r = redis.Redis.from_url(url, socket_timeout=None)
    for model in MODELS:
        try:
            r.xgroup_create(_stream(model), GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass  # the group is there
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    while not stopping.is_set():
        answer: Any = r.xreadgroup(GROUP, "w", {_stream(m): ">" for m in MODELS}, count=MAX_BATCH, block=500)
        pipe = r.pipeline(transaction=False)
        for stream, entries in answer or []:
            model = stream.decode().removeprefix("floor:")
            good, rows = [], []
            for _, fields in entries:
                try:
                    rows.append(np.frombuffer(fields[b"d"], dtype=np.float32).reshape(-1, MODELS[model]))
                    good.append(fields)
                except ValueError as exc:  # a body of the wrong size: its caller gets the error
                    pipe.xadd(fields[b"r"], {"n": fields[b"n"], "e": f"{model}: {exc}"}, maxlen=REPLY_MAXLEN,
                              approximate=True)
            outputs = compute(model, np.concatenate(rows)) if rows else np.empty(0, np.float32)
            offset = 0
            for fields, one in zip(good, rows, strict=True):
                end = offset + len(one)
                pipe.xadd(fields[b"r"], {"n": fields[b"n"], "d": outputs[offset:end].tobytes()},
                          maxlen=REPLY_MAXLEN, approximate=True)
                offset = end
            ids = [entry_id for entry_id, _ in entries]
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
        if answer:
            pipe.execute()


def _serve(port: int) -> int:
    """Valkey, the worker and the gateway until SIGTERM or SIGINT (0), or until one of them exits (1). They
    die with this process, whatever kills it."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    me = [sys.executable, str(Path(__file__).resolve())]
    with tempfile.TemporaryDirectory(prefix="floor-") as tmp:
        server = start_server(Path(tmp) / "redis", appendonly=True, log_file=None, unix_socket=True,
                              parent_death_signal=signal.SIGTERM)
        children: list[subprocess.Popen[bytes]] = []
        try:
            url = server.local_url
            for role in (["worker", url], ["gateway", url, str(port)]):
                if not stop.is_set():
                    children.append(subprocess.Popen([*me, *role], preexec_fn=dies_with_this_process(signal.SIGTERM)))
            print(f"floor: double and mlp on http://127.0.0.1:{port} (Valkey {url}); SIGTERM stops it", flush=True)
            while not stop.wait(0.5) and all(c.poll() is None for c in children):
                pass
            failed = not stop.is_set()
        finally:
            for child in children:
                stop_process(child, timeout_s=10)
            server.stop()
    if failed:
        print("floor: " + ", ".join(f"{role} exited with {c.returncode}" for role, c in zip(("worker", "gateway"),
                                    children, strict=False) if c.returncode), file=sys.stderr, flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--port", type=int, default=18000)
    sub.add_parser("worker").add_argument("url")
    gateway = sub.add_parser("gateway")
    gateway.add_argument("url")
    gateway.add_argument("port", type=int)
    args = parser.parse_args()
    if args.role == "serve":
        return _serve(args.port)
    if args.role == "worker":
        _worker(args.url)
        return 0
    return uvloop.run(_gateway(args.url, args.port))


if __name__ == "__main__":
    sys.exit(main())
