"""The generation engine of one model version on one worker: a thread that runs continuous batching
(batching/continuous.py decides, this carries out) over a PagedLlama.

Each iteration: take new requests and cancellations; `step()` says what to prefill and decode; one
forward pass for all of it; each sequence that produced a token samples it (its own parameters and
generator), detokenises it, checks EOS and stop strings and sends what text is ready to its caller; then
`report()` retires the finished, whose slots and KV blocks the next iteration hands on. A cancelled
request leaves at the next iteration; a preempted one loses its KV blocks and is prefilled anew later.

Thread-safety: `submit`/`cancel`/`close` from any thread; everything else is the engine thread's.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from batching.continuous import ContinuousConfig, ContinuousScheduler, Finish, TooLong
from fleet.errors import InferenceFailed, InvalidInput, ModelNotReady, RequestTimeout, ServingError
from workers.generation.metrics import FLUSH_S, GenerationMetrics
from workers.generation.outbox import Outbox
from workers.generation.paged_llama import PagedLlama, Segment
from workers.generation.sampling import SamplingParams, generator_for, next_token
from workers.generation.text import Detokenizer, StopText

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Generation:
    """One request in the engine. `on_text(gen, text, ids)`: called on the engine thread with each piece of
    text released while streaming; `on_done(gen)`: once, when it ends (finish or error set)."""

    key: str
    prompt: list[int]
    params: SamplingParams
    on_done: Callable[[Generation], None]
    on_text: Callable[[Generation, str, list[int]], None] | None = None
    lane: int = 0
    generated: list[int] = field(default_factory=list)
    finish: str | None = None  # "length", "stop" or "cancelled"
    error: ServingError | None = None
    submitted_ns: int = 0
    first_ns: int = 0
    last_ns: int = 0
    unsent: list[int] = field(default_factory=list)  # streamed ids not yet sent with their text
    text: StopText | None = None
    _detok: Detokenizer | None = None
    _rng: torch.Generator | None = None

    @property
    def length(self) -> int:
        """Its context: the prompt and what it generated so far."""
        return len(self.prompt) + len(self.generated)

    def tokens(self, start: int, end: int) -> list[int]:
        """Context tokens [start, end), without building the whole context (a prefill chunk's)."""
        n = len(self.prompt)
        return (self.prompt[start:end] if start < n else []) + self.generated[max(0, start - n):max(0, end - n)]


class Engine:
    def __init__(self, model: PagedLlama, tokenizer: Any, config: ContinuousConfig, eos: set[int],
                 metrics: GenerationMetrics, name: str = "llm", outbox: Outbox | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos = eos
        self.metrics = metrics
        self._scheduler = ContinuousScheduler(config)
        self._gens: dict[str, Generation] = {}
        self._new: list[Generation] = []
        self._cancel: set[str] = set()
        self._cv = threading.Condition()
        self._closed = False
        self._order = itertools.count()
        self.last_iteration = time.monotonic()  # the watchdog's sign of life (workers/backends/llm.py)
        self.outbox = outbox  # where the backend sends streamed responses (workers/generation/outbox.py)
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def submit(self, gen: Generation) -> None:
        gen.submitted_ns = time.perf_counter_ns()
        with self._cv:
            if self._closed:
                raise ModelNotReady("the model is unloading")
            self._new.append(gen)
            self._cv.notify()

    def cancel(self, keys: list[str]) -> None:
        with self._cv:
            self._cancel.update(keys)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug in the engine: every caller gets an error, not a hang
            log.exception("generation engine failed")
            self._fail_all(InferenceFailed(f"the generation engine failed: {type(exc).__name__}: {exc}"))
            raise
        self._fail_all(ModelNotReady("the model is unloading"))

    def _fail_all(self, error: ServingError) -> None:
        with self._cv:
            self._closed = True
            pending = [*self._gens.values(), *self._new]
            self._gens.clear()
            self._new.clear()
        for gen in pending:
            if gen.finish is None and gen.error is None:
                gen.error = error
                gen.on_done(gen)

    def _iterate(self) -> bool:
        sched = self._scheduler
        with self._cv:
            while not self._closed and not self._new and not self._cancel and not sched.busy():
                if not self._cv.wait(timeout=FLUSH_S):
                    self.metrics.flush(force=True)  # idle: the last state goes out too
            if self._closed:
                return False
        self.last_iteration = time.monotonic()
        with self._cv:
            new, self._new = self._new, []
            cancel, self._cancel = self._cancel, set()
        for gen in new:
            self._admit(gen)
        cancel &= self._gens.keys()  # callers of other engines' requests are told every slot of the model
        sched.cancel(cancel)
        self.metrics.cancelled_requests(len(cancel))
        it = sched.step(time.perf_counter_ns() // 1000)
        for key in it.preempted:
            self.model.kv.release(key)
        self.metrics.preempted(len(it.preempted))
        for key, why in it.finished:
            self._end(key, why)
        if it.empty:
            sched.report()
            self._observe()
            return True
        gens = self._gens
        segments = [Segment(k, gens[k].generated[-1:], gens[k].length - 1, True) for k in it.decode]
        segments += [Segment(c.request_id, gens[c.request_id].tokens(c.start, c.end), c.start, c.last)
                     for c in it.prefill]
        for s in segments:
            self.model.kv.ensure(s.key, s.start + len(s.tokens))
        started = time.perf_counter_ns()
        logits = self.model.forward(segments)
        now = time.perf_counter_ns()
        self.metrics.iteration(len(it.decode), sum(len(s.tokens) for s in segments) - len(it.decode),
                               now - started)
        stopped = {key for key, row in logits.items() if self._token(self._gens[key], row, now)}
        for key, why in sched.report(stopped):
            self._end(key, why)
        self._observe()
        return True

    def _observe(self) -> None:
        self.metrics.state(len(self._scheduler.running()), len(self._scheduler.waiting()),
                           self.model.kv.used_blocks, self.config.kv_blocks)

    def _admit(self, gen: Generation) -> None:
        try:
            self._scheduler.add(gen.key, len(gen.prompt), gen.params.max_tokens, lane=gen.lane,
                                order=next(self._order))
        except (TooLong, ValueError) as exc:
            gen.error = InvalidInput(str(exc))
            gen.on_done(gen)
            return
        gen.text = StopText(gen.params.stop)
        gen._detok = Detokenizer(self.tokenizer, gen.prompt)
        gen._rng = generator_for(gen.params)
        self._gens[gen.key] = gen
        self.metrics.admitted(len(gen.prompt))

    def _token(self, gen: Generation, row: torch.Tensor, now: int) -> bool:
        """Takes the sequence's next token; whether it ended the generation (EOS or a stop string)."""
        history = gen.tokens(0, gen.length) if gen.params.repetition_penalty != 1.0 else []
        token = next_token(row, gen.params, history, gen._rng)
        if not gen.generated:
            gen.first_ns = now
            self.metrics.first_token(now - gen.submitted_ns)
        else:
            self.metrics.next_token(now - gen.last_ns)
        gen.last_ns = now
        gen.generated.append(token)
        assert gen.text is not None and gen._detok is not None
        if token in self.eos and not gen.params.ignore_eos:
            return True
        piece = gen.text.add(gen._detok.add(token))
        gen.unsent.append(token)
        if piece and gen.on_text is not None:
            ids, gen.unsent = gen.unsent, []
            gen.on_text(gen, piece, ids)
        return gen.text.stopped

    def _end(self, key: str, why: Finish) -> None:
        gen = self._gens.pop(key)
        self.model.kv.release(key)
        if why is Finish.EXPIRED:
            gen.error = RequestTimeout()
        else:
            gen.finish = why.value
        self.metrics.finished(why.value, len(gen.generated))
        gen.on_done(gen)
