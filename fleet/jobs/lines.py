"""A bulk job's JSONL line as a request, read with orjson (about 10x json's speed: the job worker's
parsing bounds a JSONL job) and checked exactly as the online routes check theirs.

- `parse_infer_line`: an /infer body (fleet/kserve.py's checks; only the words of a syntax error differ).
- `parse_generation_line`, for a generative model: an /infer body when it has "inputs", else a /generate
  body (fleet/generate_body.py) with its prompt under `text_input` or `prompt`.
- `parse_item`: a read line as the job's item, or the line's error (a parse failure costs one line).

orjson reads an integer beyond 64 bits as a float, which would pass as a parameter where /infer refuses
the integer by its range: a line with a parameter that large is parsed again exactly as /infer parses it
(rare; in tensor data a float where an integer is due is refused anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson

from fleet.errors import InvalidInput, ServingError
from fleet.generate_body import parse_generate_doc
from fleet.jobs.items import InputItem, RawLine
from fleet.kserve import ParsedInfer, parse_infer, parse_infer_doc
from fleet.llm_spec import is_llm
from fleet.model_config import ModelSpec
from fleet.request_json import check_json_encoding, huge_float_parameter

__all__ = ["LineParser", "line_parser", "parse_generation_line", "parse_infer_line", "parse_item"]

log = logging.getLogger(__name__)

LineParser = Callable[[bytes, ModelSpec], ParsedInfer]


def _load(line: bytes) -> dict[str, Any]:
    check_json_encoding(line)
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"failed to parse the request JSON buffer: {exc.msg} at offset {exc.pos}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the request JSON must be an object")
    return doc


def _infer(line: bytes, doc: dict[str, Any], spec: ModelSpec) -> ParsedInfer:
    if huge_float_parameter(doc):
        return parse_infer(line, None, spec)
    return parse_infer_doc(doc, spec, memoryview(b""), None)


def parse_infer_line(line: bytes, spec: ModelSpec) -> ParsedInfer:
    return _infer(line, _load(line), spec)


def parse_generation_line(line: bytes, spec: ModelSpec) -> ParsedInfer:
    doc = _load(line)
    if "inputs" in doc:
        return _infer(line, doc, spec)
    if "prompt" in doc and spec.input("prompt") is None:
        doc["text_input"] = doc.pop("prompt")
    return parse_generate_doc(doc, spec)


def line_parser(spec: ModelSpec) -> LineParser:
    """A line is exactly an /infer body (or, for a generative model, also a /generate one)."""
    return parse_generation_line if is_llm(spec) else parse_infer_line


def parse_item(raw: RawLine, spec: ModelSpec, parse: LineParser, source: str = "") -> InputItem:
    """`raw` parsed as an item of the job, or as an item carrying why it cannot be sent."""
    index, line, end_offset = raw.index, raw.line, raw.end_offset
    try:
        parsed = parse(raw.body, spec)
    except ServingError as exc:
        return InputItem(index, line, end_offset, None, error=exc.message)
    except RecursionError:
        return InputItem(index, line, end_offset, None, error="failed to parse the request JSON: nested too deeply")
    except Exception:  # a parser bug must cost one line, and its message (Python internals) stays in the log
        log.exception("job input %s line %d: unexpected parser failure", source, line)
        return InputItem(index, line, end_offset, None,
                         error="the line could not be read as a KServe v2 infer request body")
    first = parsed.inputs[0].shape
    rows = max(1, first[0]) if spec.max_batch_size > 0 and first else 1
    return InputItem(index, line, end_offset, parsed.inputs, parsed.outputs, parsed.client_id, parsed.parameters,
                     rows=rows)
