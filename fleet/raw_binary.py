"""A raw binary infer request (`Inference-Header-Content-Length: 0`): the body is the one input's bytes, with
no JSON header (protocol.md §2.1, Triton's binary tensor data extension). Only for a model of one input
whose shape the byte count tells: a BYTES input of one element, or any other type with at most one variable
dimension after the batch; the request is batch 1, and every output comes back binary. Built here as the
JSON header it stands for, so that it is then parsed and checked as any request is."""

from __future__ import annotations

from fleet.errors import InvalidInput
from fleet.model_spec import ModelSpec
from fleet.request_json import dump_json


def raw_header(spec: ModelSpec, nbytes: int) -> bytes:
    """The JSON header a raw binary body of `nbytes` for `spec` stands for; InvalidInput where its shape
    cannot be told from its size."""
    what = f"a raw binary request (Inference-Header-Content-Length: 0) for model '{spec.name}'"
    if len(spec.inputs) != 1:
        raise InvalidInput(f"{what}: raw binary requests are for models of one input; it has {len(spec.inputs)}")
    ts = spec.inputs[0]
    shape = spec.metadata_shape(ts)
    if spec.max_batch_size > 0:
        shape[0] = 1
    wild = [i for i, d in enumerate(shape) if d < 0]
    if ts.datatype.name == "BYTES":
        if any(d != 1 for i, d in enumerate(shape) if i not in wild):
            raise InvalidInput(f"{what}: a BYTES input '{ts.name}' must be of one element {shape}")
        shape = [1] * len(shape)
    elif len(wild) > 1:
        raise InvalidInput(f"{what}: the shape {shape} of input '{ts.name}' cannot be told from the byte size")
    elif wild:
        known = ts.datatype.itemsize
        for d in shape:
            known *= d if d > 0 else 1
        if known == 0 or nbytes % known:
            raise InvalidInput(f"{what}: {nbytes} bytes are no whole number of {ts.datatype.name} elements "
                               f"of shape {shape}")
        shape[wild[0]] = nbytes // known
    doc = {"inputs": [{"name": ts.name, "datatype": ts.datatype.name, "shape": shape,
                       "parameters": {"binary_data_size": nbytes}}],
           "parameters": {"binary_data_output": True}}
    return dump_json(doc, checked=True)
