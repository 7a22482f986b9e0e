"""Binary infer requests' JSON headers already parsed and checked, per model config.

A client sends the same JSON header with every request of the same shapes (perf_analyzer, tritonclient, a
service calling one model): only the binary tail differs. Reading that header with orjson and checking it
against the config (fleet/kserve.py's parse_infer) was the largest piece of the gateway's own work on a
request: 12.2 µs in process for `double`'s header, of the ~100 µs of CPU the gateway spends on a request. What
it gives is a function of the header and the config alone when every input's data is in the binary tail, so it
is kept here, by model and header bytes, and a request with a known header only has its tail cut into the
inputs' slices.

Kept only when nothing else goes into the result: no input from JSON `data` or a shared-memory region, no
output into a region (a region's registration and contents change), no BYTES input (its framing is
checked in the data), no request id and no sequence (both differ from request to request, so an entry
would never be used again). A tail of another length than the header's sizes add up to is parsed anew, for
parse_infer's own error. A reload (another config object) replaces the entry. The least recently used
entry goes when the cache is full.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.envelope import WireTensor
from fleet.kserve import ParsedInfer, parse_infer, parse_infer_read, split_body
from fleet.model_spec import ModelSpec
from fleet.request_json import load_json
from fleet.tensor_regions import Regions

CAPACITY = 256  # entries; a header of a few hundred bytes each
LONGEST_HEADER_BYTES = 4096  # a longer header is parsed each time (no large keys kept)


@dataclass(frozen=True, slots=True)
class _Parsed:
    spec: ModelSpec  # the config it was checked against
    request: ParsedInfer  # its inputs' data empty
    sizes: tuple[int, ...]  # each input's bytes, in the tail's order (they add up to the tail's)


class HeaderCache:
    """`parse` returns what parse_infer would (its result or its error), from a header parsed before when
    it can. One per gateway process (its event loop's: not thread-safe)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._entries: dict[tuple[str, bytes], _Parsed] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def parse(self, body: bytes, header_length: str | None, spec: ModelSpec, regions: Regions | None) -> ParsedInfer:
        """parse_infer(body, header_length, spec, regions), from a known header when it can be."""
        if header_length is None:  # JSON alone: its data is in the header
            return parse_infer(body, header_length, spec, regions)
        header, binary = split_body(body, header_length)
        key = (spec.name, header)
        known = self._entries.get(key)
        if known is not None and known.spec is spec and len(binary) == sum(known.sizes):
            self._entries[key] = self._entries.pop(key)  # the most recently used last
            return _with_tail(known, binary)
        request = parse_infer_read(header, load_json(header), spec, binary, regions)
        if len(header) <= LONGEST_HEADER_BYTES and _reusable(request, binary):
            if known is None and len(self._entries) >= self._capacity:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = _Parsed(
                spec, _with_inputs(request, [WireTensor(t.name, t.datatype, t.shape, b"") for t in request.inputs]),
                tuple(len(t.data) for t in request.inputs))
        return request


def _reusable(request: ParsedInfer, binary: memoryview) -> bool:
    # An input's data is a view of the body's tail only when it came from there: JSON data and a region's
    # are bytes of their own (the `obj` check says so outright).
    return (request.client_id == "" and request.sequence is None and not request.shm_outputs
            and all(t.datatype != "BYTES" and isinstance(t.data, memoryview) and t.data.obj is binary.obj
                    for t in request.inputs))


def _with_tail(known: _Parsed, binary: memoryview) -> ParsedInfer:
    inputs = []
    offset = 0
    for t, size in zip(known.request.inputs, known.sizes, strict=True):
        inputs.append(WireTensor(t.name, t.datatype, t.shape, binary[offset:offset + size]))
        offset += size
    return _with_inputs(known.request, inputs)


def _with_inputs(request: ParsedInfer, inputs: list[WireTensor]) -> ParsedInfer:
    """`request` with these inputs, sharing nothing mutable with it (shm_outputs is empty, sequence None).
    Every field by name (dataclasses.replace would take twice as long as the rest of a hit); the property
    test compares every field with parse_infer's, so one added to ParsedInfer and left out here fails it."""
    return ParsedInfer(client_id=request.client_id, inputs=inputs,
                       outputs=None if request.outputs is None else list(request.outputs),
                       binary_outputs=request.binary_outputs, binary_default=request.binary_default,
                       parameters=dict(request.parameters), priority=request.priority, timeout_us=request.timeout_us,
                       shm_outputs={}, sequence=None, classification=dict(request.classification))
