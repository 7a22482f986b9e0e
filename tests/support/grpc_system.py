"""The gateway's gRPC server in process, for integration tests: in_process_system (the gateway's state,
a real worker, real Redis) plus the real gRPC server (gateway/grpc/server.py) on a 127.0.0.1 port,
all on one uvloop loop in a thread, as `fleet gateway` runs them. Tests drive it from plain synchronous
code with Triton's own clients (tritonclient.grpc) or a raw grpc channel, and HTTP through `post`."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis
import uvloop

from fleet.keys import Keys
from fleet.stats import fold_args
from gateway.grpc.server import GrpcFrontend
from tests.support.system import InProcessSystem, in_process_system

T = TypeVar("T")


class GrpcSystem:
    def __init__(self, redis_url: str, repositories: Sequence[Path], **overrides: Any) -> None:
        self.prefix = f"g{uuid.uuid4().hex[:8]}"
        self.keys = Keys(self.prefix)
        self.redis = redis.Redis.from_url(redis_url, protocol=2)
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-system", daemon=True)
        self._thread.start()
        self._stop = asyncio.Event()
        self._ready: asyncio.Future[tuple[InProcessSystem, GrpcFrontend]] = self._loop.create_future()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(redis_url, repositories, overrides), self._loop)
        self.system, self.frontend = asyncio.run_coroutine_threadsafe(self._wait_ready(), self._loop).result(120)
        self.target = f"127.0.0.1:{self.frontend.port}"

    async def _serve(self, redis_url: str, repositories: Sequence[Path], overrides: dict[str, Any]) -> None:
        try:
            jobs_dir = Path(repositories[0]).parent / f"{self.prefix}-jobs"
            async with in_process_system(redis_url, self.prefix, repositories, jobs_dir=jobs_dir, grpc_port=0,
                                         **overrides) as system:
                frontend = GrpcFrontend(system.settings, system.state)
                frontend.bind()
                await frontend.start()
                self._ready.set_result((system, frontend))
                try:
                    await self._stop.wait()
                finally:
                    await frontend.stop(5)
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    async def _wait_ready(self) -> tuple[InProcessSystem, GrpcFrontend]:
        return await self._ready

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.run(self.system.client.post(path, **kwargs))

    def queued(self) -> int:
        """Requests ever added to any model stream of this system (entries-added survives trimming)."""
        total = 0
        for key in self.redis.scan_iter(match=self.keys.queue("*", 0, version=1).removesuffix("0") + "*"):
            total += int(self.redis.xinfo_stream(key)["entries-added"])
        return total

    def stats(self, model: str) -> dict[str, int]:
        self.redis.eval(*fold_args(self.keys, model))  # as the gateway reads them (fleet/stats.py)
        raw = self.redis.hgetall(self.keys.stats(model))
        return {k.decode(): int(v) for k, v in raw.items()}

    def __enter__(self) -> GrpcSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        try:
            self._main.result(60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self.redis.close()
