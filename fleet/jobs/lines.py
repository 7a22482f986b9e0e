"""A bulk job's JSONL line as a request, read exactly as the online routes read and check theirs (with
orjson, keeping json's behaviour: fleet/request_json.py; the job worker's parsing bounds a JSONL job).

- `parse_infer_line`: an /infer body (fleet/kserve.py's `parse_infer`); a job's parser (fleet/jobs/line_heads.py's
  `item_parser`) reads its lines so, from the head they share.
- `parse_generation_line`, for a generative model: an /infer body when it has "inputs", else a /generate
  body (fleet/generate_body.py) with its prompt under `text_input` or `prompt`.
- `parse_item`: a read line as the job's item, or the line's error (a parse failure costs one line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fleet.envelope import WireTensor
from fleet.errors import ServingError
from fleet.generate_body import parse_generate_doc
from fleet.input_checks import untagged
from fleet.jobs.items import InputItem, RawLine, printable
from fleet.kserve import ParsedInfer, parse_infer, parse_infer_read
from fleet.model_spec import ModelSpec
from fleet.request_json import load_json

__all__ = ["LineParser", "item_rows", "parse_generation_line", "parse_infer_line", "parse_item"]

log = logging.getLogger(__name__)

LineParser = Callable[[bytes, ModelSpec], ParsedInfer]


def parse_infer_line(line: bytes, spec: ModelSpec) -> ParsedInfer:
    return parse_infer(line, None, spec)


def parse_generation_line(line: bytes, spec: ModelSpec) -> ParsedInfer:
    read = load_json(line)
    doc = read[0]
    if "inputs" in doc:
        return parse_infer_read(line, read, spec, memoryview(b""))
    if "prompt" in doc and spec.input("prompt") is None:
        doc["text_input"] = doc.pop("prompt")
    return parse_generate_doc(doc, spec)


def parse_item(raw: RawLine, spec: ModelSpec, parse: LineParser, source: str = "") -> InputItem:
    """`raw` parsed as an item of the job, or as an item carrying why it cannot be sent."""
    index, line, end_offset = raw.index, raw.line, raw.end_offset
    try:
        parsed = parse(raw.body, spec)
    except ServingError as exc:
        # Without the online route's "[request id: ...]" prefix: a job counts its lines' errors by message,
        # and each line's own id would make every one of them different.
        return InputItem(index, line, end_offset, None, error=printable(untagged(exc.message)))
    except RecursionError:
        return InputItem(index, line, end_offset, None, error="failed to parse the request JSON: nested too deeply")
    except Exception:  # a parser bug must cost one line, and its message (Python internals) stays in the log
        log.exception("job input %s line %d: unexpected parser failure", source, line)
        return InputItem(index, line, end_offset, None,
                         error="the line could not be read as a KServe v2 infer request body")
    if parsed.classification:  # a job writes each output's tensor: none would be answered as classes
        return InputItem(index, line, end_offset, None,
                         error="the classification extension is not supported in bulk jobs")
    if not parsed.inputs:  # a generate line of a model whose inputs are all optional: nothing to batch by
        return InputItem(index, line, end_offset, None, error="the line gives none of the model's inputs")
    return InputItem(index, line, end_offset, parsed.inputs, parsed.outputs, parsed.client_id, parsed.parameters,
                     rows=item_rows(parsed.inputs, spec))


def item_rows(inputs: list[WireTensor], spec: ModelSpec) -> int:
    """An item's rows along the batch axis: its first input's first dim (at least 1) for a batching model."""
    first = inputs[0].shape
    return max(1, first[0]) if spec.max_batch_size > 0 and first else 1
