"""Continuous (iteration-level) batching for generative models: which sequences run in the next forward
pass, and what each contributes to it. Pure: no clock, no I/O, no tensors; the worker's engine runs the
plan and reports what came of it (issue 14; the engine is not built yet).

Per iteration (`step`):
- expire waiting requests past their deadline; drop cancelled ones (running ones free their KV at once);
- every running sequence whose context is fully in the KV cache decodes one token;
- sequences still prefilling take up to `prefill_chunk` context tokens in all (chunked prefill), oldest
  first, so a long prompt does not stall everyone's next token;
- waiting requests are admitted in strict (lane, arrival) order while a slot is free and the KV cache has
  room for the head's whole context: within a lane nobody is overtaken, so nobody starves;
- a waiting request of a more urgent lane than some running sequences, that finds no free slot or KV room,
  preempts the least urgent of them (as few as make it fit), so online requests are never stuck behind bulk
  generations;
- when decoding needs a KV block that is not free, the youngest running sequence of the lowest priority is
  preempted (recompute: its blocks are freed, it waits again at its old place, and its context, prompt plus
  what it generated, is prefilled anew when readmitted). The oldest sequence can always finish alone.

KV memory is counted in blocks of `block_tokens` (a paged cache); a sequence holds ceil(cached / block)
blocks. Memory is bounded by `kv_blocks`, never by the number of queued requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Chunk", "ContinuousConfig", "ContinuousScheduler", "Finish", "Iteration", "TooLong"]


class TooLong(ValueError):
    """A request whose prompt plus max_new_tokens cannot fit the KV budget even alone."""


class Finish(StrEnum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # the engine saw EOS or a stop string
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its deadline passed while it waited


@dataclass(frozen=True, slots=True)
class ContinuousConfig:
    kv_blocks: int
    block_tokens: int = 16
    max_running: int = 8
    prefill_chunk: int = 256  # context tokens prefilled per iteration, over all sequences

    def __post_init__(self) -> None:
        if min(self.kv_blocks, self.block_tokens, self.max_running, self.prefill_chunk) < 1:
            raise ValueError(f"every continuous batching limit must be >= 1: {self}")


@dataclass(frozen=True, slots=True)
class Chunk:
    """Prefill context tokens [start, end) of a sequence; `last` when this completes its context (the pass
    then yields its next token)."""

    request_id: str
    start: int
    end: int
    last: bool


@dataclass(frozen=True, slots=True)
class Iteration:
    prefill: tuple[Chunk, ...]
    decode: tuple[str, ...]
    admitted: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    finished: tuple[tuple[str, Finish], ...] = ()  # expired and cancelled; answered without a forward pass

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass(slots=True)
class _Seq:
    request_id: str
    lane: int
    order: int
    prompt: int
    max_new: int
    deadline_us: int | None
    generated: int = 0
    cached: int = 0  # context tokens whose KV is in the cache
    blocks: int = 0
    running: bool = False
    preemptions: int = 0
    in_pass: bool = False  # part of the iteration handed out and not reported yet

    @property
    def context(self) -> int:
        """The prompt and what it generated so far."""
        return self.prompt + self.generated

    @property
    def decoding(self) -> bool:
        """Everything but its last generated token is cached: the next pass feeds that token (one decode).
        Otherwise it is prefilling: its whole context (prompt, or prompt and generated tokens after a
        preemption) goes in, and the pass that completes it yields the next token."""
        return self.generated > 0 and self.cached == self.context - 1


@dataclass(slots=True)
class _Counts:
    preempted: int = 0
    finished: dict[Finish, int] = field(default_factory=dict)


class ContinuousScheduler:
    def __init__(self, config: ContinuousConfig) -> None:
        self.config = config
        self._seqs: dict[str, _Seq] = {}
        self._waiting: list[_Seq] = []  # sorted by (lane, order)
        self._running: list[_Seq] = []  # in admission order
        self._free = config.kv_blocks
        self._cancelled: set[str] = set()
        self._planned: Iteration | None = None
        self.counts = _Counts()

    # ------------------------------------------------------------------ what the driver reads

    @property
    def free_blocks(self) -> int:
        return self._free

    def running(self) -> list[str]:
        return [s.request_id for s in self._running]

    def waiting(self) -> list[str]:
        return [s.request_id for s in self._waiting]

    def busy(self) -> bool:
        return bool(self._seqs)

    # ------------------------------------------------------------------ events

    def add(self, request_id: str, prompt_tokens: int, max_new_tokens: int, *, lane: int = 0, order: int = 0,
            deadline_us: int | None = None) -> None:
        """A request to generate for; raises TooLong if it could never fit the KV budget."""
        if prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError("a generation needs at least one prompt token and one new token")
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already scheduled")
        # The last generated token's KV is never needed: prompt + max_new - 1 tokens at most are cached.
        need = self._blocks_for(prompt_tokens + max_new_tokens - 1)
        if need > self.config.kv_blocks:
            raise TooLong(f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_new_tokens}) needs {need} KV blocks "
                          f"of {self.config.block_tokens} tokens; the model's budget is {self.config.kv_blocks}")
        seq = _Seq(request_id, lane, order, prompt_tokens, max_new_tokens, deadline_us)
        self._seqs[request_id] = seq
        self._enqueue(seq)

    def cancel(self, request_ids: set[str]) -> None:
        """Their callers went away: each ends at the next step (one in the pass ends once it is reported)."""
        self._cancelled |= request_ids & self._seqs.keys()

    def step(self, now_us: int) -> Iteration:
        """The next forward pass. Call `report` with what it produced before the next step."""
        assert self._planned is None, "step() again before report()"
        finished = self._end_cancelled() + self._expire(now_us)
        preempted = self._make_way()
        decode = [s for s in self._running if s.decoding]
        preempted += self._make_room(decode)
        decode = [s for s in decode if s.running]
        for s in decode:
            self._grow(s, s.cached + 1)
        admitted = self._admit()
        prefill = self._prefill()
        for s in decode:
            s.in_pass = True
        it = Iteration(tuple(prefill), tuple(s.request_id for s in decode), tuple(admitted), tuple(preempted),
                       tuple(finished))
        self._planned = it
        return it

    def report(self, stopped: set[str] | None = None) -> list[tuple[str, Finish]]:
        """The pass ran: each decoding sequence and each completed prefill produced one token; `stopped`:
        those whose token was EOS or completed a stop string. Returns the sequences that finished."""
        it = self._planned
        assert it is not None, "report() without a step()"
        self._planned = None
        stopped = stopped or set()
        produced = list(it.decode) + [c.request_id for c in it.prefill if c.last]
        out: list[tuple[str, Finish]] = []
        for rid in it.decode:
            seq = self._seqs[rid]
            seq.cached += 1
            seq.in_pass = False
        for chunk in it.prefill:
            seq = self._seqs[chunk.request_id]
            seq.cached = chunk.end
            seq.in_pass = False
        for rid in produced:
            seq = self._seqs[rid]
            seq.generated += 1
            if rid in stopped:
                out.append((rid, Finish.STOP))
            elif seq.generated >= seq.max_new:
                out.append((rid, Finish.LENGTH))
        for rid, why in out:
            self._finish(self._seqs[rid], why)
        return out

    # ------------------------------------------------------------------ the parts of a step

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_tokens)

    def _enqueue(self, seq: _Seq) -> None:
        key = (seq.lane, seq.order)
        i = len(self._waiting)
        while i > 0 and (self._waiting[i - 1].lane, self._waiting[i - 1].order) > key:
            i -= 1
        self._waiting.insert(i, seq)

    def _grow(self, seq: _Seq, tokens: int) -> None:
        need = self._blocks_for(tokens) - seq.blocks
        if need > 0:
            assert need <= self._free, "planned past the KV budget"
            self._free -= need
            seq.blocks += need

    def _release(self, seq: _Seq) -> None:
        self._free += seq.blocks
        seq.blocks = 0
        seq.cached = 0

    def _finish(self, seq: _Seq, why: Finish) -> None:
        if seq.running:
            self._running.remove(seq)
            seq.running = False
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._release(seq)
        del self._seqs[seq.request_id]
        self._cancelled.discard(seq.request_id)
        self.counts.finished[why] = self.counts.finished.get(why, 0) + 1

    def _end_cancelled(self) -> list[tuple[str, Finish]]:
        gone = [rid for rid in self._cancelled if not self._seqs[rid].in_pass]
        for rid in sorted(gone):
            self._finish(self._seqs[rid], Finish.CANCELLED)
        return [(rid, Finish.CANCELLED) for rid in sorted(gone)]

    def _expire(self, now_us: int) -> list[tuple[str, Finish]]:
        late = [s for s in self._waiting if s.deadline_us is not None and s.deadline_us <= now_us]
        for s in late:
            self._finish(s, Finish.EXPIRED)
        return [(s.request_id, Finish.EXPIRED) for s in late]

    def _make_room(self, decode: list[_Seq]) -> list[str]:
        """Preempt until every decoding sequence has room for one more token."""
        preempted: list[str] = []
        while True:
            need = sum(max(0, self._blocks_for(s.cached + 1) - s.blocks) for s in decode if s.running)
            if need <= self._free:
                return preempted
            victim = max(self._running, key=lambda s: (s.lane, s.order))
            self._preempt(victim)
            preempted.append(victim.request_id)

    def _preempt(self, victim: _Seq) -> None:
        victim.running = False
        self._running.remove(victim)
        self._release(victim)
        victim.preemptions += 1
        self.counts.preempted += 1
        self._enqueue(victim)

    def _make_way(self) -> list[str]:
        """Priority: a waiting request of a more urgent lane than some running ones, that finds no free
        slot or not enough free KV, preempts the least urgent (then youngest) of those, as few as make it
        fit; none if even all of them would not. So online requests join the running batch at once however
        many bulk generations run."""
        if not self._waiting:
            return []
        head = self._waiting[0]
        need = self._blocks_for(head.context)

        def growth(s: _Seq) -> int:  # the block its decode takes this step
            return max(0, self._blocks_for(s.cached + 1) - s.blocks) if s.decoding else 0

        slots, free = len(self._running), self._free - sum(growth(s) for s in self._running)
        if slots < self.config.max_running and need <= free:
            return []
        victims = sorted((s for s in self._running if s.lane > head.lane), key=lambda s: (s.lane, s.order),
                         reverse=True)
        for n, victim in enumerate(victims, 1):
            slots, free = slots - 1, free + victim.blocks + growth(victim)
            if slots < self.config.max_running and need <= free:
                for v in victims[:n]:
                    self._preempt(v)
                return [v.request_id for v in victims[:n]]
        return []

    def _admit(self) -> list[str]:
        admitted: list[str] = []
        while self._waiting and len(self._running) < self.config.max_running:
            head = self._waiting[0]
            if self._blocks_for(head.context) > self._free:
                break  # strict order: nobody behind the head goes first
            self._waiting.pop(0)
            self._grow(head, head.context)  # its whole prefill is reserved now: chunks never wait for room
            head.running = True
            self._running.append(head)
            admitted.append(head.request_id)
        return admitted

    def _prefill(self) -> list[Chunk]:
        budget = self.config.prefill_chunk
        chunks: list[Chunk] = []
        for s in self._running:
            if budget == 0:
                break
            if s.decoding:
                continue
            end = min(s.context, s.cached + budget)
            chunks.append(Chunk(s.request_id, s.cached, end, end == s.context))
            s.in_pass = True
            budget -= end - s.cached
        return chunks
