"""The inference path, HTTP-free: resolve the model version, validate, enqueue, await the reply."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from fleet.admission import admit
from fleet.clock import Clock, SystemClock
from fleet.envelope import RequestEnvelope, encode_request
from fleet.errors import ModelNotReady, from_code
from fleet.kserve import parse_infer, render_infer
from fleet.stats import render_model_stats
from gateway.broker import Broker
from gateway.catalog import Catalog


@dataclass(slots=True)
class InferResult:
    body: bytes
    header_length: int | None


class DataPlane:
    def __init__(self, catalog: Catalog, broker: Broker, clock: Clock | None = None) -> None:
        self.catalog = catalog
        self.broker = broker
        self.clock = clock or SystemClock()

    async def infer(self, model: str, version: str | None, body: bytes, header_length: str | None) -> InferResult:
        view, v = self.catalog.resolve(model, version)
        spec = view.entry.spec
        req = parse_infer(body, header_length, spec)
        rid = self.broker.next_id()
        # Envelope times are Redis's clock, so a worker on another machine reads them right whatever
        # the skew between the two (fleet/redis_time.py).
        now_us = self.broker.redis_clock.to_redis(self.clock.now_us())
        admission = admit(spec, req.priority, req.timeout_us, now_us)
        env = RequestEnvelope(
            id=rid,
            model=model,
            version=v,
            inputs=req.inputs,
            reply_to=self.broker.reply_key,
            enqueued_at_us=now_us,
            outputs=req.outputs,
            parameters=req.parameters,
            priority=req.priority,
            deadline_us=admission.deadline_us,
            client_id=req.client_id,
            expires_us=self.broker.expires_us(now_us),
        )
        try:
            reject_at = None if admission.delay_on_timeout else admission.deadline_us
            reply = await self.broker.submit(rid, self.broker.keys.queue(model, admission.lane), encode_request(env),
                                             admission.max_queue_size, model, version=v, enqueued_us=now_us,
                                             reject_at_us=reject_at)
        except asyncio.CancelledError:
            # The caller went away: nobody will read a reply, so none should be computed.
            self.broker.cancel(rid)
            raise
        finally:
            self.broker.forget(rid)
        if not reply.ok:
            raise from_code(reply.error_code, reply.error_message)
        body_out, hlen = render_infer(model, v, req, reply.outputs or [], reply.parameters)
        return InferResult(body_out, hlen)


async def model_statistics(catalog: Catalog, client: aioredis.Redis, key_of: Any, name: str | None,
                           version: str | None) -> dict[str, Any]:
    """The statistics extension: every READY version (or the one asked for), summed across workers."""
    if name:
        view, v = catalog.resolve(name, version)
        targets = [(name, [v])]
    else:
        targets = [(n, catalog.ready_versions(n)) for n in sorted(catalog.views)]
        targets = [(n, vs) for n, vs in targets if vs]
    pipe = client.pipeline(transaction=False)
    for n, _ in targets:
        pipe.hgetall(key_of(n))
    raws = await pipe.execute()
    out: list[dict[str, object]] = []
    for (n, versions), raw in zip(targets, raws, strict=True):
        decoded = {k.decode(): int(val) for k, val in raw.items()}
        out.extend(render_model_stats(n, v, decoded) for v in versions)
    if name and not out:
        raise ModelNotReady(f"model '{name}' has no ready version")
    return {"model_stats": out}
