"""Where a sequence model's request goes: the stream of the worker holding its sequence.

A sequence's state lives on one instance of one worker, so its requests cannot go to the model's shared
lane, where whichever worker reads first takes them. At START the gateway picks a worker serving the
version (at random: sequences are many and short-lived, and a worker's heartbeat count would lag a burst
of starts) and records it in Redis under the correlation id (`Keys.sequence_owner`), so every gateway
routes the sequence's later requests to that worker's own stream (`Keys.sequence_queue`), in order.
The record's TTL is refreshed by each request and outlasts the idle timeout: the worker is the
authority on whether the sequence is still live (batching/sequences.py), the record only says where.

When the owner is gone (no live heartbeat serves the version), the sequence's state went with it: the
request is answered SequenceLost (503); the client STARTs the sequence anew (which rewrites the record).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from batching.sequences import no_start
from fleet.envelope import SequenceFlags
from fleet.errors import DeadlineExceeded, InvalidInput, ModelNotReady, SequenceLost
from fleet.keys import Keys
from fleet.model_spec import ModelSpec
from gateway.catalog import Catalog


@dataclass(frozen=True, slots=True)
class Route:
    stream: str
    release: Callable[[], None]  # lets the sequence's next request through (idempotent)


class SequenceRouter:
    def __init__(self, client: aioredis.Redis, keys: Keys, catalog: Catalog, request_timeout_s: float) -> None:
        self._client = client
        self._keys = keys
        self._catalog = catalog
        self._request_timeout_s = request_timeout_s
        # (model, version, sequence id) -> done once the last request of it seen here has been routed
        self._tails: dict[tuple[str, int, int | str], asyncio.Future[None]] = {}

    async def route(self, model: str, version: int, spec: ModelSpec, flags: SequenceFlags) -> Route:
        """Where this request of the sequence goes; raises InvalidInput (no START), ModelNotReady or
        SequenceLost. A sequence's requests that reach this gateway together (a gRPC stream sends them
        without waiting) enter the worker's stream in the order they came: each is routed only once the
        one before it is enqueued (`release` is called when its XADD has come back, and when the caller is
        done, if that was later: fleet/broker.py's `after_enqueue`)."""
        key = (model, version, flags.id)
        before = self._tails.get(key)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tails[key] = mine

        def release() -> None:
            if not mine.done():
                mine.set_result(None)
            if self._tails.get(key) is mine:
                del self._tails[key]

        try:
            if before is not None:
                await self._after(before, model, flags)
            return Route(await self._route(model, version, spec, flags), release)
        except BaseException:
            release()
            raise

    async def _after(self, before: asyncio.Future[None], model: str, flags: SequenceFlags) -> None:
        """Until the request before this one is released. A caller cancelled here must not cancel that one
        (shielded). Every path releases, but a request is never kept past the request timeout waiting for
        one that does not: it fails as a request with no reply by then does."""
        try:
            # (asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that lands as
            # `before` completes, and a caller gone would be routed and computed all the same.)
            async with asyncio.timeout(self._request_timeout_s):
                await asyncio.shield(before)
        except TimeoutError:
            raise DeadlineExceeded(f"sequence {flags.id} of model '{model}': its previous request was not enqueued "
                                   f"within {self._request_timeout_s:g}s") from None

    async def _route(self, model: str, version: int, spec: ModelSpec, flags: SequenceFlags) -> str:
        assert spec.sequence is not None
        key = self._keys.sequence_owner(model, version, flags.id)
        # Past the worker's idle timeout plus a request's lifetime: a request that waited long in the
        # worker's stream must not find its record gone when the worker still holds the sequence.
        lease_ms = spec.sequence.max_sequence_idle_us // 1000 + int(self._request_timeout_s * 1000) + 1000
        serving = self._catalog.serving.get((model, version), [])
        if flags.start:
            if not serving:
                raise ModelNotReady(f"model '{model}' version {version} has no ready worker to start a sequence on")
            worker = random.choice(serving)
            await self._client.set(key, worker, px=lease_ms)  # a START for a live sequence restarts it
        else:
            raw = await self._client.getex(key, px=lease_ms)
            if raw is None:
                raise InvalidInput(no_start(model, flags.id))
            worker = raw.decode() if isinstance(raw, bytes) else str(raw)
            if worker not in serving:
                raise SequenceLost(f"sequence {flags.id} of model '{model}' was held by worker '{worker}', which "
                                   f"no longer serves it (it stopped or died) and took the sequence's state with "
                                   f"it: start the sequence again (sequence_start)")
        return self._keys.sequence_queue(model, version, worker)
