"""The body of Triton's generate extension (protocol.md §1.11) as a request: what /generate, the OpenAI
routes (gateway/) and a generative model's bulk-job lines (fleet/jobs/) all read.

Exact mapping, as Triton's: each top-level key of the JSON body (and each key of its `parameters`)
named like a model input becomes that input, its datatype from the config and its shape from the
config's dims with the wildcard dimensions filled from the element count (a batching model's batch
dimension is 1); every other key is a request parameter.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from fleet import tensors
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.input_checks import check_input, check_input_set, request_tag
from fleet.kserve import ParsedInfer, check_parameters, sequence_flags
from fleet.model_spec import ModelSpec, TensorSpec


def parse_generate(body: bytes, spec: ModelSpec) -> ParsedInfer:
    try:
        doc = json.loads(body.decode("utf-8")) if body.strip() else {}
    except (ValueError, RecursionError):
        raise InvalidInput("failed to parse the request JSON buffer: it is not UTF-8 JSON") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the generate request must be a JSON object")
    return parse_generate_doc(doc, spec)


def parse_generate_doc(doc: dict[str, Any], spec: ModelSpec) -> ParsedInfer:
    """parse_generate once the JSON is read (the OpenAI routes build it; a job's line is read by orjson).
    Takes `doc` apart: the caller's dict is not kept."""
    client_id = doc.pop("id", "")
    if not isinstance(client_id, str):
        raise InvalidInput("'id' must be a string")
    nested = doc.pop("parameters", {})
    if not isinstance(nested, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    inputs: list[WireTensor] = []
    params: dict[str, Any] = {}
    batch: int | None = None
    for key, value in [*doc.items(), *nested.items()]:
        ts = spec.input(key)
        if ts is None:
            params[key] = value
            continue
        tensor = _tensor(spec, ts, value)
        _, _, batch = check_input(spec, inputs, key, tensor.datatype, list(tensor.shape), batch,
                                  request_tag(client_id))
        inputs.append(tensor)
    check_input_set(spec, inputs, batch, request_tag(client_id))
    passthrough, priority, timeout_us, _ = check_parameters(params, spec)
    return ParsedInfer(client_id, inputs, None, frozenset(), False, passthrough, priority, timeout_us,
                       sequence=sequence_flags(params, spec, inputs))


def _tensor(spec: ModelSpec, ts: TensorSpec, value: Any) -> WireTensor:
    dt = ts.datatype
    try:
        if dt.name == "BYTES":
            flat = np.array(value, dtype=object).reshape(-1)
            if not all(isinstance(v, str) for v in flat):
                raise InvalidInput(f"input '{ts.name}' is BYTES: give text")
            array = np.array([v.encode() for v in flat] or [], dtype=object)
        else:
            array = np.array(value, dtype=dt.numpy).reshape(-1)
    except (ValueError, TypeError, OverflowError):
        raise InvalidInput(f"input '{ts.name}' cannot be read as {dt.name}: {value!r:.80}") from None
    shape = _shape(spec.metadata_shape(ts), array.size)
    if shape is None:
        raise InvalidInput(f"input '{ts.name}': {array.size} elements do not fit its shape "
                           f"{spec.metadata_shape(ts)}")
    return WireTensor(ts.name, dt.name, tuple(shape), tensors.to_bytes(array.reshape(shape), dt))


def _shape(dims: list[int], count: int) -> list[int] | None:
    """The metadata dims with each -1 filled: a leading batch dimension gets 1, the first other wildcard
    what the element count leaves, any further ones 1."""
    shape = list(dims)
    batched = bool(shape) and shape[0] == -1 and len(shape) > 1
    if batched:
        shape[0] = 1
    known = int(np.prod([d for d in shape if d != -1])) if shape else 1
    wild = [i for i, d in enumerate(shape) if d == -1]
    for n, i in enumerate(wild):
        shape[i] = (count // known if known and count % known == 0 else -1) if n == 0 else 1
    if any(d < 0 for d in shape) or int(np.prod(shape)) != count:
        return None
    return shape
