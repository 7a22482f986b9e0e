"""Python models' custom metrics (`pb_utils.MetricFamily`) on the metrics port, the fleet's total.

Each worker publishes its part per model (workers/custom_metrics.py) into the model's hash, under its
own id, so a restarted worker (a new id) never counts twice. At scrape time every part is added up
(fleet/custom_metrics.py: counters, histograms and gauges are summed series by series): a live worker's
whole part, a dead worker's counters and histograms only (its last values: the fleet's totals never go
backwards), never its gauges. "Live" here: advertising some model ready in its heartbeat.

The text is written here rather than through prometheus_client's registry: that library renames every
counter `<name>_total`, and Triton's users (and its custom_metrics example) expect the model's own name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from fleet.custom_metrics import Family, combine, decode, encode, lasting, render
from fleet.keys import Keys

log = logging.getLogger(__name__)

# The hash's field for what dead workers left (their counters and histograms), folded in by a gateway
# once FOLD_AT dead workers' parts pile up (each worker start is a new field, `<worker id>/<token>`).
# Dead: no heartbeat key and out of the workers' registry, which gateways prune a minute after a
# heartbeat's expiry (gateway/state.py), so a worker merely late or stalled for seconds is never folded.
RETIRED = "~retired"
FOLD_AT = 4
FENCE_S = 7 * 24 * 3600  # how long a folded part stays fenced from writing again


def worker_of(part: str) -> str:
    """The worker id of a hash field (`<worker id>/<start token>`)."""
    return part.split("/", 1)[0]


def fleet_total(parts: Mapping[str, Mapping[str, bytes]], live: Iterable[str]) -> list[Family]:
    """model -> worker id -> that worker's encoded part, summed over workers (bounded by the caps per
    model), then over models (a family name two models share is one family, as in Triton's one
    registry). Unreadable parts are skipped."""
    alive = set(live)
    per_model: list[list[Family]] = []
    for model in sorted(parts):
        decoded: list[list[Family]] = []
        for worker in sorted(parts[model]):
            try:
                families = decode(msgpack.unpackb(parts[model][worker], raw=False, strict_map_key=True))
            except (ValueError, TypeError, msgpack.UnpackException):
                continue
            decoded.append(families if worker_of(worker) in alive else lasting(families))
        per_model.append(combine(decoded))
    return combine(per_model, bounded=False)


def names_in(exposition: bytes) -> frozenset[str]:
    """Every family and sample name a Prometheus text page already uses."""
    names: set[str] = set()
    for line in exposition.decode(errors="replace").splitlines():
        if line.startswith("# TYPE ") or line.startswith("# HELP "):
            names.add(line.split(" ", 3)[2])
        elif line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return frozenset(names)


async def custom_metrics_text(client: aioredis.Redis, keys: Keys, models: Sequence[str], live: Iterable[str],
                              builtin: bytes) -> bytes:
    """The fleet's custom metrics of `models` as Prometheus text, leaving out any family whose name the
    `builtin` page already uses. One round trip; a model whose hash cannot be read is left out."""
    if not models:
        return b""
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.hgetall(keys.custom_metrics(model))
    results = await pipe.execute(raise_on_error=False)
    parts = {model: {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}
             for model, raw in zip(models, results, strict=True) if isinstance(raw, dict) and raw}
    if not parts:
        return b""
    alive = set(live)
    for model, fields in parts.items():
        idle = sorted(w for w in fields if w != RETIRED and worker_of(w) not in alive)
        if len(idle) >= FOLD_AT:
            dead = await dead_parts(client, keys, idle)
            if len(dead) >= FOLD_AT:
                await fold_dead(client, keys, model, dead)
    return render(fleet_total(parts, alive), names_in(builtin)).encode()


async def dead_parts(client: aioredis.Redis, keys: Keys, parts: Sequence[str]) -> list[str]:
    """Those of `parts` whose worker has no heartbeat key and is out of the registry (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for part in parts:
        pipe.exists(keys.worker(worker_of(part)))
        pipe.zscore(keys.workers(), worker_of(part))
    try:
        found = await pipe.execute()
    except RedisError:
        return []
    return [p for p, beat, registered in zip(parts, found[::2], found[1::2], strict=True)
            if not beat and registered is None]


def folded(fields: Mapping[str, bytes], dead: Iterable[str]) -> bytes:
    """The RETIRED field's new value: what it held plus the dead workers' counters and histograms."""
    out = [lasting(fleet_total({"m": {RETIRED: fields[RETIRED]}}, [RETIRED]))] if RETIRED in fields else []
    out += [fleet_total({"m": {w: fields[w]}}, []) for w in dead]
    return msgpack.packb(encode(combine(out)), use_bin_type=True)  # type: ignore[no-any-return]


async def fold_dead(client: aioredis.Redis, keys: Keys, model: str, dead: Sequence[str]) -> None:
    """Fold the `dead` parts into RETIRED and drop their fields, in one optimistic transaction: a worker
    writing meanwhile, or another gateway folding, makes it give up until the next scrape, so nothing is
    counted twice. The folded parts are fenced (workers/replies.py refuses their writes); fences older
    than FENCE_S go."""
    key, fence = keys.custom_metrics(model), keys.custom_metrics_folded(model)
    try:
        async with client.pipeline(transaction=True) as pipe:
            await pipe.watch(key)
            raw = await pipe.hgetall(key)
            fields = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()
                      if isinstance(v, bytes)}
            gone = [w for w in dead if w in fields]
            if len(gone) < FOLD_AT:
                return
            now = time.time()
            pipe.multi()  # type: ignore[no-untyped-call]
            pipe.hset(key, RETIRED, folded(fields, gone))
            pipe.hdel(key, *gone)
            pipe.zadd(fence, dict.fromkeys(gone, now))
            pipe.zremrangebyscore(fence, "-inf", now - FENCE_S)
            await pipe.execute()
    except WatchError:
        return
    except RedisError as exc:
        log.warning("%s: dead workers' custom metrics could not be folded: %s", model, exc)
