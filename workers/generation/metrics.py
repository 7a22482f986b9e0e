"""What a generation engine measures, kept where the gateway reads every other statistic: the model's stats
hash in Redis (fleet/stats.py), so /stats and /metrics are fleet-wide sums.

Counters and histogram buckets are added (HINCRBY) by every worker; the state gauges (running, waiting,
KV blocks used) are each worker's own fields, set (HSET) and summed by the gateway over the workers alive.
The engine thread records; `drain()` hands the deltas to the writer at most once per `FLUSH_S`.
Histogram buckets are vLLM's, since its metric names are what LLM dashboards read (fleet/llm_stats.py).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

from fleet.llm_stats import ITL_BUCKETS_S, TTFT_BUCKETS_S, gauge_field, llm_field

FLUSH_S = 1.0

# (model, increments, gauges) -> written to the model's stats hash
Writer = Callable[[str, dict[str, int], dict[str, int]], None]


class GenerationMetrics:
    def __init__(self, model: str, version: int, worker: str, writer: Writer | None) -> None:
        self._model = model
        self._version = version
        self._worker = worker
        self._writer = writer
        self._lock = threading.Lock()
        self._incr: dict[str, int] = {}
        self._gauges: dict[str, int] = {}
        self._flushed = 0.0
        self._dirty = False

    def _add(self, name: str, value: int) -> None:
        self._dirty = True
        if value:
            key = llm_field(self._version, name)
            self._incr[key] = self._incr.get(key, 0) + value

    def _histogram(self, name: str, buckets: tuple[float, ...], ns: int) -> None:
        self._add(f"{name}:{bisect.bisect_left(buckets, ns / 1e9)}", 1)
        self._add(f"{name}:sum_us", ns // 1000)
        self._add(f"{name}:count", 1)

    # ------------------------------------------------------------------ the engine thread

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self._add("prompt_tokens", prompt_tokens)
            self._add("requests", 1)

    def first_token(self, ns: int) -> None:
        with self._lock:
            self._histogram("ttft", TTFT_BUCKETS_S, ns)

    def next_token(self, ns: int) -> None:
        with self._lock:
            self._histogram("itl", ITL_BUCKETS_S, ns)

    def iteration(self, decoded: int, prefilled: int, ns: int) -> None:
        with self._lock:
            self._add("iterations", 1)
            self._add("iteration_us", ns // 1000)
            self._add("decode_tokens", decoded)
            self._add("prefill_tokens", prefilled)

    def preempted(self, n: int) -> None:
        with self._lock:
            self._add("preemptions", n)

    def cancelled_requests(self, n: int) -> None:
        with self._lock:
            self._add("cancel_requests", n)

    def finished(self, why: str, generated: int) -> None:
        with self._lock:
            self._add(f"finished:{why}", 1)
            self._add("generation_tokens", generated)

    def state(self, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        with self._lock:
            for name, value in (("running", running), ("waiting", waiting), ("kv_used", kv_used),
                                ("kv_total", kv_total)):
                key = gauge_field(self._version, name, self._worker)
                if self._gauges.get(key) != value:
                    self._gauges[key] = value
                    self._dirty = True
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Writes what accumulated, at most once per FLUSH_S unless forced (a Redis hiccup loses nothing
        but the time: the deltas are kept for the next try)."""
        now = time.monotonic()
        if self._writer is None or not self._dirty or (not force and now - self._flushed < FLUSH_S):
            return
        self._flushed = now
        with self._lock:
            incr, self._incr = self._incr, {}
            gauges = dict(self._gauges)
            self._dirty = False
        try:
            self._writer(self._model, incr, gauges)
        except Exception:
            with self._lock:
                for k, v in incr.items():
                    self._incr[k] = self._incr.get(k, 0) + v
                self._dirty = True

    def snapshot(self) -> dict[str, int]:
        """The deltas not yet written (tests)."""
        with self._lock:
            return dict(self._incr)
