"""In-process system for integration tests: the gateway app (through httpx's ASGI transport) and a real
worker loop, both on one event loop, against the session's real Redis server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleet.cancellation import cancel_and_wait
from fleet.settings import Settings
from gateway.app import GatewayApp, create_app
from gateway.state import GatewayState
from workers.main import run_worker


@dataclass
class InProcessSystem:
    client: httpx.AsyncClient
    state: GatewayState
    settings: Settings
    app: GatewayApp  # for a test that serves it over real HTTP as well


@asynccontextmanager
async def in_process_system(redis_url: str, key_prefix: str, repositories: Sequence[Path], *,
                            worker: bool = True, ready_timeout_s: float = 60.0,
                            ready_models: Sequence[str] | None = None,
                            **overrides: Any) -> AsyncIterator[InProcessSystem]:
    """`ready_models`: wait for these models only (default: every model of the repositories)."""
    defaults: dict[str, Any] = {"block_ms": 100, "request_timeout_s": 30, "heartbeat_interval_s": 0.2}
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, model_repositories=tuple(repositories),
                        **{**defaults, **overrides})
    app = create_app(settings)
    state: GatewayState = app.state.fleet
    await state.start()
    stop = asyncio.Event()
    worker_task = asyncio.create_task(run_worker(settings, "cpu", stop)) if worker else None
    try:
        if worker:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + ready_timeout_s
            while True:
                await state.refresh_readiness()
                if state.catalog.all_ready() if ready_models is None else \
                        all(state.catalog.ready_versions(m) for m in ready_models):
                    break
                if loop.time() > deadline:
                    raise TimeoutError("the worker did not report every model ready")
                if worker_task is not None and worker_task.done():
                    worker_task.result()
                await asyncio.sleep(0.1)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fleet") as client:
            yield InProcessSystem(client, state, settings, app)
    finally:
        stop.set()
        if worker_task is not None:
            # Bounded either way: a worker that does not drain in 30 s fails the test instead of hanging it.
            await asyncio.wait({worker_task}, timeout=30)
            if not worker_task.done():
                await cancel_and_wait([worker_task], "in-process worker")
                raise TimeoutError("the in-process worker did not drain within 30 s")
            worker_task.result()
        await state.stop()
