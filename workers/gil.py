"""The interpreter's thread switch interval: 0.5 ms while a worker serves online traffic, 0.1 ms while bulk
batches run.

A TorchScript forward gives up the GIL and takes it back at its end (it also did so midway, before
workers/backends/torch_backend.py held its inputs for the call); whenever the event loop is running
Python at that moment, the compute thread waits up to the switch interval. Measured, with the midway
wait still there, on mlp (2 ms per 64-row batch) against a loop thread busy all the time: 12.4 / 3.2 /
2.35 ms per batch at 5 (CPython's default) / 0.5 / 0.1 ms. A short interval made bulk jobs ~9% faster,
but 0.1 ms cost online serving ~13% at C=32 (the loop is preempted more often), so that one is set only while bulk
batches are running and put back once none has run for a second. Online, 0.5 ms: with an instance's
thread taking the GIL as it starts a batch (workers/instance.py), it served mlp at C=32 1.01-1.10x of
the default in five interleaved passes, `double` (no instance thread) 0.84-1.06x (bench/RESULTS.md, stop 45).
"""

from __future__ import annotations

import sys

ONLINE_INTERVAL_S = 0.0005
BULK_INTERVAL_S = 0.0001
IDLE_AFTER_US = 1_000_000

_bulk_seen_us = 0
_short = False


def serving() -> None:
    """The worker process starts serving: the online interval."""
    sys.setswitchinterval(ONLINE_INTERVAL_S)


def bulk_batch_started(now_us: int) -> None:
    global _bulk_seen_us, _short
    _bulk_seen_us = now_us
    if not _short:
        sys.setswitchinterval(BULK_INTERVAL_S)
        _short = True


def maybe_restore(now_us: int) -> None:
    global _short
    if _short and now_us - _bulk_seen_us > IDLE_AFTER_US:
        sys.setswitchinterval(ONLINE_INTERVAL_S)
        _short = False


def batch_started(bulk: bool, now_us: int) -> None:
    """A batch is handed to an instance: a bulk one shortens the interval, an online one may restore it."""
    if bulk:
        bulk_batch_started(now_us)
    else:
        maybe_restore(now_us)
