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
(bench_pa.sh): model metadata and config, server metadata without the statistics extension, infer.
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


class Gateway:
    """The requests waiting for replies, the XADDs waiting for the next pipeline, and the reply reader."""

    def __init__(self, url: str) -> None:
        self.redis = aioredis.Redis.from_url(url, socket_timeout=None)  # XREAD blocks for as long as it takes
        self.reply_stream = f"floor:reply:{os.getpid()}"
        self.waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self.outbox: list[tuple[str, bytes, bytes, bytes]] = []
        self.numbers = 0

    def infer(self, model: str, shape: bytes, data: bytes) -> asyncio.Future[bytes]:
        self.numbers += 1
        number = str(self.numbers).encode()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiting[number] = future
        if not self.outbox:
            asyncio.get_running_loop().create_task(self._flush())
        self.outbox.append((model, number, shape, data))
        return future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # what the other connections' data_received add in this loop iteration
        batch, self.outbox = self.outbox, []
        async with self.redis.pipeline(transaction=False) as pipe:
            for model, number, shape, data in batch:
                pipe.xadd(_stream(model), {"r": self.reply_stream, "n": number, "s": shape, "d": data})
            await pipe.execute()

    async def read_replies(self) -> None:
        try:
            await self._read_replies()
        except BaseException as exc:  # the gateway cannot answer without it: say why it ended
            print(f"floor: the reply reader stopped: {exc!r}", file=sys.stderr, flush=True)
            raise

    async def _read_replies(self) -> None:
        last = b"0-0"
        await self.redis.delete(self.reply_stream)
        while True:
            answer: Any = await self.redis.xread({self.reply_stream: last}, count=1000, block=0)
            for _, entries in answer:
                for entry_id, fields in entries:
                    last = entry_id
                    future = self.waiting.pop(fields[b"n"], None)
                    if future is not None and not future.done():
                        future.set_result(fields[b"d"])


class Connection(asyncio.Protocol):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None  # uvloop's TCPTransport (not an asyncio.Transport subclass)
        self.url = b""
        self.header_length = -1
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            print(f"floor: {exc!r} ({exc.__context__!r}): closing the connection", file=sys.stderr, flush=True)
            self.transport.close()

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
            self.transport.write(_response(b"200 OK", page) if page is not None else
                                 _response(b"404 Not Found", b'{"error":"not found"}'))
            return
        model = _INFER.get(url)
        if model is None or header_length < 0:
            self.transport.write(_response(b"400 Bad Request", b'{"error":"binary infer of double or mlp only"}'))
            return
        head = orjson.loads(body[:header_length])
        shape = head["inputs"][0]["shape"]
        future = self.gateway.infer(model, ",".join(map(str, shape)).encode(), body[header_length:])
        future.add_done_callback(lambda f: self._answer(model, head.get("id", ""), shape, f.result()))

    def _answer(self, model: str, request_id: str, shape: list[int], data: bytes) -> None:
        head = orjson.dumps({"id": request_id, "model_name": model, "model_version": "1", "outputs": [
            {"name": "OUTPUT0", "datatype": "FP32", "shape": shape, "parameters": {"binary_data_size": len(data)}}]})
        self.transport.write(_response(b"200 OK", head + data, b"inference-header-content-length: "
                                       + str(len(head)).encode() + b"\r\n", b"application/octet-stream"))


async def _gateway(url: str, port: int) -> None:
    gateway = Gateway(url)
    reader = asyncio.get_running_loop().create_task(gateway.read_replies())
    server = await asyncio.get_running_loop().create_server(lambda: Connection(gateway), "127.0.0.1", port,
                                                            backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    reader.cancel()


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
            rows = [np.frombuffer(fields[b"d"], dtype=np.float32).reshape(-1, MODELS[model])
                    for _, fields in entries]
            outputs = compute(model, np.concatenate(rows))
            offset = 0
            for (_, fields), one in zip(entries, rows, strict=True):
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
    with tempfile.TemporaryDirectory(prefix="floor-") as tmp:
        server = start_server(Path(tmp) / "redis", appendonly=True, log_file=None, unix_socket=True)
        url = server.local_url
        me = [sys.executable, str(Path(__file__).resolve())]
        children = [subprocess.Popen([*me, "worker", url]), subprocess.Popen([*me, "gateway", url, str(port)])]
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        print(f"floor: double and mlp on http://127.0.0.1:{port} (Valkey {url}); SIGTERM stops it", flush=True)
        while not stop.wait(0.5) and all(c.poll() is None for c in children):
            pass
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
        server.stop()
    return 0


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
    uvloop.run(_gateway(args.url, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
