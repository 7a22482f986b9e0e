"""A bulk job's JSONL output: one compact JSON line per item, the online /infer JSON response (the same
`data` rendering and refusals: fleet/tensor_json.py) with the item's `line`, or `{"line", "error"}`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from fleet import tensors
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.jobs.items import JSONL_BUFFER_BYTES, InputItem, printable
from fleet.jobs.sink import write_unpacked
from fleet.tensor_json import json_array, json_rows


class JsonlOutput:
    """One compact JSON line per item: the /infer response with `line`, or `{"line", "error"}`."""

    def __init__(self, path: Path, resume_offset: int) -> None:
        # The online /infer response's values and refusals (fleet/tensor_json.py), written by orjson: ~20x
        # json's speed (the job worker's rendering bounds a JSONL job), floats in their shortest exact form.
        self.path = path
        if resume_offset > 0:
            size = path.stat().st_size if path.exists() else -1
            if size < resume_offset:
                raise InvalidInput(f"cannot resume '{path.name}' at byte {resume_offset}: the file has {size} bytes")
            os.truncate(path, resume_offset)  # drop what was written after the last flush
            self._file: IO[bytes] = path.open("ab", buffering=JSONL_BUFFER_BYTES)
        else:
            self._file = path.open("wb", buffering=JSONL_BUFFER_BYTES)
        self._offset = resume_offset

    def write(
        self, item: InputItem, outputs: Sequence[WireTensor] | None, error: str | None, model: str, version: int
    ) -> None:
        if error is not None:
            self._put({"line": item.line, "error": printable(error)})
            return
        try:
            data = [(t.name, t.datatype, list(t.shape), json_array(t, tensors.lookup(t.datatype)))
                    for t in outputs or ()]
        except InvalidInput as exc:  # NaN, infinity, non-UTF-8 BYTES: the /infer advice (binary) is
            # not open to a JSONL job, so its line says only what JSON cannot carry.
            raise InvalidInput(f"{exc.message.split('; ')[0]} (a JSONL job's output is JSON only)") from None
        self._put(_response(item, model, version, data))

    def write_reply(self, items: Sequence[InputItem], outputs: Sequence[WireTensor], model: str,
                    version: int) -> list[str | None]:
        """Each item's line from its rows of the reply: each output read, and checked for what JSON cannot
        carry, once for the whole reply, and each item's `data` a slice of it; not split into a tensor an
        item first (6 of 17 µs a 256-float line less than that: bench/RESULTS.md, stop 70). A reply of one item
        (whose outputs may have no batch axis), of BYTES, or with NaN or infinity somewhere is written item
        by item (write_unpacked), so that only the items whose own rows JSON cannot carry fail."""
        columns = None if len(items) == 1 else _json_columns(outputs)
        if columns is None:
            return write_unpacked(self, items, outputs, model, version)
        written: list[str | None] = []
        start = 0
        for item in items:
            n = item.rows
            data = [(t.name, t.datatype, [n, *t.shape[1:]], arr[start:start + n].reshape(-1)) for t, arr in columns]
            start += n
            try:
                self._put(_response(item, model, version, data))
                written.append(None)
            except InvalidInput as exc:
                self.write(item, None, exc.message, model, version)
                written.append(exc.message)
        return written

    def _put(self, doc: dict[str, Any]) -> None:
        try:
            line = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError as exc:
            raise InvalidInput(f"the response cannot be written as JSON: {exc}") from None
        self._file.write(line)
        self._offset += len(line)

    def flush(self) -> int:
        self._file.flush()
        return self._offset

    def finish(self, partial: bool = False) -> None:
        self.close()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()


def _json_columns(outputs: Sequence[WireTensor]) -> list[tuple[WireTensor, np.ndarray]] | None:
    """Each output with its values as rows (json_rows), or None where one is BYTES or holds what JSON cannot
    carry."""
    if any(t.datatype == "BYTES" for t in outputs):
        return None
    try:
        return [(t, json_rows(t, tensors.lookup(t.datatype))) for t in outputs]
    except InvalidInput:
        return None


def _response(item: InputItem, model: str, version: int,
              data: Sequence[tuple[str, str, list[int], np.ndarray | list[str]]]) -> dict[str, Any]:
    """An item's line: the /infer response (each output's name, datatype, shape and data) and the item's `line`."""
    doc: dict[str, Any] = {"line": item.line}
    if item.client_id:
        doc["id"] = item.client_id
    doc["model_name"] = model
    doc["model_version"] = str(version)
    doc["outputs"] = [{"name": name, "datatype": datatype, "shape": shape, "data": values}
                      for name, datatype, shape, values in data]
    return doc
