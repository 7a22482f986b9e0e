"""One worker's part of its Python models' custom metrics (fleet/custom_metrics.py has the rules).

Each stub process reports snapshots of its families (workers/backends/python_backend.py passes them on);
the book keeps the latest per stub and, per model, what stopped stubs left behind (their counters and
histograms: a stub restarted after a crash starts from zero, and the model's totals must not go
backwards). This worker's part for a model is all of that combined; it is published whole, under the
worker's id, each time it changes: the gateways add up the workers' parts.

Thread-safe: stubs report from their reader and instance threads. Publishing happens under the lock, so
an older part never overwrites a newer one; the publish callable is a blocking Redis write (one HSET),
made before the execute() call that carried the change returns, so a caller that has its response
finds its effect on the metrics port, as with Triton.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgpack

from fleet.custom_metrics import Family, combine, decode, encode, lasting

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], None]  # (model, this worker's encoded part); raises on a Redis error


class CustomMetricsBook:
    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self._lock = threading.Lock()
        self._live: dict[str, dict[str, list[Family]]] = {}  # model -> stub key -> its latest snapshot
        self._left: dict[str, list[Family]] = {}  # model -> what its stopped stubs left
        self._unpublished: set[str] = set()  # models whose last publish failed

    def report(self, model: str, stub: str, snapshot: object) -> None:
        """A stub's snapshot (wire form, as it sent it); malformed parts are dropped (decode)."""
        families = decode(snapshot)
        with self._lock:
            self._live.setdefault(model, {})[stub] = families
            self._publish_locked(model)

    def retire(self, model: str, stub: str) -> None:
        """The stub stopped (crashed, restarted or closed): keep its counters and histograms."""
        with self._lock:
            families = self._live.get(model, {}).pop(stub, None)
            if families is None:
                return
            self._left[model] = combine([self._left.get(model, []), lasting(families)])
            self._publish_locked(model)

    def part(self, model: str) -> list[Family]:
        """This worker's part for `model`: what stopped stubs left plus every live stub's snapshot."""
        with self._lock:
            return self._part_locked(model)

    def _part_locked(self, model: str) -> list[Family]:
        return combine([self._left.get(model, []), *self._live.get(model, {}).values()])

    def _publish_locked(self, model: str) -> None:
        for name in sorted(self._unpublished | {model}):
            blob: bytes = msgpack.packb(encode(self._part_locked(name)), use_bin_type=True)
            try:
                self._publish(name, blob)
                self._unpublished.discard(name)
            except Exception as exc:  # Redis away: metrics must never fail an inference; next change retries
                if name not in self._unpublished:
                    log.warning("%s: custom metrics could not be published: %s", name, exc)
                self._unpublished.add(name)
