"""ModelInferRequests already decoded and checked, per model config: gRPC's twin of gateway/header_cache.py.

perf_analyzer, tritonclient and a service calling one model send every request of the same shapes with the
same fields but its raw_input_contents. Decoding those fields and checking them against the config is
codec.py's decode_infer, a function of them and the config alone when every input's data is a raw entry. So
the request without its raw contents, serialized (deterministically, so that a map's order is fixed), is the
key, and a request with a known key only has its raw contents matched to its inputs (fleet/known_requests.py
keeps the entries). In process, parse and decoding of perf_analyzer's `mlp` request (one 1 KiB input) took
12.8 µs, 5.0 from a known head; with a 602 KB input 47 and 39 (bench/RESULTS.md, stop 62).

Kept only when nothing else goes into the result: every input's data is a raw_input_contents entry (none
from typed contents or a shared-memory region), no output into a region, no BYTES input (its framing is
checked in the data), no request id and no sequence (both differ from request to request, so an entry would
never be used again). Raw contents of other counts or sizes than the entry's are decoded anew, for
decode_infer's own error. A reload (another config object) replaces the entry.
"""

from __future__ import annotations

from typing import Any

from fleet.known_requests import CAPACITY, KnownRequests
from fleet.kserve import ParsedInfer
from fleet.model_spec import ModelSpec
from fleet.tensor_regions import Regions
from gateway.grpc.codec import decode_infer


class RequestHeads:
    """`decode` returns what decode_infer would (its result or its error), from a request decoded before
    when it can. One per gateway process (its event loop's: not thread-safe)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._known = KnownRequests(capacity)

    def __len__(self) -> int:
        return len(self._known)

    def decode(self, request: Any, spec: ModelSpec, regions: Regions | None) -> ParsedInfer:
        """decode_infer(request, spec, regions), from a known request head when it can be. A request with raw
        contents and no id leaves without them: they are in what this returns, and nothing reads them after."""
        contents = request.raw_input_contents
        if request.id or not contents:  # an id is never seen twice; no raw contents, nothing to match
            return decode_infer(request, spec, regions)
        # Taken out, not copied into a message without them (which copies every other field too) nor put back
        # after (which copies them again): the key is what is left, serialized.
        data: list[bytes] = list(contents)
        request.ClearField("raw_input_contents")
        head: bytes = request.SerializeToString(deterministic=True)
        known = self._known.get(spec.name, head, spec)
        if known is not None and len(data) == len(known.sizes) and all(
                len(d) == size for d, size in zip(data, known.sizes, strict=True)):
            return known.with_data(data)
        parsed = decode_infer(request, spec, regions, data)
        # Decoded without error with one raw entry an input: each input took one (an input from a region or
        # typed contents takes none, and decode_infer refuses raw contents left over or beside typed ones).
        if (len(data) == len(parsed.inputs) and parsed.sequence is None and not parsed.shm_outputs
                and all(t.datatype != "BYTES" for t in parsed.inputs)):
            self._known.keep(spec.name, head, spec, parsed)
        return parsed
