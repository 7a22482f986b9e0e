"""What waits on a dead worker's sequence streams is answered, never left to time out.

A sequence's requests go to its worker's own stream (gateway/sequences.py), which no other worker reads:
nobody would claim them if that worker died. So each worker serving a sequence model registers its
stream, and every such worker looks, every few seconds, for registered workers whose heartbeat is gone:
one of them (a lock with a TTL) answers each request still in the dead worker's stream with
SequenceLost (the state went with the worker: the client starts the sequence again), then deletes the
stream, and sweeps it again while gateways may still route there. Requests the dead worker had already
answered were deleted from the stream when acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.cancellation import raise_if_cancelled
from fleet.envelope import decode_request, encode_reply, error_reply
from fleet.errors import InvalidInput, SequenceLost
from fleet.keys import Keys
from workers.consumer import REPLY_MAXLEN

log = logging.getLogger(__name__)

BATCH = 200  # entries answered per round trip
LOCK_S = 30
FORGET_AFTER_MS = 60_000


class SequenceReaper:
    def __init__(self, client: aioredis.Redis, keys: Keys, worker_id: str,
                 served: Callable[[], list[tuple[str, int]]], interval_s: float) -> None:
        """`served`: the (model, version) pairs of sequence models this worker serves now."""
        self._client = client
        self._keys = keys
        self._worker_id = worker_id
        self._served = served
        self._interval_s = interval_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            for model, version in self._served():
                try:
                    await self.sweep(model, version)
                except (RedisError, OSError) as exc:
                    raise_if_cancelled()
                    log.warning("cannot look for dead workers' sequences of model '%s': %s", model, exc)

    async def sweep(self, model: str, version: int) -> int:
        """Registers this worker's stream, answers what dead workers' streams hold; returns how many."""
        members_key = self._keys.sequence_workers(model, version)
        await self._client.sadd(members_key, self._worker_id)
        raw: Any = await self._client.smembers(members_key)
        answered = 0
        for member in sorted(raw):
            worker = member.decode() if isinstance(member, bytes) else str(member)
            if worker == self._worker_id or await self._client.exists(self._keys.worker(worker)):
                continue
            lock = self._keys.sequence_reaping(model, version, worker)
            if not await self._client.set(lock, self._worker_id, nx=True, ex=LOCK_S):
                continue  # another live worker is on it
            answered += await self._reap(model, version, worker)
            await self._client.delete(lock)
        return answered

    async def _reap(self, model: str, version: int, worker: str) -> int:
        stream = self._keys.sequence_queue(model, version, worker)
        answered = 0
        while True:
            entries: Any = await self._client.xrange(stream, count=BATCH)
            pipe = self._client.pipeline(transaction=False)
            for entry_id, fields in entries:
                try:
                    env = decode_request(fields[b"d"])
                except (InvalidInput, KeyError):
                    pipe.xdel(stream, entry_id)
                    continue
                flags = env.sequence
                err = SequenceLost(f"sequence {flags.id if flags else '?'} of model '{model}' was held by worker "
                                   f"'{worker}', which died and took the sequence's state with it: start the "
                                   f"sequence again (sequence_start)")
                reply = error_reply(env, err)
                pipe.xadd(env.reply_to, {b"d": encode_reply(reply)}, maxlen=REPLY_MAXLEN, approximate=True)
                pipe.xdel(stream, entry_id)
                answered += 1
            if len(entries) < BATCH:
                pipe.delete(stream)
                await pipe.execute()
                # Gateways route by the heartbeats they read a moment ago: a request may still be sent to
                # the dead worker's stream for a while. It is swept again until the worker has left the
                # registry (a minute past its last heartbeat), then forgotten.
                score = await self._client.zscore(self._keys.workers(), worker)
                if score is None or score < time.time() * 1000 - FORGET_AFTER_MS:
                    await self._client.srem(self._keys.sequence_workers(model, version), worker)
                if answered:
                    log.warning("worker %s is gone: answered %d request(s) of its sequences of model '%s'",
                                worker, answered, model)
                return answered
            await pipe.execute()
