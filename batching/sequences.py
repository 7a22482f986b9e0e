"""Sequence batching's bookkeeping on one worker (protocol.md §3.8): which instance each live sequence is
bound to, its one request in flight, the requests waiting behind it, and when it went idle.

A sequence's requests reach this worker in order through its own stream (gateway/sequences.py). The gate
lets one request per sequence at a time through to the scheduler, pinned to the sequence's instance, so
its requests run one after another on one instance and a batch never holds two of one sequence. Pure:
no clock (times are µs given by the driver), no I/O; `state` is the driver's, carried opaquely.

Triton's rules, kept here:
- the first request of a sequence must have the START flag ("... must specify the START flag on the
  first request of the sequence"); a START for a live sequence restarts it (in order: after what is ahead);
- after the request with END, the sequence is gone: what follows needs START again;
- a sequence with nothing queued or running for `idle_us` is released (its state is dropped).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = ["Admit", "Refuse", "SequenceGate", "SequenceId", "Verdict", "Wait", "no_correlation_id", "no_start"]

SequenceId: TypeAlias = int | str


def no_correlation_id(model: str) -> str:
    """Triton's text for a sequence model's request without a sequence id (gateway and worker say it)."""
    return f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID"


def no_start(model: str, sequence: SequenceId) -> str:
    """Triton's text for a request of a sequence that is not live, without START."""
    return (f"inference request for sequence {sequence} to model '{model}' must specify the START flag on the "
            f"first request of the sequence")


@dataclass(frozen=True, slots=True)
class Admit:
    """Schedule the request now, on `instance`."""

    request_id: str
    instance: int


@dataclass(frozen=True, slots=True)
class Wait:
    """It waits behind its sequence's request in flight; `finished` lets it through."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer it with this error (InvalidInput): it does not belong to a live sequence."""

    request_id: str
    message: str


Verdict: TypeAlias = Admit | Wait | Refuse


@dataclass(slots=True)
class _Sequence:
    id: SequenceId
    instance: int
    last_us: int
    in_flight: str | None = None
    ending: bool = False  # the request in flight has END
    waiting: deque[tuple[str, bool, bool]] = field(default_factory=deque)  # (request id, start, end)
    state: object = None  # the driver's (implicit state tensors); None = the initial state


class SequenceGate:
    def __init__(self, model: str, instances: int, idle_us: int) -> None:
        if instances < 1:
            raise ValueError(f"a sequence gate needs at least one instance, got {instances}")
        self.model = model
        self.instances = instances
        self.idle_us = idle_us
        self._live: dict[SequenceId, _Sequence] = {}
        self._by_request: dict[str, _Sequence] = {}  # the request in flight -> its sequence
        # (when idle enough, tiebreak, id) of sequences that went idle; an entry is stale once its sequence
        # ran again or is gone (checked when it comes up), so the driver's every step is O(log n), not O(n).
        self._idle: list[tuple[int, int, SequenceId]] = []
        self._counts = [0] * instances  # live sequences per instance: a new one goes where fewest are
        self._pushed = 0

    # ------------------------------------------------------------------ what the driver reads

    def active(self) -> int:
        return len(self._live)

    def per_instance(self) -> list[int]:
        """Live sequences bound to each instance."""
        return list(self._counts)

    def state(self, request_id: str) -> object:
        """The state the sequence of this request (in flight) carries: None = the initial state."""
        return self._by_request[request_id].state

    def set_state(self, request_id: str, state: object) -> None:
        """What the request in flight left for the next one (called before `finished`)."""
        seq = self._by_request.get(request_id)
        if seq is not None:
            seq.state = state

    def next_idle_us(self) -> int | None:
        """When the earliest idle sequence is released, if any is idle."""
        while self._idle and not self._still_idle(self._idle[0]):
            heapq.heappop(self._idle)
        return self._idle[0][0] if self._idle else None

    def _still_idle(self, entry: tuple[int, int, SequenceId]) -> bool:
        seq = self._live.get(entry[2])
        return seq is not None and seq.in_flight is None and not seq.waiting and seq.last_us + self.idle_us == entry[0]

    # ------------------------------------------------------------------ events

    def arrive(self, request_id: str, sequence: SequenceId, start: bool, end: bool, now_us: int) -> Verdict:
        seq = self._live.get(sequence)
        if seq is None:
            if not start:
                return Refuse(request_id, no_start(self.model, sequence))
            seq = _Sequence(sequence, self._counts.index(min(self._counts)), now_us)
            self._live[sequence] = seq
            self._counts[seq.instance] += 1
        seq.last_us = now_us
        if seq.in_flight is not None or seq.waiting:
            seq.waiting.append((request_id, start, end))
            return Wait(request_id)
        return self._let_through(seq, request_id, start, end)

    def finished(self, request_id: str, now_us: int) -> list[Verdict]:
        """The request in flight is answered (computed, failed, expired or dropped): the verdicts of the
        requests of its sequence that were waiting for it (at most one Admit, after any Refuse)."""
        seq = self._by_request.pop(request_id, None)
        if seq is None:
            return []
        seq.in_flight = None
        seq.last_us = now_us
        out: list[Verdict] = []
        while seq.waiting:
            rid, start, end = seq.waiting.popleft()
            if seq.ending and not start:
                out.append(Refuse(rid, no_start(self.model, seq.id)))
                continue
            out.append(self._let_through(seq, rid, start, end))
            return out
        if seq.ending:
            self._drop(seq.id)
        else:
            self._pushed += 1
            heapq.heappush(self._idle, (now_us + self.idle_us, self._pushed, seq.id))
        return out

    def release_idle(self, now_us: int) -> list[SequenceId]:
        """Sequences idle for `idle_us` or longer, released (Triton's max_sequence_idle_microseconds)."""
        gone: list[SequenceId] = []
        while self._idle and self._idle[0][0] <= now_us:
            entry = heapq.heappop(self._idle)
            if self._still_idle(entry):
                self._drop(entry[2])
                gone.append(entry[2])
        return gone

    def _drop(self, sequence: SequenceId) -> None:
        self._counts[self._live.pop(sequence).instance] -= 1

    def _let_through(self, seq: _Sequence, request_id: str, start: bool, end: bool) -> Admit:
        if start:
            seq.state = None  # a (re)start begins from the initial state
        seq.ending = end
        seq.in_flight = request_id
        self._by_request[request_id] = seq
        return Admit(request_id, seq.instance)
