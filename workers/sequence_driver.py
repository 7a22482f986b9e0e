"""The sequence batcher's part of a model's driver (workers/loop.py): each version's live sequences
(batching/sequences.py: one request of each at a time, pinned to the sequence's instance, released once
idle too long) and the control and state tensors its requests get (workers/sequence_tensors.py). A model
without a sequence batcher has no gates, and the driver asks nothing more than `active`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from batching.policy import Pending
from batching.sequences import Refuse, SequenceGate, Verdict, no_correlation_id
from fleet.envelope import RequestEnvelope
from fleet.model_spec import ModelSpec
from workers.backends.base import ItemResult
from workers.sequence_tensors import SequenceTensors

log = logging.getLogger(__name__)


class Sequences:
    def __init__(self, spec: ModelSpec, instance_counts: dict[int, int], tensors: SequenceTensors | None) -> None:
        seq = spec.sequence
        self._gates = {} if seq is None else {
            v: SequenceGate(spec.name, count, seq.max_sequence_idle_us) for v, count in instance_counts.items()}
        self._tensors = tensors
        if seq is not None and tensors is None:
            self._tensors = SequenceTensors(seq, spec.max_batch_size > 0)

    @property
    def active(self) -> bool:
        return bool(self._gates)

    def arrive(self, version: int, request_id: str, env: RequestEnvelope, now: int) -> Verdict | None:
        """The verdict on a request just read; None if its version batches no sequences."""
        gate = self._gates.get(version)
        if gate is None:
            return None
        flags = env.sequence
        if flags is None:
            return Refuse(request_id, no_correlation_id(env.model))
        return gate.arrive(request_id, flags.id, flags.start, flags.end, now)

    def finished(self, version: int, request_id: str, state: object | None, now: int) -> list[Verdict]:
        """The request is answered: its sequence keeps the state it left (None: none) and moves on; the
        verdicts on the requests this lets in."""
        gate = self._gates.get(version)
        if gate is None:
            return []
        if state is not None:
            gate.set_state(request_id, state)
        return gate.finished(request_id, now)

    def release_idle(self, now: int) -> int | None:
        """Release the sequences idle past their limit; when the next one will be (µs), or None."""
        wake: int | None = None
        for gate in self._gates.values():
            for gone in gate.release_idle(now):
                log.info("%s: sequence %s released after %d µs idle", gate.model, gone, gate.idle_us)
            idle_at = gate.next_idle_us()
            if idle_at is not None:
                wake = idle_at if wake is None else min(wake, idle_at)
        return wake

    def requests(self, version: int, envs: list[RequestEnvelope], items: Sequence[Pending]
                 ) -> tuple[list[RequestEnvelope], Callable[[ItemResult], object] | None]:
        """A batch's requests with their sequences' control and state tensors, and how to take the state
        each leaves (None: the model keeps none)."""
        seq = self._tensors
        if seq is None:
            return envs, None
        gate = self._gates[version]
        envs = [seq.request(env, gate.state(p.request_id)) for env, p in zip(envs, items, strict=True)]
        return envs, seq.state_of if seq.capture else None
