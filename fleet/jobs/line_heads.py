"""A JSONL job's lines parsed from a head checked before (`LineHeads`).

The lines of a job written by one program are /infer bodies that differ only in each input's `data`, and
perhaps the request `id`: they share one head. Parsing a line (fleet/kserve.py's `parse_infer`) checks that
head against the model's config every time. On a 2-core host the job worker parses in process, and its one
thread bounds a JSONL job. Here a line whose head was checked before only has its request id checked and its
inputs' data packed (`pack_json`, as parse_infer does): a 256-float `mlp` line in 38 µs, not 47-49, in a
loop on the test host (what is left: orjson's read 8.6, the data's packing 18); in a job, the job worker's
CPU a line 13 % less (bench/RESULTS.md, stop 67). Every other line, and a line where the id or the data is
refused, is parsed by parse_infer as before. So a line's result or error is always parse_infer's. A job reads
its lines as items (`item_parser`): one of a known head becomes its item directly, with the packing key its
head's items share (fleet/jobs/packing.py's `signature`, worked out once a head), so that neither a request
(ParsedInfer, whose containers are copies) nor each item's key is made a line.

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

import functools
from collections.abc import Hashable
from typing import Any

import orjson

from fleet import tensors
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.jobs.items import InputItem, ItemParser, RawLine
from fleet.jobs.lines import item_rows, parse_generation_line, parse_item
from fleet.jobs.packing import signature
from fleet.known_requests import Known, KnownRequests
from fleet.kserve import ParsedInfer, parse_infer_read, request_id
from fleet.llm_spec import is_llm
from fleet.model_spec import ModelSpec
from fleet.request_json import load_json
from fleet.tensor_json import pack_json

CAPACITY = 64  # heads (a job has one or a few)
_NO_BINARY = memoryview(b"")


def item_parser(spec: ModelSpec, source: str = "") -> ItemParser:
    """A job input's lines as its items (fleet/jobs/lines.py's parse_item): a line is exactly an /infer body (or,
    for a generative model, also a /generate one), read through the head it shares with the input's other
    lines (`LineHeads.item`). One per job input: each head is checked once."""
    if is_llm(spec):
        return functools.partial(parse_item, spec=spec, parse=parse_generation_line, source=source)
    return functools.partial(LineHeads().item, spec=spec, source=source)


class LineHeads:
    """`parse(line, spec)` is parse_infer(line, None, spec): its result or its error; `item(raw, spec)` is
    parse_item(raw, spec, parse). One per job input reader (and so one in each forked parsing helper): not
    thread-safe."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._known = KnownRequests(capacity)
        self._capacity = capacity
        # What a known head's items share (_shared): its entry, their packing key and their rows.
        self._keys: dict[tuple[str, bytes], tuple[Known, Hashable, int]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def parse(self, line: bytes, spec: ModelSpec) -> ParsedInfer:
        read = load_json(line)
        known, head = self._lookup(read, spec)
        return self._parse_read(line, read, known, head, spec)

    def item(self, raw: RawLine, spec: ModelSpec, source: str = "") -> InputItem:
        """parse_item(raw, spec, self.parse, source). A line of a known head becomes its item without a request
        first (ParsedInfer's copies), and carries its head's packing key: a 256-float line's parse 8 % less in a
        loop, the job worker's CPU a line ~12 % less in a job (bench/RESULTS.md, stop 70)."""
        try:
            read = load_json(raw.body)
            known, head = self._lookup(read, spec)
            item = None if known is None or head is None else self._known_item(raw, known, head, read[0], spec)
        except Exception:  # parse_item parses it again, for its error (or its log, for a parser bug)
            return parse_item(raw, spec, self.parse, source)
        if item is not None:
            return item
        return parse_item(raw, spec, lambda line, spec: self._parse_read(line, read, known, head, spec), source)

    def _lookup(self, read: tuple[dict[str, Any], bool], spec: ModelSpec) -> tuple[Known | None, bytes | None]:
        """The entry of the line's head, if known, and that head (None where it cannot be one)."""
        doc, by_orjson = read
        head = _head(doc) if by_orjson else None
        return (None if head is None else self._known.get(spec.name, head, spec)), head

    def _parse_read(self, line: bytes, read: tuple[dict[str, Any], bool], known: Known | None, head: bytes | None,
                    spec: ModelSpec) -> ParsedInfer:
        if known is not None:
            try:
                return _with_data(known, read[0])
            except InvalidInput:
                pass  # parse_infer's error, in its words and order of checks (below)
        request = parse_infer_read(line, read, spec, _NO_BINARY)
        if head is not None and _reusable(request, read[0]):
            self._known.keep(spec.name, head, spec, request)
        return request

    def _known_item(self, raw: RawLine, known: Known, head: bytes, doc: dict[str, Any],
                    spec: ModelSpec) -> InputItem | None:
        """parse_item's item for a line of a known head; None where parse_item is to say why it has none (an
        unexpected error too: raised from here, it would not be the line's alone)."""
        request = known.request
        if request.classification or not request.inputs:
            return None
        try:
            data = _data(known, doc)
            client_id = request_id(doc)
        except InvalidInput:
            return None
        key, rows = self._shared(spec, head, known)
        inputs = [WireTensor(t.name, t.datatype, t.shape, d) for t, d in zip(request.inputs, data, strict=True)]
        return InputItem(raw.index, raw.line, raw.end_offset, inputs,
                         None if request.outputs is None else list(request.outputs), client_id,
                         dict(request.parameters), rows=rows, key=key)

    def _shared(self, spec: ModelSpec, head: bytes, known: Known) -> tuple[Hashable, int]:
        """What every item of `known` has alike, worked out once: its packing key (the inputs' layout, outputs
        and parameters) and its rows (the first input's shape)."""
        kept = self._keys.get((spec.name, head))
        if kept is not None and kept[0] is known:
            return kept[1], kept[2]
        if len(self._keys) >= self._capacity:
            self._keys.clear()  # as bounded as the heads; those still used are made again
        request = known.request
        key = signature(InputItem(0, 0, 0, request.inputs, request.outputs, parameters=request.parameters))
        rows = item_rows(request.inputs, spec)
        self._keys[(spec.name, head)] = (known, key, rows)
        return key, rows


def _data(known: Known, doc: dict[str, Any]) -> list[bytes]:
    """The wire bytes of each input of `doc`, whose head `known` is; InvalidInput where its data is refused."""
    return [pack_json(raw["data"], tensors.lookup(t.datatype), t.shape, t.name)
            for t, raw in zip(known.request.inputs, doc["inputs"], strict=True)]


def _with_data(known: Known, doc: dict[str, Any]) -> ParsedInfer:
    """The request of `doc`, whose head `known` is; InvalidInput where its id or data is refused."""
    return known.with_data(_data(known, doc), request_id(doc))


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
