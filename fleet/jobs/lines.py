"""A bulk job's JSONL line as a request, read with orjson (about 10x json's speed: the job worker's
parsing bounds a JSONL job) and checked exactly as the online routes check theirs.

- `parse_infer_line`: an /infer body (fleet/kserve.py's checks; only the words of a syntax error differ).
- `parse_generation_line`, for a generative model: an /infer body when it has "inputs", else a /generate
  body (fleet/generate_body.py) with its prompt under `text_input` or `prompt`.

orjson reads an integer beyond 64 bits as a float, which would pass as a parameter where /infer refuses
the integer by its range: a line with a parameter that large is parsed again exactly as /infer parses it
(rare; in tensor data a float where an integer is due is refused anyway).
"""

from __future__ import annotations

from typing import Any

import orjson

from fleet.errors import InvalidInput
from fleet.generate_body import parse_generate_doc
from fleet.kserve import ParsedInfer, check_json_encoding, parse_infer, parse_infer_doc
from fleet.model_config import ModelSpec

__all__ = ["parse_generation_line", "parse_infer_line"]


def _load(line: bytes) -> dict[str, Any]:
    check_json_encoding(line)
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"failed to parse the request JSON buffer: {exc.msg} at offset {exc.pos}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the request JSON must be an object")
    return doc


def _huge_float_parameter(doc: dict[str, Any]) -> bool:
    """Whether a parameter (the request's, an input's or an output's) is a float beyond int64."""
    groups = [doc.get("parameters")]
    for key in ("inputs", "outputs"):
        entries = doc.get(key)
        if isinstance(entries, list):
            groups += [e.get("parameters") for e in entries if isinstance(e, dict)]
    return any(isinstance(v, float) and abs(v) >= 2**63
               for g in groups if isinstance(g, dict) for v in g.values())


def _infer(line: bytes, doc: dict[str, Any], spec: ModelSpec) -> ParsedInfer:
    if _huge_float_parameter(doc):
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
