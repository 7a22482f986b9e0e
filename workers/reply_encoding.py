"""A request's reply from what the backend returned for it (workers/execute.py runs the batch): its outputs in
the config's declared types and shapes (reshaped back to the client's), or the request's own INTERNAL error
when the model returned something else, never the batch's."""

from __future__ import annotations

import numpy as np

from fleet import tensors
from fleet.config_checks import WILDCARD_DIM
from fleet.datatypes import Datatype
from fleet.envelope import ReplyEnvelope, RequestEnvelope, WireTensor, error_reply
from fleet.model_spec import ModelSpec, TensorSpec
from fleet.reshape import client_shape
from workers.backends.base import ItemResult


def _internal(env: RequestEnvelope, message: str) -> ReplyEnvelope:
    return ReplyEnvelope(id=env.id, model_version=env.version, error_code="INTERNAL", error_message=message)


def _kind_matches(produced: np.dtype, declared: Datatype) -> bool:
    """Whether an output of `produced` may be cast to the declared type: within a kind (FP64 -> FP32,
    INT64 -> INT32, as numpy defaults produce) yes; across kinds (FP64 -> INT32, numbers <-> BYTES) no,
    since that would silently change values. Triton does not cast outputs at all."""
    if produced == declared.numpy:
        return True  # the common case, without numpy's casting machinery
    if declared.name == "BYTES" or produced.kind in ("O", "S", "U"):
        return declared.name == "BYTES" and produced.kind in ("O", "S", "U")
    return bool(np.can_cast(produced, declared.numpy, casting="same_kind"))


def _shape_error(spec: ModelSpec, ts: TensorSpec, env: RequestEnvelope, shape: tuple[int, ...]) -> str | None:
    """Why an output's shape contradicts its config dims (and the request's batch size), or None.
    Per output of every request: the passing case builds nothing."""
    if ts.is_shape_tensor:
        return None
    dims = ts.dims
    batched = spec.max_batch_size > 0
    rest = shape[1:] if batched else shape
    if len(rest) == len(dims) and (rest == dims or all(d == WILDCARD_DIM or d == r
                                                       for d, r in zip(dims, rest, strict=True))):
        if not batched or shape[0] == env.batch_rows(True) or spec.has_ragged_inputs:
            return None
    expected = [env.batch_rows(True), *dims] if batched else list(dims)
    return (f"model '{spec.name}' returned output '{ts.name}' with shape {list(shape)}, but its config "
            f"(and the request's batch size) makes it {expected}")


def _client_shape(spec: ModelSpec, ts: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    return client_shape(ts.dims, ts.reshape or (), shape, spec.max_batch_size > 0)


def _reshape_error(spec: ModelSpec, ts: TensorSpec, shape: tuple[int, ...]) -> str:
    expected = ", ".join((["batch"] if spec.max_batch_size > 0 else []) + [str(d) for d in ts.reshape or ()])
    return (f"model '{spec.name}' returned output '{ts.name}' with shape {list(shape)}, but its config "
            f"reshape makes it [{expected}]")


def encode_reply(spec: ModelSpec, env: RequestEnvelope, result: ItemResult) -> ReplyEnvelope:
    """The reply for one request; a model bug (an output of the wrong type or shape, or one that cannot
    be encoded) becomes this request's INTERNAL error, never the batch's."""
    try:
        return _encode_checked(spec, env, result)
    except Exception as exc:  # what the model returned could not be encoded
        return _internal(env, f"model '{spec.name}' returned an output that cannot be encoded: "
                              f"{type(exc).__name__}: {exc}")


def _encode_checked(spec: ModelSpec, env: RequestEnvelope, result: ItemResult) -> ReplyEnvelope:
    if result.error is not None:
        return error_reply(env, result.error)
    if result.empty:
        return ReplyEnvelope(id=env.id, model_version=env.version, outputs=[], empty=True,
                             out_of_band=env.reads_out_of_band)
    produced = result.outputs or {}
    wire = result.wire_outputs or {}
    names = list(wire) or list(produced)
    wanted = env.outputs if env.outputs is not None else [n for n in names if spec.output(n) is not None]
    outputs: list[WireTensor] = []
    for name in wanted:
        ts = spec.output(name)
        if ts is not None and name in wire and wire[name].datatype == ts.datatype.name:
            out = wire[name]
            if ts.reshape is not None:
                shape = _client_shape(spec, ts, out.shape)
                if shape is None:
                    return _internal(env, _reshape_error(spec, ts, out.shape))
                out = WireTensor(out.name, out.datatype, shape, out.data)
            problem = _shape_error(spec, ts, env, out.shape)
            if problem is not None:
                return _internal(env, problem)
            outputs.append(out)  # already the declared type: forward the bytes
            continue
        arr = produced.get(name)
        if arr is None and name in wire:  # another type than declared: decode, cast below
            t = wire[name]
            arr = tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape)
        if ts is None or arr is None:
            return _internal(env, f"model '{spec.name}' did not produce output '{name}'")
        arr = np.asarray(arr)
        if ts.reshape is not None:  # the model produced its `reshape` shape; the client gets `dims`
            shape = _client_shape(spec, ts, arr.shape)
            if shape is None:
                return _internal(env, _reshape_error(spec, ts, arr.shape))
            arr = arr.reshape(shape)
        if not _kind_matches(arr.dtype, ts.datatype):
            got = wire[name].datatype if name in wire else str(arr.dtype)
            return _internal(env, f"model '{spec.name}' returned output '{name}' as {got}, but its config "
                                  f"declares {ts.datatype.name}")
        problem = _shape_error(spec, ts, env, tuple(arr.shape))
        if problem is not None:
            return _internal(env, problem)
        # A copy, not a view (tensors.wire_view): the reply is written later, in the background, while the
        # instance runs on, and a model may hand back memory it changes again (a buffer, a reused output).
        outputs.append(WireTensor(name, ts.datatype.name, tuple(arr.shape), tensors.to_bytes(arr, ts.datatype)))
    return ReplyEnvelope(id=env.id, model_version=env.version, outputs=outputs, parameters=result.parameters,
                         out_of_band=env.reads_out_of_band)
