"""The status page (`GET /`, server-rendered HTML) and its JSON (`GET /v2/fleet/status`, what `fleet
status` polls): one Redis round trip (fleet/status_build.py says what each figure is read from) plus the
jobs index, built into a Snapshot, with throughput from this process's RateWindow.

Throughput is measured per gateway process against the snapshot it served at least a second before
(fleet/status_snapshot.py RateWindow): any client's polling feeds it, so a page that refreshes every
2 s shows the rate over the last ~2 s. The first request after a quiet minute has no rate yet.

Both routes are in the `infer` auth scope (gateway/auth.py), as /metrics and the statistics are: with
API keys configured they need the bearer key (a browser then needs a proxy or an extension that sets
the header); without, they are open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from fleet.errors import BrokerUnavailable
from fleet.status_build import ModelReading, Reading, build_snapshot
from fleet.status_snapshot import RateWindow, Snapshot, to_json
from gateway.jobs.service import list_jobs
from gateway.queue_reading import lanes_of, queue_reads, streams_of, take_reads, text
from gateway.routes import json_response, state_of
from gateway.state import REGISTRY_GRACE_MS, GatewayState
from gateway.status_page import render_page

JOBS_SHOWN = 20  # the newest jobs; `fleet jobs` lists them all
STATUS_PATH = "/v2/fleet/status"


def _reason(st: GatewayState, name: str) -> str:
    catalog = st.catalog
    if catalog.ready_versions(name):
        return ""
    if name not in catalog.targets:
        return "unloaded"
    return catalog.failures.get(name) or catalog.ensemble_problems.get(name) or "no ready worker serves it"


async def read_status(st: GatewayState, now_ms: int) -> Reading:
    """Everything the status shows, read in one pipeline (and the jobs index, in a thread: RQ's client
    is synchronous). Raises BrokerUnavailable when Redis cannot be read."""
    catalog, keys, client = st.catalog, st.keys, st.client
    names = sorted(set(catalog.targets) | set(catalog.repository.dirs))
    try:
        registered: list[tuple[bytes, float]] = await client.zrangebyscore(  # type: ignore[assignment]
            keys.workers(), now_ms - REGISTRY_GRACE_MS, "+inf", withscores=True)
        ids = [(text(i), int(score)) for i, score in registered]
        pipe = client.pipeline(transaction=False)
        for worker_id, _ in ids:
            pipe.hgetall(keys.worker(worker_id))
        plans = [(name, streams_of(catalog, name)) for name in names]
        for name, streams in plans:
            queue_reads(pipe, keys, name, streams)
        results = iter(await pipe.execute(raise_on_error=False))
        jobs = await asyncio.to_thread(list_jobs, st.jobs, JOBS_SHOWN)
    except (RedisError, OSError) as exc:
        raise BrokerUnavailable(f"cannot read the fleet's status: Redis is not reachable ({exc})") from exc
    beats = {}
    for worker_id, _ in ids:
        beat = next(results)
        if isinstance(beat, dict) and beat:
            beats[worker_id] = {text(k): text(v) for k, v in beat.items()}
    models = []
    for name, streams in plans:
        read = take_reads(results, name, streams)
        view = catalog.views.get(name)
        models.append(ModelReading(
            name=name, versions=tuple(view.entry.versions) if view is not None else (),
            ready_versions=tuple(catalog.ready_versions(name)), lanes=lanes_of(catalog, name),
            reason=_reason(st, name), stats=read.stats, streams=read.streams, dead_letters=read.dead_letters))
    return Reading(now_ms=now_ms, heartbeat_ttl_ms=int(st.settings.heartbeat_ttl_s * 1000), registry=dict(ids),
                   beats=beats, models=models, jobs=jobs)


def status_routes(window: RateWindow | None = None, wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
                  monotonic_s: Callable[[], float] = time.monotonic) -> list[Route]:
    """The two routes, sharing one RateWindow (one per app: each gateway process measures its own)."""
    rates = window or RateWindow()

    async def snapshot(request: Request) -> Snapshot:
        reading = await read_status(state_of(request), wall_ms())
        return rates.observe(build_snapshot(reading), monotonic_s())

    async def status_json(request: Request) -> Response:
        return json_response(to_json(await snapshot(request)))

    async def status_page(request: Request) -> Response:
        st = state_of(request)
        try:
            snap = await snapshot(request)
        except BrokerUnavailable as exc:
            return HTMLResponse(render_page(None, st.broker.gateway_id, error=exc.message), status_code=503)
        return HTMLResponse(render_page(snap, st.broker.gateway_id))

    return [Route("/", status_page, methods=["GET"]), Route(STATUS_PATH, status_json, methods=["GET"])]
