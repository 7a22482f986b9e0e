"""What /metrics and the status page read of each model in Redis, queued in the caller's pipeline and
taken back from its results: the stats hash (its log folded in first), the dead-letter stream's length,
and per version and lane the stream's length and what the workers' group has delivered and not
acknowledged (XPENDING's count). One place, so that both figures of "waiting" (unread) and "in flight"
(delivered) agree."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fleet.admission import lane_count
from fleet.keys import GROUP, Keys
from fleet.stats import fold_args
from fleet.status_build import StreamReading
from gateway.catalog import Catalog


@dataclass(frozen=True, slots=True)
class ModelQueues:
    name: str
    stats: dict[str, int]  # the decoded stats hash ({} for none)
    dead_letters: int
    streams: tuple[StreamReading, ...]  # by version, then lane

    def waiting(self, version: int) -> list[int]:
        """Per lane of `version`: entries no worker has read yet."""
        return [s.waiting for s in self.streams if s.version == version]


def lanes_of(catalog: Catalog, name: str) -> int:
    """How many lanes `name`'s versions have (fleet/admission.py), the bulk lane (the last) included; 0
    for an ensemble (the gateway runs its steps on the step models' own streams) or an unknown model."""
    view = catalog.views.get(name)
    return 0 if view is None or view.entry.spec.ensemble else lane_count(view.entry.spec)


def streams_of(catalog: Catalog, name: str) -> list[tuple[int, int]]:
    """(version, lane) of every stream of `name`."""
    view = catalog.views.get(name)
    lanes = lanes_of(catalog, name)
    return [(v, lane) for v in view.entry.versions for lane in range(lanes)] if view is not None else []


def queue_reads(pipe: Any, keys: Keys, name: str, streams: list[tuple[int, int]]) -> None:
    pipe.eval(*fold_args(keys, name))  # the batches the workers logged, into the hash first (fleet/stats.py)
    pipe.hgetall(keys.stats(name))
    pipe.xlen(keys.dead(name))
    for version, lane in streams:
        pipe.xlen(keys.queue(name, lane, version=version))
        pipe.xpending(keys.queue(name, lane, version=version), GROUP)


def take_reads(results: Iterator[Any], name: str, streams: list[tuple[int, int]]) -> ModelQueues:
    """What queue_reads queued, from the pipeline's results (raise_on_error=False: an error reply, such
    as no stream or group yet, counts 0)."""
    _folded, stats, dead = next(results), next(results), next(results)
    readings = []
    for version, lane in streams:
        length, pending = next(results), next(results)
        delivered = int(pending.get("pending", 0)) if isinstance(pending, dict) else 0
        readings.append(StreamReading(version, lane, _int(length), delivered))
    return ModelQueues(name, decoded(stats), _int(dead), tuple(readings))


def decoded(raw: object) -> dict[str, int]:
    """A hash of integers as HGETALL returned it ({} for an error or a missing key)."""
    return {k.decode(): int(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def text(value: object) -> str:
    """A Redis reply value as text (None: "")."""
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0
