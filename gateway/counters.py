"""Statistics a gateway adds itself (a response-cache hit or miss, an ensemble request), written as the
workers write theirs: one entry on the model's stats log, folded into its hash by whoever reads it
(fleet/stats.py). Off the request path: a request never waits for its statistics, and a failed write
only loses a count. Through the log, not HINCRBYs into the hash, so that `last_inference` keeps the
latest time whoever wrote last (a direct HSET could set it back past a worker's later batch).

No worker folds an ensemble's log (no worker serves it), so the gateway folds a model's log itself:
in the same round trip as a write at most once every FOLD_EVERY_S, and once more that long after a
write it did not fold, so the last entries before a quiet spell are folded too (and at close). A fold
takes a chunk (fleet/stats.py FOLD_CHUNK); one that comes back full (a backlog) folds on at once, a
chunk a round trip as a worker's does (workers/custody.py fold_statistics), up to FOLD_ROUNDS in a row.
The log stays about FOLD_EVERY_S long."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.keys import Keys
from fleet.stats import FOLD_CHUNK, LAST_INFERENCE, LOG_FIELD, field, fold_args

log = logging.getLogger(__name__)

FOLD_EVERY_S = 1.0
# The most a gateway folds in a row, a chunk a round trip (fleet/stats.py FOLD_CHUNK: no fold holds Redis
# long; 156 round trips): a longer backlog waits for this gateway's next fold (with a later write) or a
# reader's (every read of the statistics folds first).
BACKLOG_MAX = 20_000
FOLD_ROUNDS = BACKLOG_MAX // FOLD_CHUNK


class Counters:
    def __init__(self, client: aioredis.Redis, keys: Keys, monotonic: Callable[[], float] = time.monotonic,
                 fold_every_s: float = FOLD_EVERY_S) -> None:
        self.client = client
        self.keys = keys
        self._monotonic = monotonic
        self._fold_every_s = fold_every_s
        self._pending: set[asyncio.Task[None]] = set()
        self._folded_at: dict[str, float] = {}  # model -> when this gateway last folded its log (monotonic s)
        self._trailing: dict[str, asyncio.TimerHandle] = {}  # model -> its fold after an unfolded write

    def add(self, model: str, version: int, deltas: dict[str, int], last_inference: bool = True) -> None:
        """Count `deltas` into `version`'s fields of `model`'s statistics (and, if `last_inference`, now as
        its latest successful inference)."""
        entry = {field(version, name): value for name, value in deltas.items()}
        if last_inference:
            entry[field(version, LAST_INFERENCE)] = int(time.time() * 1000)
        self._spawn(self._write(model, entry))

    async def _write(self, model: str, entry: dict[str, int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.keys.stats_log(model), {LOG_FIELD: msgpack.packb(entry)})
        now = self._monotonic()
        folding = now - self._folded_at.get(model, -self._fold_every_s) >= self._fold_every_s
        if folding:
            self._folded_at[model] = now
            pipe.eval(*fold_args(self.keys, model, FOLD_CHUNK))
        elif model not in self._trailing:
            delay = self._folded_at[model] + self._fold_every_s - now
            self._trailing[model] = asyncio.get_running_loop().call_later(delay, self._fold_later, model)
        try:
            results = await pipe.execute()
        except RedisError as exc:
            log.warning("cannot add to the statistics of %s: %s", model, exc)
            return
        if folding and results[-1] == FOLD_CHUNK:
            self._spawn(self._fold(model, FOLD_ROUNDS - 1))  # a backlog: on at once

    def _fold_later(self, model: str) -> None:
        self._trailing.pop(model, None)
        self._spawn(self._fold(model, FOLD_ROUNDS))

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _fold(self, model: str, rounds: int) -> None:
        for _ in range(rounds):
            self._folded_at[model] = self._monotonic()
            try:
                folded = await self.client.eval(*fold_args(self.keys, model, FOLD_CHUNK))
            except RedisError as exc:
                log.warning("cannot fold the statistics of %s: %s", model, exc)
                return
            if folded != FOLD_CHUNK:
                return

    async def drain(self) -> None:
        """Until what was added (and the folds it started) is written, for at most 5 s."""
        give_up_at = time.monotonic() + 5
        while self._pending and (left := give_up_at - time.monotonic()) > 0:
            await asyncio.wait(list(self._pending), timeout=left)

    async def close(self) -> None:
        """The gateway stops: write what is pending and fold now what waited for a later fold."""
        await self.drain()
        trailing, self._trailing = self._trailing, {}
        for handle in trailing.values():
            handle.cancel()
        await asyncio.gather(*(self._fold(model, FOLD_ROUNDS) for model in trailing))
