"""When the worker's event loop computes a batch itself instead of handing it to the instance's thread.

An in-process CPU model (TorchScript, ONNX) computes on its instance's thread: the loop hands each batch
over and the thread hands the outcome back, a wake-up each way (~35 and ~140 µs of a C=1 request on this
project's 2-core host, bench/RESULTS.md stop 41), and the two take turns at the GIL. Computed by the loop,
a batch costs neither: at `mlp` C=1 the worker's context switches fell from 5.3 to 2.0 a request (stop 43).
Under load the worker then goes round the cycle of bench/floor.py: read what the streams have (the whole
flush: workers/loop.py's `_top_up`), compute it as one batch, write the replies, read again. At `mlp`
C=32 that served 1.12-1.14x what handing its batches to the thread did (stop 55). So the loop computes a batch
(workers/instance.py's `Instance._inline`) when all of these hold:

- the backend computes in this process, on the CPU, on the calling thread (`Backend.runs_inline`), and
  the instance has no rate limiter to wait for;
- the batch should take at most `max_ns` (LoopConfig.inline_max_us), about the longest the loop computes
  one (the host's other work on its core holds it longer): `Costs.predict` says so from the batches the
  instance computed before (by input bytes, not rows: a model with variable dims takes larger inputs in a
  row), each as `batch_cost` measures it (below). Nothing measured yet: the thread computes it;
- the batch has no bulk-lane request: a bulk job wants throughput, and the loop's work on its requests
  (reading, decoding, writing the replies) then goes on beside the thread's compute on the other core.
  Computed by the loop, `bench/bulk.py`'s offline job ran at 0.80-0.83x direct against 0.91-0.92x (stop 55);
- no other model (or version) on this worker holds a request not yet answered: they share the loop, and
  while it computes they wait, their replies and a Python-backend stub's calls too. Measured with `mlp` and
  `double` at C=16 each on one worker, computed by the loop whatever the others held: `mlp` 1.30x, `double`
  0.84x (stop 55). So the loop computes where its model has the worker to itself;
- no other instance of the model version is running, both when the batch is started and when the loop gets to
  computing it (after the driver's step): the loop would hold back its report and its next batch;
- where the model version has other instances (`sole` false), also: nothing else of it is queued or staged,
  and its last batches (LONE_BATCHES) were lone requests too, i.e. its clients send one at a time. Under
  load the other instances can take what arrives while one computes, which they cannot while the loop does
  (and a batch staged behind a running one is queued: the thread computes it);
- a hang would be caught: the watchdog runs on the loop, so while the loop computes a thread watches
  (workers/watchdog.py's `guard_inline`), and none is computed where no limit is set.

A model whose batches take longer (or one on several threads, or a GPU) computes on its instance's thread,
and the loop serves the others meanwhile. A request of another model that arrives while the loop computes
waits for it (about `max_ns` at most; but see `fork` below).

What a batch costs (`batch_cost`): computed by the loop, its wall time, how long it held the loop. Computed
by the instance's thread, that thread's CPU time: there the batch also waits for the GIL (the loop holds it
through its own work) and for a core, which it would not on the loop. Measured in wall time on the thread
too, a model whose batches once went over the limit looked dearer on the thread than it would be on the
loop and stayed there: on the 2-vCPU host of stops 57-61, `mlp` at C=32 had most of its batches on the
thread (py-spy), its forward 1.6x as long a request as computed by the loop. A model whose forward works on
other threads (TorchScript's `fork`) counts cheap on its thread and dear on the loop, so its batches of a
size take turns: the loop computes every other one, for as long as it takes (not seen in the models here).

Why 5000 µs (2000 until stop 61, set on a faster host in stop 55): on the slower host `mlp`'s batches at
C=32 take 0.6-2.8 ms of CPU (memory-bound: its 6 MB of weights leave the caches between batches, so a lone
request costs 0.6-0.85 ms), and with 2000 the thread computed most of them; 5000 served 1.04-1.27x what 2000
did at C=32 and 1.00-1.21x at C=64, alternated on one host; with the costs as above, 1.28x over HTTP and
1.33x over gRPC at C=32 (bench/RESULTS.md, stop 61). The limit carries that gain: with it at 5000, wall time
and CPU time on the thread served alike there. CPU time is kept because it is what the loop would spend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batching.holding import Holding

# The model's last batches were all lone requests (this one, and the two before): its clients send one at
# a time. Under load a lone request is often the first of many on their way; computed by the loop, it
# would keep the rest from being read, and from the other instances, until it is done. Counted at `mlp`
# C=32 on one instance, before the top-up read: without this rule the loop computed 667 of 2,000 batches
# started, with it 6 (bench/RESULTS.md, stop 43). Only asked where the model version has other instances.
LONE_BATCHES = 3


@dataclass(slots=True)
class Costs:
    """What an instance's batches cost (ns, as `batch_cost` measures them: wall time on the loop, CPU time
    on the thread), by input bytes: the last batch answered without an error in each power-of-two band of
    sizes, so a lone request now and then does not make the next batch look dear (nor a batch the next lone
    request)."""

    _by_band: dict[int, tuple[int, int]] = field(default_factory=dict)  # bit_length(nbytes) -> (nbytes, ns)

    def measured(self, nbytes: int, ns: int) -> None:
        self._by_band[nbytes.bit_length()] = (nbytes, ns)

    def predict(self, nbytes: int) -> int | None:
        """What a batch of `nbytes` input bytes should take at most (ns); None: nothing measured yet. Where
        a larger batch costs no less and twice the bytes no more than twice the time (a fixed part and a part
        in proportion), a batch measured bounds it: by its own time if it was at least as large, else by its
        time scaled up by the bytes. The last one of its own band of sizes says (however cheaper others
        were: a batch as large that just took longer is not computed by the loop again on their word); with
        none there, the smallest bound of the others."""
        own = self._by_band.get(nbytes.bit_length())
        if own is not None:
            return _bound(own, nbytes)
        return min((_bound(m, nbytes) for m in self._by_band.values()), default=None)


def batch_cost(wall_ns: int, cpu_ns: int, on_the_loop: bool) -> int:
    """What a batch cost, for `Costs` (see above): computed by the loop, its wall time; by the instance's
    thread, that thread's CPU time (`cpu_ns`, BatchOutcome's; -1 if not measured: the wall time)."""
    return cpu_ns if not on_the_loop and cpu_ns >= 0 else wall_ns


def _bound(measured: tuple[int, int], nbytes: int) -> int:
    measured_bytes, ns = measured
    return ns if measured_bytes >= nbytes else -(-ns * nbytes // max(1, measured_bytes))


class Neighbours:
    """The model loops of one worker (each version of each model it serves), which share its event loop:
    what each holds, so that one may ask whether another holds requests not yet answered."""

    def __init__(self) -> None:
        self._holdings: list[Holding] = []

    def add(self, holding: Holding) -> None:
        self._holdings.append(holding)

    def remove(self, holding: Holding) -> None:
        self._holdings = [h for h in self._holdings if h is not holding]

    def others_hold(self, mine: Holding) -> bool:
        return any(h.rows() for h in self._holdings if h is not mine)


def may_inline(predicted_ns: int | None, max_ns: int, *, bulk: bool, neighbours_hold: bool, sole: bool,
               others_running: bool, lone_batches: int, queued: int) -> bool:
    """Whether the loop computes a batch predicted to take `predicted_ns` itself (the instance can, and the
    watchdog guards it). `bulk`: the batch has a bulk-lane request; `neighbours_hold`: another model loop of
    the worker holds requests not yet answered; `sole`: the instance is the only one of its model version;
    `others_running`: another instance of it is computing; `lone_batches`: how many of its batches in a row,
    this one included, were one request each; `queued`: its requests waiting besides this batch."""
    if (max_ns <= 0 or bulk or neighbours_hold or predicted_ns is None or predicted_ns > max_ns
            or others_running):
        return False
    return sole or (lone_batches >= LONE_BATCHES and queued == 0)
