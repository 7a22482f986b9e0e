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
entry goes when the cache is full (fleet/known_requests.py keeps the entries, as it does gRPC's).
"""

from __future__ import annotations

from fleet.known_requests import CAPACITY, KnownRequests
from fleet.kserve import ParsedInfer, parse_infer, parse_infer_read, split_body
from fleet.model_spec import ModelSpec
from fleet.request_json import load_json
from fleet.tensor_regions import Regions


class HeaderCache:
    """`parse` returns what parse_infer would (its result or its error), from a header parsed before when
    it can. One per gateway process (its event loop's: not thread-safe)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._known = KnownRequests(capacity)

    def __len__(self) -> int:
        return len(self._known)

    def parse(self, body: bytes, header_length: str | None, spec: ModelSpec, regions: Regions | None) -> ParsedInfer:
        """parse_infer(body, header_length, spec, regions), from a known header when it can be."""
        if header_length is None:  # JSON alone: its data is in the header
            return parse_infer(body, header_length, spec, regions)
        header, binary = split_body(body, header_length, spec)
        known = self._known.get(spec.name, header, spec)
        if known is not None and len(binary) == sum(known.sizes):
            data: list[bytes | memoryview] = []
            offset = 0
            for size in known.sizes:
                data.append(binary[offset:offset + size])
                offset += size
            return known.with_data(data)
        request = parse_infer_read(header, load_json(header), spec, binary, regions)
        if _reusable(request, binary):
            self._known.keep(spec.name, header, spec, request)
        return request


def _reusable(request: ParsedInfer, binary: memoryview) -> bool:
    # An input's data is a view of the body's tail only when it came from there: JSON data and a region's
    # are bytes of their own (the `obj` check says so outright).
    return (request.client_id == "" and request.sequence is None and not request.shm_outputs
            and all(t.datatype != "BYTES" and isinstance(t.data, memoryview) and t.data.obj is binary.obj
                    for t in request.inputs))
