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

from collections.abc import Iterable, Mapping, Sequence

import msgpack
import redis.asyncio as aioredis

from fleet.custom_metrics import Family, combine, decode, lasting, render
from fleet.keys import Keys


def fleet_total(parts: Mapping[str, Mapping[str, bytes]], live: Iterable[str]) -> list[Family]:
    """model -> worker id -> that worker's encoded part, summed over workers and models (a family name
    two models share is one family, as in Triton's one registry). Unreadable parts are skipped."""
    alive = set(live)
    decoded: list[list[Family]] = []
    for model in sorted(parts):
        for worker in sorted(parts[model]):
            try:
                families = decode(msgpack.unpackb(parts[model][worker], raw=False, strict_map_key=True))
            except (ValueError, TypeError, msgpack.UnpackException):
                continue
            decoded.append(families if worker in alive else lasting(families))
    return combine(decoded)


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
    return render(fleet_total(parts, live), names_in(builtin)).encode()
