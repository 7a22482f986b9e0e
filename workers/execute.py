"""One batch on one instance, start to finish, off the event loop: decode the envelopes' tensors, run
the backend, encode one reply per request, and measure Triton's compute_input/infer/output times."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from fleet import tensors
from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor
from fleet.errors import InferenceFailed, ServingError
from fleet.model_config import ModelSpec
from workers.backends.base import Backend, InferenceItem, ItemResult


@dataclass(slots=True)
class BatchOutcome:
    replies: list[ReplyEnvelope]
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int


def _decode(env: RequestEnvelope, to_arrays: bool) -> InferenceItem:
    inputs = {t.name: tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape) for t in env.inputs} \
        if to_arrays else {}
    return InferenceItem(inputs=inputs, requested_outputs=env.outputs, parameters=env.parameters,
                         request_id=env.client_id, wire=env.inputs)


def _encode(spec: ModelSpec, env: RequestEnvelope, result: ItemResult) -> ReplyEnvelope:
    if result.error is not None:
        return ReplyEnvelope(id=env.id, model_version=env.version, error_code=result.error.code.value,
                             error_message=result.error.message)
    produced = result.outputs or {}
    wire = result.wire_outputs or {}
    names = list(wire) or list(produced)
    wanted = env.outputs if env.outputs is not None else [n for n in names if spec.output(n) is not None]
    outputs: list[WireTensor] = []
    for name in wanted:
        ts = spec.output(name)
        if ts is not None and name in wire and wire[name].datatype == ts.datatype.name:
            outputs.append(wire[name])  # already the declared type: forward the bytes
            continue
        arr = produced.get(name)
        if arr is None and name in wire:  # another type than declared: decode, cast below
            t = wire[name]
            arr = tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape)
        if ts is None or arr is None:
            return ReplyEnvelope(id=env.id, model_version=env.version, error_code="INTERNAL",
                                 error_message=f"model '{spec.name}' did not produce output '{name}'")
        arr = np.asarray(arr)
        outputs.append(WireTensor(name, ts.datatype.name, tuple(arr.shape), tensors.to_bytes(arr, ts.datatype)))
    return ReplyEnvelope(id=env.id, model_version=env.version, outputs=outputs, parameters=result.parameters)


def run_batch(spec: ModelSpec, backend: Backend, envs: list[RequestEnvelope]) -> BatchOutcome:
    """Never raises: every failure becomes an error reply for the requests it touched."""
    t0 = time.perf_counter_ns()
    to_arrays = not getattr(backend, "takes_wire", False)
    items: list[InferenceItem] = []
    early: dict[int, ReplyEnvelope] = {}
    for i, env in enumerate(envs):
        try:
            items.append(_decode(env, to_arrays))
        except ServingError as exc:
            early[i] = ReplyEnvelope(id=env.id, model_version=env.version, error_code=exc.code.value,
                                     error_message=exc.message)
    runnable = [env for i, env in enumerate(envs) if i not in early]
    t1 = time.perf_counter_ns()
    results: list[ItemResult] = backend.execute(items) if items else []
    if len(results) != len(items):
        err = InferenceFailed(f"backend returned {len(results)} results for {len(items)} requests")
        results = [ItemResult(error=err) for _ in items]
    t2 = time.perf_counter_ns()
    encoded = [_encode(spec, env, res) for env, res in zip(runnable, results, strict=True)]
    encoded.reverse()
    replies = [early[i] if i in early else encoded.pop() for i in range(len(envs))]
    t3 = time.perf_counter_ns()
    return BatchOutcome(replies, t1 - t0, t2 - t1, t3 - t2)
