"""A request's inputs against the model's config, as tritonserver's core checks them and in its words: the
input names (none twice, as many as the model takes), then each input's datatype and shape, then the batch
size. Every protocol's parser calls these (HTTP's JSON: fleet/kserve.py, gRPC: gateway/grpc/codec.py, generate:
fleet/generate_body.py), and so do ensemble steps and BLS calls. The errors Triton's core finds carry its
"[request id: ID] " prefix (`request_tag`); the texts were checked body by body against tritonserver 2.51.
"""

from __future__ import annotations

from typing import Any

from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.model_spec import ModelSpec, TensorSpec
from fleet.tensor_json import INT64_MAX

# What tritonserver 2.51 adds to a shape error when the model batches.
_BATCH_NOTE = (". NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
               "prepended to each input shape. If you want to specify the full shape including the batch dim in "
               "your input dims config, try setting max_batch_size to zero. See the model configuration docs for "
               "more info on max_batch_size.")


def request_tag(request_id: str) -> str:
    """The prefix tritonserver's core puts on the errors it finds in a request's inputs."""
    return f"[request id: {request_id or '<id_unknown>'}] "


def untagged(message: str) -> str:
    """`message` without its request_tag, if it has one."""
    if message.startswith("[request id: "):
        end = message.find("] ")
        if end > 0:
            return message[end + 2:]
    return message


def _dims(dims: list[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"  # as Triton writes a shape: no spaces


def _check_shape(spec: ModelSpec, ts: TensorSpec, shape: list[int], tag: str) -> None:
    dims = list(ts.dims)
    body = shape[1:] if spec.max_batch_size > 0 else shape
    ok = len(body) == len(dims) and all(d == -1 or d == s for d, s in zip(dims, body, strict=True))
    if not ok:
        want = ([-1] if spec.max_batch_size > 0 else []) + dims
        raise InvalidInput(f"{tag}unexpected shape for input '{ts.name}' for model '{spec.name}'. Expected "
                           f"{_dims(want)}, got {_dims(shape)}{_BATCH_NOTE if spec.max_batch_size > 0 else ''}")


def _parse_shape(raw: Any, name: str) -> list[int]:
    # Dims are int64 in Triton's protocol; a larger one could not even cross Redis (msgpack).
    if not isinstance(raw, list) or any(not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= INT64_MAX
                                        for d in raw):
        raise InvalidInput(f"input '{name}': shape must be a list of non-negative integers (at most 2^63-1)")
    return raw


def check_input_names(spec: ModelSpec, names: list[str], tag: str) -> None:
    """A request's input names as tritonserver checks them first, in its words (`tag`: request_tag): no
    name twice, then as many inputs as the model takes, its required ones included."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidInput(f"{tag}input '{name}' already exists in request")
        seen.add(name)
    required = [t.name for t in spec.inputs if not t.optional]
    if len(required) <= len(names) <= len(spec.inputs):
        return
    given = "[" + ",".join(f"'{n}'" for n in sorted(seen)) + "]"
    # Triton's own rendering: its list drops its "[" when nothing is missing.
    missing = ",".join(f"'{n}'" for n in required if n not in seen)
    expected = (f"{len(spec.inputs)} inputs" if len(required) == len(spec.inputs)
                else f"number of inputs between {len(required)} and {len(spec.inputs)}")
    raise InvalidInput(f"{tag}expected {expected} but got {len(names)} inputs for model '{spec.name}'. Got "
                       f"input(s) {given}, but missing required input(s) {'[' + missing if missing else ''}]. "
                       f"Please provide all required input(s).")


def check_input(spec: ModelSpec, given: list[WireTensor], name: str, datatype: Any, raw_shape: Any,
                batch: int | None, tag: str = "") -> tuple[TensorSpec, list[int], int | None]:
    """One input's header against the model, before its data (HTTP's JSON and gRPC's protobuf alike): an
    input of the model not already in `given`, its datatype, its shape (dims, batch dimension, the batch
    size of the inputs before it: `batch`). Returns (its config, its shape, the batch size so far). `tag`:
    request_tag, on the errors tritonserver's core words so."""
    ts = spec.input(name)
    if ts is None:
        raise InvalidInput(f"unexpected inference input '{name}' for model '{spec.name}'")
    if any(t.name == name for t in given):
        raise InvalidInput(f"{tag}input '{name}' already exists in request")
    if datatype != ts.datatype.name:
        raise InvalidInput(
            f"{tag}inference input '{name}' data-type is '{datatype}', but model '{spec.name}' "
            f"expects '{ts.datatype.name}'"
        )
    shape = _parse_shape(raw_shape, name)
    _check_shape(spec, ts, shape, tag)
    if spec.max_batch_size > 0:
        if not shape or shape[0] < 1:
            raise InvalidInput(f"input '{name}': the batch dimension must be at least 1")
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            raise InvalidInput("all inputs must have the same batch size")
    return ts, shape, batch


def check_input_set(spec: ModelSpec, given: list[WireTensor], batch: int | None, tag: str = "") -> None:
    """The request's inputs as a whole: every required one given, the batch within max_batch_size."""
    check_input_names(spec, [t.name for t in given], tag)
    if spec.max_batch_size > 0 and batch is not None and batch > spec.max_batch_size:
        raise InvalidInput(
            f"{tag}inference request batch-size must be <= {spec.max_batch_size} for '{spec.name}'"
        )
