"""The wire envelope between gateway, workers and bulk jobs: one msgpack map per request or reply.

Tensors travel as (name, datatype, shape, raw bytes) with Triton's binary layout (fleet.tensors), so
binary HTTP bodies pass through as slices and are never turned into Python lists. This is the only
module that encodes or decodes envelopes; nothing crossing Redis is ever pickled.

An envelope whose tensors hold OUT_OF_BAND_BYTES or more carries their bytes out of band: a marker byte
msgpack never uses (0xC1), the head's length (4 bytes, little-endian), the msgpack head with each tensor's
size where its bytes would be, then the tensors' bytes one after another. It is written as `Parts`
(fleet/parts.py: the head and the tensors' own buffers, never joined by the gateway or the worker), and
decoded into views of the payload: msgpack's `bin` is a copy each way, four copies of every tensor
between a request's body and the model and back (redis-py's callers, and the response cache, join them).
Smaller envelopes are one msgpack map, as before.

Both forms are always decoded. Across a rolling upgrade: a request says whether its sender reads
out-of-band replies ("ob"; a sender from before the form does not say so, and is answered in band), so
workers upgraded first answer old gateways and jobs as before; a worker from before the form cannot read
a large out-of-band request, so workers go first (docs/deployment.md).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from fleet.errors import InvalidInput, ServingError
from fleet.parts import LONG_BUFFER, Parts, byte_view, joined

log = logging.getLogger(__name__)

# The tensors' bytes from which an envelope carries them out of band.
OUT_OF_BAND_BYTES = LONG_BUFFER
_OUT_OF_BAND = b"\xc1"  # "never used" in msgpack: a msgpack envelope starts with a map
_PREFIX = struct.Struct("<cI")  # the marker, the head's length


@dataclass(slots=True)
class WireTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview  # raw little-endian row-major bytes (BYTES: length-prefixed elements)


@dataclass(frozen=True, slots=True)
class SequenceFlags:
    """Triton's request parameters `sequence_id` (uint64 or string; never 0 or empty here),
    `sequence_start` and `sequence_end`."""

    id: int | str
    start: bool = False
    end: bool = False


@dataclass(slots=True)
class RequestEnvelope:
    id: str  # unique per accepted request (gateway id + counter); replies are matched on it
    model: str
    version: int
    inputs: list[WireTensor]
    reply_to: str  # the stream key the reply goes to
    enqueued_at_us: int  # epoch µs, set by the gateway just before XADD
    outputs: list[str] | None = None  # requested output names; None = all
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    deadline_us: int | None = None  # absolute epoch µs; None = no queue timeout
    client_id: str = ""  # the request "id" the client sent, echoed in the response
    # When the caller stops waiting (the gateway's request timeout), absolute epoch µs: a request still
    # queued then is dropped with a timeout instead of computed for nobody. None = the caller waits.
    expires_us: int | None = None
    # Traced requests only (the trace extension): timestamps by name (fleet/trace_points.py), ns on Redis's
    # clock, that the worker adds to and sends back in the reply. None, and absent on the wire, otherwise.
    trace: dict[str, int] | None = None
    # A request a Python model made (BLS, workers/bls.py): "model:version" of each model on the call path
    # that is waiting for it, the outermost first. Empty, and absent on the wire, for a caller's request.
    bls_chain: list[str] = field(default_factory=list)
    # A sequence model's request (sequence batching): its correlation id and START/END flags. None, and
    # absent on the wire, otherwise.
    sequence: SequenceFlags | None = None
    # Whether its sender reads out-of-band replies: every sender since that form ("ob" on the wire); a
    # request from an older one decodes False and is answered in band.
    reads_out_of_band: bool = True

    def batch_rows(self, batched: bool) -> int:
        """Rows along the batch axis: the first dim of the first input for batching models, else 1."""
        if not batched or not self.inputs or not self.inputs[0].shape:
            return 1
        return max(1, self.inputs[0].shape[0])

    @property
    def input_bytes(self) -> int:
        """The bytes of its input tensors."""
        return sum(len(t.data) for t in self.inputs)


@dataclass(slots=True)
class ReplyEnvelope:
    id: str
    model_version: int = 0
    outputs: list[WireTensor] | None = None
    error_code: str = ""
    error_message: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    queue_us: int = 0
    compute_us: int = 0
    trace: dict[str, int] | None = None  # the request's trace timestamps plus the worker's; traced only
    # A decoupled model's responses (workers/backends/python_backend.py): every one but the last has
    # final False; the last may be `empty` (the model sent the final flag without a response).
    final: bool = True
    empty: bool = False
    # Not on the wire: whether large outputs may go out of band (False: its reader predates that form,
    # its request's `reads_out_of_band`).
    out_of_band: bool = field(default=True, compare=False)

    @property
    def ok(self) -> bool:
        return not self.error_code


def error_reply(env: RequestEnvelope, err: ServingError) -> ReplyEnvelope:
    """The reply that answers `env` with `err` (its code and the words its caller sees)."""
    return ReplyEnvelope(id=env.id, model_version=env.version, error_code=err.code.value, error_message=err.message)


def _pack_tensors(tensors: list[WireTensor]) -> list[list[Any]]:
    return [[t.name, t.datatype, list(t.shape), t.data] for t in tensors]


def _payload(m: dict[str, Any], key: str, tensors: list[WireTensor], out_of_band: bool = True) -> bytes | Parts:
    """`m` with `tensors` under `key`, packed: in band (one msgpack map) or, from OUT_OF_BAND_BYTES, out of
    band (the head, then the tensors' own buffers)."""
    size = 0
    for t in tensors:  # inlined: per envelope on the request path
        size += len(t.data) if type(t.data) is bytes else memoryview(t.data).nbytes
    if size < OUT_OF_BAND_BYTES or not out_of_band:
        m[key] = _pack_tensors(tensors)
        packed: bytes = msgpack.packb(m, use_bin_type=True)
        return packed
    data = [byte_view(t.data) for t in tensors]
    m[key] = [[t.name, t.datatype, list(t.shape), len(d)] for t, d in zip(tensors, data, strict=True)]
    head: bytes = msgpack.packb(m, use_bin_type=True)
    return Parts((_PREFIX.pack(_OUT_OF_BAND, len(head)) + head, *data))


def _unpack_tensors(raw: Any, data: memoryview | None, start: int) -> list[WireTensor]:
    """The tensors of a head: their bytes in it, or (`data`: the whole payload) after it from `start`."""
    if data is None:
        return [WireTensor(n, d, tuple(s), b) for n, d, s, b in raw]
    tensors = []
    for n, d, s, size in raw:
        if type(size) is not int or size < 0:
            raise ValueError("an out-of-band tensor's size must be a non-negative integer")
        tensors.append(WireTensor(n, d, tuple(s), data[start:start + size]))
        start += size
    if start != len(data):
        raise ValueError(f"the tensors' sizes add up to {start} bytes, the envelope has {len(data)}")
    return tensors


def encode_request(env: RequestEnvelope) -> bytes:
    """The request as one bytes value (for clients that take nothing else: redis-py, msgpack frames)."""
    return joined(request_payload(env))


def request_payload(env: RequestEnvelope) -> bytes | Parts:
    """The request as a Redis link writes it: large tensors' buffers are not copied."""
    m: dict[str, Any] = {
        "id": env.id,
        "m": env.model,
        "v": env.version,
        "o": env.outputs,
        "p": env.parameters,
        "pr": env.priority,
        "dl": env.deadline_us,
        "r": env.reply_to,
        "t": env.enqueued_at_us,
        "c": env.client_id,
        "ex": env.expires_us,
    }
    if env.trace is not None:
        m["tr"] = env.trace
    if env.bls_chain:
        m["bc"] = env.bls_chain
    if env.sequence is not None:
        m["sq"] = [env.sequence.id, env.sequence.start, env.sequence.end]
    if env.reads_out_of_band:
        m["ob"] = 1
    return _payload(m, "i", env.inputs)


def _chain(raw: Any) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(link, str) for link in raw):
        raise ValueError("the BLS chain of an envelope must be a list of strings")
    return raw


def _sequence(raw: Any) -> SequenceFlags:
    if not (isinstance(raw, list) and len(raw) == 3 and type(raw[0]) in (int, str) and raw[0] not in (0, "")
            and all(isinstance(flag, bool) for flag in raw[1:])):
        raise ValueError("the sequence of an envelope must be [id, start, end]")
    return SequenceFlags(raw[0], raw[1], raw[2])


def _trace(raw: Any) -> dict[str, int]:
    if not isinstance(raw, dict) or not all(isinstance(k, str) and type(v) is int for k, v in raw.items()):
        raise ValueError("the trace of an envelope must map timestamp names to integers")
    return raw


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the envelope")


def _unpack(payload: bytes | memoryview) -> Any:
    """Plain data only: string map keys, no extension types turned into objects (nothing that crosses
    Redis is ever more than maps, lists, strings, bytes and numbers)."""
    return msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_no_ext)


def _unpack_envelope(payload: bytes) -> tuple[Any, memoryview | None, int]:
    """(head, the payload as a view if its tensors are out of band else None, where they start)."""
    if payload[:1] != _OUT_OF_BAND:
        return _unpack(payload), None, 0
    if len(payload) < _PREFIX.size:
        raise ValueError("an out-of-band envelope shorter than its prefix")
    _, size = _PREFIX.unpack_from(payload)
    start = _PREFIX.size + size
    if start > len(payload):
        raise ValueError(f"an out-of-band envelope's head of {size} bytes is longer than the envelope")
    view = memoryview(payload)
    return _unpack(view[_PREFIX.size:start]), view, start


def decode_request(payload: bytes) -> RequestEnvelope:
    """Decode a request; raises InvalidInput on anything that is not a well-formed envelope."""
    try:
        m, data, start = _unpack_envelope(payload)
        return RequestEnvelope(
            id=m["id"],
            model=m["m"],
            version=int(m["v"]),
            inputs=_unpack_tensors(m["i"], data, start),
            outputs=m.get("o"),
            parameters=m.get("p") or {},
            priority=int(m.get("pr") or 0),
            deadline_us=m.get("dl"),
            reply_to=m["r"],
            enqueued_at_us=int(m["t"]),
            client_id=m.get("c") or "",
            expires_us=m.get("ex"),
            trace=_trace(m["tr"]) if "tr" in m else None,
            bls_chain=_chain(m["bc"]) if "bc" in m else [],
            sequence=_sequence(m["sq"]) if "sq" in m else None,
            reads_out_of_band=m.get("ob") == 1,
        )
    except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise InvalidInput(f"malformed request envelope: {exc}") from exc


def encode_reply(rep: ReplyEnvelope) -> bytes:
    """The reply as one bytes value (for clients that take nothing else: redis-py, the response cache)."""
    return joined(reply_payload(rep))


def reply_payload(rep: ReplyEnvelope) -> bytes | Parts:
    """The reply as a Redis link writes it: large tensors' buffers are not copied."""
    m: dict[str, Any] = {"id": rep.id, "v": rep.model_version, "q": rep.queue_us, "x": rep.compute_us}
    if rep.error_code:
        m["e"] = [rep.error_code, rep.error_message]
    if rep.parameters:
        m["p"] = rep.parameters
    if rep.trace is not None:
        m["tr"] = rep.trace
    if not rep.final:
        m["f"] = 0
    if rep.empty:
        m["n"] = 1
    if rep.error_code:
        packed: bytes = msgpack.packb(m, use_bin_type=True)
        return packed
    return _payload(m, "o", rep.outputs or [], rep.out_of_band)


def decode_reply(payload: bytes) -> ReplyEnvelope:
    m, data, start = _unpack_envelope(payload)
    rep = ReplyEnvelope(
        id=m["id"],
        model_version=m.get("v", 0),
        queue_us=m.get("q", 0),
        compute_us=m.get("x", 0),
        parameters=m.get("p") or {},
        trace=_trace(m["tr"]) if "tr" in m else None,
        final=bool(m.get("f", 1)),
        empty=bool(m.get("n", 0)),
    )
    if "e" in m:
        rep.error_code, rep.error_message = m["e"]
    else:
        rep.outputs = _unpack_tensors(m.get("o") or [], data, start)
    return rep


def readable_reply(payload: bytes, what: str) -> ReplyEnvelope | None:
    """The reply, or None (logged, naming `what`) for an entry no decoder here reads, corrupt or from a
    newer fleet: a reader drops it and carries on (its request times out, or is sent again)."""
    try:
        return decode_reply(payload)
    except Exception:
        log.exception("dropping %s that cannot be decoded", what)
        return None
