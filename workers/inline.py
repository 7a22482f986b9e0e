"""When the worker's event loop computes a batch itself instead of handing it to the instance's thread.

An in-process CPU model (TorchScript, ONNX) computes on its instance's thread: the loop hands each batch
over and the thread hands the outcome back, a wake-up each way (~35 and ~140 µs of a C=1 request on this
project's 2-core host, bench/RESULTS.md stop 41). Under load that thread is what lets the loop read, batch
and answer while a forward runs. With nothing else to do, the loop may as well compute the batch itself:
at `mlp` C=1 the worker's context switches fell from 5.3 to 2.0 a request (stop 43). So the loop computes
a batch (workers/instance.py's `Instance._inline`) only when all of these hold:

- the backend computes in this process, on the CPU, on the calling thread (`Backend.runs_inline`), and
  the instance has no rate limiter to wait for;
- the batch is one request, with no more input bytes than the last one-request batch this instance
  answered without an error, and that one took at most `max_ns` (LoopConfig.inline_max_us): about the
  longest the loop is held (bytes, not rows: a model with variable dims takes larger inputs in a row);
- the model's last batches (LONE_BATCHES) were lone requests too: its clients send one at a time (for a
  model without dynamic batching every batch is one request, and this says nothing more than the next);
- nothing else of the model is queued or staged, and no other instance of it is running, both when the
  batch is started and when the loop gets to computing it (after the driver's step);
- a hang would be caught: the watchdog runs on the loop, so while the loop computes a thread watches
  (workers/watchdog.py's `guard_inline`), and none is computed where no limit is set.

The loop is the worker's, shared by its models: while it computes, the other models' requests wait too
(for `max_ns` at most), though only this model's queue is looked at.
"""

from __future__ import annotations

from dataclasses import dataclass

# The model's last batches were all lone requests (this one, and the two before): its clients send one at
# a time. Under load a lone request is often the first of many on their way (after a large batch, its
# clients' next requests arrive one by one); computed by the loop, it would keep the rest from being read
# until it is done. Counted at `mlp` C=32: without this rule the loop computed 667 of 2,000 batches
# started, with it 6; at C=1, 14,823 of 16,000 (bench/RESULTS.md, stop 43).
LONE_BATCHES = 3


@dataclass(frozen=True, slots=True)
class SoloCost:
    """An instance's last one-request batch answered without an error: its input bytes, and how long it
    took to compute (ns)."""

    nbytes: int
    ns: int


def may_inline(lone_batches: int, nbytes: int, last: SoloCost | None, queued: int, others_running: bool,
               max_ns: int) -> bool:
    """Whether the loop computes a batch of one request of `nbytes` itself (the instance can, and the
    watchdog guards it). `lone_batches`: how many of the model's batches in a row, this one included, were
    one request each; `queued`: the model's requests waiting besides this one (every version's);
    `others_running`: another instance of the model is computing."""
    return (max_ns > 0 and lone_batches >= LONE_BATCHES and queued == 0 and not others_running
            and last is not None and nbytes <= last.nbytes and last.ns <= max_ns)
