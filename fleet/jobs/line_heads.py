"""A JSONL job's lines parsed from a head checked before (`LineHeads`).

The lines of a job written by one program are /infer bodies that differ only in each input's `data`, and
perhaps the request `id`: they share one head. Parsing a line (fleet/kserve.py's `parse_infer`) checks that
head against the model's config every time. On a 2-core host the job worker parses in process, and its one
thread bounds a JSONL job. Here a line whose head was checked before only has its request id checked and its
inputs' data packed (`pack_json`, as parse_infer does): a 256-float `mlp` line in 38 µs, not 47-49, in a
loop on the test host (what is left: orjson's read 8.6, the data's packing 18); in a job, the job worker's
CPU a line 13 % less (bench/RESULTS.md, stop 67). Every other line, and a line where the id or the data is
refused, is parsed by parse_infer as before. So a line's result or error is always parse_infer's.

A line's head is its document, as orjson read it, with each input's `data` and the request's `id` written
as null (their keys kept where they are), serialized again by orjson: two lines with one head are one
document but for those values. The heads are kept in fleet/known_requests.py's store, as the gateway keeps
its request heads (by config object, so a reloaded model's lines are checked anew; the least recently used
past CAPACITY; none longer than its LONGEST_KEY_BYTES). A head is kept only:
- for a request parse_infer accepted whose inputs all came from JSON `data`;
- with no sequence (its correlation id and flags are checked per request);
- when orjson read the line (not json, which reads what orjson would turn into a float).
"""

from __future__ import annotations

from typing import Any

import orjson

from fleet import tensors
from fleet.errors import InvalidInput
from fleet.known_requests import Known, KnownRequests
from fleet.kserve import ParsedInfer, parse_infer_read, request_id
from fleet.model_spec import ModelSpec
from fleet.request_json import load_json
from fleet.tensor_json import pack_json

CAPACITY = 64  # heads (a job has one or a few)
_NO_BINARY = memoryview(b"")


class LineHeads:
    """`parse(line, spec)` is parse_infer(line, None, spec): its result or its error. One per job input reader
    (and so one in each forked parsing helper): not thread-safe."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._known = KnownRequests(capacity)

    def __len__(self) -> int:
        return len(self._known)

    def parse(self, line: bytes, spec: ModelSpec) -> ParsedInfer:
        read = load_json(line)
        doc, by_orjson = read
        head = _head(doc) if by_orjson else None
        if head is not None:
            known = self._known.get(spec.name, head, spec)
            if known is not None:
                try:
                    return _with_data(known, doc)
                except InvalidInput:
                    pass  # parse_infer's error, in its words and order of checks (below)
        request = parse_infer_read(line, read, spec, _NO_BINARY)
        if head is not None and _reusable(request, doc):
            self._known.keep(spec.name, head, spec, request)
        return request


def _with_data(known: Known, doc: dict[str, Any]) -> ParsedInfer:
    """The request of `doc`, whose head `known` is; InvalidInput where its id or data is refused."""
    data = [pack_json(raw["data"], tensors.lookup(t.datatype), t.shape, t.name)
            for t, raw in zip(known.request.inputs, doc["inputs"], strict=True)]
    return known.with_data(data, request_id(doc))


def _head(doc: dict[str, Any]) -> bytes | None:
    """`doc` with its inputs' data and its id null, as bytes; None where it cannot be written again (text
    orjson refuses, integers past 64 bits)."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(raw, dict) for raw in inputs):
        return None
    shell = {k: None if k == "id" else v for k, v in doc.items()}
    shell["inputs"] = [{k: None if k == "data" else v for k, v in raw.items()} for raw in inputs]
    try:
        return orjson.dumps(shell)
    except orjson.JSONEncodeError:
        return None


def _reusable(request: ParsedInfer, doc: dict[str, Any]) -> bool:
    # Every input from its `data`: a job has no binary tail, but an input of no elements may still say
    # `binary_data_size: 0` (a region, input or output, is refused without regions).
    return request.sequence is None and all("data" in raw for raw in doc["inputs"])
