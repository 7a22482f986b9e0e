"""Triton's response cache (`response_cache { enable: true }` in a model's config, `--cache-config
local,size=BYTES` on the server), kept in Redis: one cache for the whole fleet, so a response one
gateway computed answers the same request at every other gateway (Triton's is per server).

* The key is a hash of the canonical request: model, version, every input (name, datatype, shape,
  bytes) in name order, the requested outputs and the request's parameters (a Python model may read
  them). Priority, timeout and the id do not change the answer, so they are not in it.
* Entries are the reply envelopes (fleet/envelope.py) in one hash; a sorted set orders them by last
  use; a counter holds their total size. Inserting past the budget evicts the least recently used,
  in the same Lua script, so the bound holds with any number of gateways. Errors are never cached.
  All keys share the hash tag `{cache}` (one Redis Cluster slot).
* Statistics as Triton's: a hit counts as a success (and its queue time, from arrival to the
  lookup) plus `cache_hit` (the lookup); a miss adds `cache_miss` (lookup and insert) to the
  statistics the worker records for computing it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleet.envelope import ReplyEnvelope, encode_reply, readable_reply
from fleet.errors import ConfigError, InvalidInput
from fleet.kserve import ParsedInfer
from fleet.latency_stats import bucket_deltas
from gateway.counters import Counters

log = logging.getLogger(__name__)

# Last use is scored on Redis's clock (TIME), so gateways' clocks never reorder the LRU.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""
_LOOKUP = _NOW + """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value then redis.call('ZADD', KEYS[2], now, ARGV[1]) end
return value
"""

_INSERT = _NOW + """
local id, value, budget = ARGV[1], ARGV[2], tonumber(ARGV[3])
local size = string.len(value)
if size > budget then return 0 end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
if redis.call('ZCARD', KEYS[2]) == 0 then
  -- Nothing indexed (first use, or the keys were lost): start the count afresh with what is there.
  redis.call('DEL', KEYS[1])
  total = 0
end
total = total - redis.call('HSTRLEN', KEYS[1], id) + size
redis.call('HSET', KEYS[1], id, value)
redis.call('ZADD', KEYS[2], now, id)
local evicted = 0
while total > budget do
  local victim = redis.call('ZPOPMIN', KEYS[2])
  if #victim == 0 then break end
  total = total - redis.call('HSTRLEN', KEYS[1], victim[1])
  redis.call('HDEL', KEYS[1], victim[1])
  evicted = evicted + 1
end
redis.call('SET', KEYS[3], total)
return evicted + 1
"""


def parse_cache_config(text: str) -> int:
    """`--cache-config`'s value, Triton's `local,size=BYTES` (fleet's cache lives in Redis whatever the
    name; `redis,size=BYTES` is accepted too): the byte budget; "" = no cache."""
    if not text:
        return 0
    name, _, rest = text.partition(",")
    if name not in ("local", "redis"):
        raise ConfigError(f"--cache-config: unknown cache '{name}' (fleet keeps 'local' in Redis)")
    options = dict(item.partition("=")[::2] for item in rest.split(",") if item)
    try:
        size = int(options.get("size", ""))
    except ValueError:
        raise ConfigError(f"--cache-config {text}: 'size' must be a number of bytes") from None
    if size <= 0:
        raise ConfigError(f"--cache-config {text}: 'size' must be positive")
    return size


def cache_key(model: str, version: int, req: ParsedInfer, gen: str = "") -> str:
    """The hash of the canonical request (see the module doc); `gen`, the model's generation, keeps a
    reloaded model from answering with what its previous load computed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{model}\0{version}\0{gen}\0".encode())
    for t in sorted(req.inputs, key=lambda t: t.name):
        h.update(f"{t.name}\0{t.datatype}\0{list(t.shape)}\0{len(t.data)}\0".encode())
        h.update(t.data)
    outputs = sorted(req.outputs) if req.outputs is not None else None
    try:
        params = json.dumps(req.parameters, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        raise InvalidInput("request parameters cannot be hashed for the response cache") from None
    h.update(f"\0{outputs}\0{params}".encode())
    return h.hexdigest()


class ResponseCache:
    def __init__(self, client: aioredis.Redis, prefix: str, budget_bytes: int, counters: Counters) -> None:
        self.client = client
        self.counters = counters
        self.budget_bytes = budget_bytes
        self.keys = [f"{prefix}:{{cache}}:entries", f"{prefix}:{{cache}}:lru", f"{prefix}:{{cache}}:bytes"]
        self._lookup = client.register_script(_LOOKUP)
        self._insert = client.register_script(_INSERT)
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    async def lookup(self, key: str) -> ReplyEnvelope | None:
        """The cached reply, or None (also when Redis fails: a cache never fails a request)."""
        try:
            raw = await self._lookup(keys=self.keys[:2], args=[key])
        except RedisError as exc:
            log.warning("response cache lookup failed: %s", exc)
            return None
        # An entry this gateway cannot read is a miss, never a failed request.
        return readable_reply(raw, f"the response cache's entry {key}") if raw is not None else None

    def insert_later(self, key: str, reply: ReplyEnvelope, model: str, version: int, lookup_ns: int) -> None:
        """Store a successful reply off the request path, then count the miss (lookup + insert)."""
        if not reply.ok:
            return
        task = asyncio.ensure_future(self._insert_and_count(key, reply, model, version, lookup_ns))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _insert_and_count(self, key: str, reply: ReplyEnvelope, model: str, version: int,
                                lookup_ns: int) -> None:
        started = time.perf_counter_ns()
        # In band: gateways of either side of the out-of-band envelope share the cache (fleet/envelope.py).
        stored = ReplyEnvelope(id="", model_version=reply.model_version, outputs=reply.outputs,
                               parameters=reply.parameters, out_of_band=False)
        try:
            await self._insert(keys=self.keys, args=[key, encode_reply(stored), self.budget_bytes])
            took = lookup_ns + time.perf_counter_ns() - started
            self.counters.add(model, version, {"cache_miss:count": 1, "cache_miss:ns": took},
                              last_inference=False)
        except RedisError as exc:
            log.warning("response cache insert failed: %s", exc)

    def count_hit(self, model: str, version: int, rows: int, request_ns: int, lookup_ns: int) -> None:
        """A hit's statistics, as Triton counts them (a success that never executed; queue time 0), its
        latency buckets included, so that the histograms' counts and sums agree with these."""
        self.counters.add(model, version, {"success:count": 1, "success:ns": request_ns, "queue:count": 1,
                                           "cache_hit:count": 1, "cache_hit:ns": lookup_ns,
                                           "inference_count": rows,
                                           **bucket_deltas("request", (request_ns // 1000,)),
                                           **bucket_deltas("queue", (0,))})

    async def drain(self) -> None:
        """Inserts and counts still in flight, done (tests, and a stopping gateway)."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=5)
        await self.counters.drain()

    async def usage(self) -> tuple[int, int]:
        """(entries, bytes) now in the cache."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hlen(self.keys[0])
        pipe.get(self.keys[2])
        entries, total = await pipe.execute()
        return int(entries), int(total or 0)
