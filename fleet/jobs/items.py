"""What a bulk job's readers yield: an item (a request, or why it cannot be sent) and a JSONL line not
parsed yet. Plain data, shared by the readers, the line parsers, packing and the writers."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from fleet.envelope import WireTensor

# The buffer of a JSONL job's input and output files. A line of 256 floats is ~3.3 KB: with Python's 8 KiB
# default the job worker's one thread made a read and a write syscall every two or three lines, and
# that thread bounds a JSONL job (bench/RESULTS.md: 0.55-0.57x direct before, 0.60-0.62x with 1 MiB).
JSONL_BUFFER_BYTES = 1 << 20


@dataclass(slots=True)
class InputItem:
    """One inference request of a job, or the reason it cannot be sent (`error`)."""

    index: int  # 0-based item counter (blank lines not counted)
    line: int  # JSONL: 1-based line number in the file; arrays: 0-based row number
    end_offset: int  # resume cursor just past this item: JSONL byte offset after its line; arrays: row + 1
    inputs: list[WireTensor] | None  # validated tensors, None when error is set
    outputs: list[str] | None = None  # requested output names, None = all
    client_id: str = ""  # the request "id" field (JSONL)
    parameters: dict[str, Any] = field(default_factory=dict)  # ParsedInfer.parameters (passthrough)
    error: str | None = None  # why this item cannot be sent; recorded as failed
    rows: int = 1  # rows along the batch axis (1 for a non-batching model)
    count: int = 1  # input items it stands for: a block of array rows is `rows` items (read(block_rows=))
    # Which items may share a request (fleet/jobs/packing.py's `signature`), where the reader knew it already (a
    # JSONL line of a known head: fleet/jobs/line_heads.py); None: computed when packed. Not part of the item.
    key: Hashable | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class RawLine:
    """A non-blank JSONL line within the limit, read but not parsed: where it is and its bytes."""

    index: int
    line: int
    end_offset: int
    body: bytes


# A JSONL input's parser: a line read (not parsed yet) as its item (fleet/jobs/line_heads.py's item_parser).
ItemParser = Callable[[RawLine], InputItem]


def printable(message: str) -> str:
    """`message` as text any writer takes: a lone surrogate the line's JSON spelled (`"x\\ud800"`, which the
    error may quote) as its escape, which orjson, msgpack and Redis refuse as it is."""
    try:
        message.encode()
    except UnicodeEncodeError:
        return message.encode("utf-8", "backslashreplace").decode()
    return message
