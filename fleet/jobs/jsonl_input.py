"""A bulk job's JSONL input: one KServe v2 infer request body per non-blank line, read line by line from
a resume cursor and parsed exactly as POST /infer parses a body (fleet/jobs/lines.py, through the head its
lines share: fleet/jobs/line_heads.py).

A line longer than the job's line limit is skipped in bounded chunks, never held whole, and becomes an
item with `error`, as does a line that does not parse.

The lines are read here, one thread; with `parse_processes` they are parsed by that many forked processes
(fleet/jobs/parse_pool.py), in the same order, when what is left of the file is worth the fork (POOL_MIN_BYTES).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from fleet.errors import InvalidInput
from fleet.jobs.items import JSONL_BUFFER_BYTES, InputItem, RawLine
from fleet.jobs.line_heads import item_parser
from fleet.jobs.parse_pool import ParsePool, auto_processes
from fleet.model_spec import ModelSpec

CHUNK_BYTES = 1 << 20  # count(), the resume line count and skipping a too-long line read this much at a time
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024  # Settings.max_job_line_bytes' default
# Less of the file than this left to read: parsed in process (a helper's fork and chunks are not worth it).
POOL_MIN_BYTES = 512 * 1024


def count_lines(path: Path) -> int:
    """Non-blank lines, counted in CHUNK_BYTES pieces so a huge file never sits in memory."""
    total, pending = 0, False  # pending: the unfinished line so far has non-blank content
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            pieces = chunk.split(b"\n")
            for piece in pieces[:-1]:
                if pending or piece.strip():
                    total += 1
                pending = False
            pending = pending or bool(pieces[-1].strip())
    return total + (1 if pending else 0)


def _newlines_before(f: IO[bytes], offset: int) -> int:
    """Line breaks in the first `offset` bytes: the line number a resumed read continues from."""
    f.seek(0)
    seen, left = 0, offset
    while left > 0 and (chunk := f.read(min(CHUNK_BYTES, left))):
        seen += chunk.count(b"\n")
        left -= len(chunk)
    return seen


class JsonlInput:
    """One KServe v2 infer request body per non-blank line, parsed exactly as POST /infer does. For a
    generative model (`backend: "llm"`) a line without "inputs" is a /generate body instead, its prompt
    under `text_input` (or `prompt`) and its sampling beside it: `{"prompt": "...", "max_tokens": 64}`."""

    kind = "jsonl"

    def __init__(self, path: Path, spec: ModelSpec, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 parse_processes: int | None = 0) -> None:
        self.path = path
        self._items = item_parser(spec, path.name)  # one per input: the heads its lines share checked once
        self._max_line_bytes = max_line_bytes
        self._processes = auto_processes(_cpus()) if parse_processes is None else parse_processes
        self._pools: list[ParsePool] = []

    def count(self) -> int:
        return count_lines(self.path)

    def read(self, start_index: int = 0, start_offset: int = 0, block_rows: int = 1) -> Iterator[InputItem]:
        worth_it = self._processes > 0 and self.path.stat().st_size - start_offset >= POOL_MIN_BYTES
        pool = ParsePool(self._items, self._processes if worth_it else 0)  # with none, it parses here
        self._pools.append(pool)
        try:
            yield from pool.items(self._lines(start_index, start_offset))
        finally:
            self._pools.remove(pool)

    def close(self) -> None:
        """Stops the parser processes of a read() not run to its end. (Each read() owns its file handle.)"""
        for pool in self._pools:
            pool.close()

    def _lines(self, start_index: int, start_offset: int) -> Iterator[InputItem | RawLine]:
        """The lines from a resume cursor, in order, not parsed: a line over the limit is already its
        error item."""
        limit = self._max_line_bytes
        with self.path.open("rb", buffering=JSONL_BUFFER_BYTES) as f:
            line = _newlines_before(f, start_offset)
            if start_offset > 0:
                f.seek(start_offset - 1)
                if f.read(1) != b"\n":
                    raise InvalidInput(f"resume offset {start_offset} is not at a line start of '{self.path.name}'")
            f.seek(start_offset)
            index, offset = start_index, start_offset
            # readline(limit + 1) never buffers more than the limit: a longer line comes back cut short,
            # without its newline, and the rest of it is skipped in bounded chunks.
            while raw := f.readline(limit + 1):
                line += 1
                if len(raw) > limit and raw[-1:] != b"\n":
                    size, ended, blank = _skip_line(f, raw)
                    offset += size
                    if not blank:  # count_lines() skips a blank line however long: so does the index
                        error = f"line {line} is {size - ended} bytes, over the limit of {limit} bytes per line"
                        yield InputItem(index, line, offset, None, error=error)
                        index += 1
                    continue
                offset += len(raw)
                body = raw.strip()
                if body:
                    yield RawLine(index, line, offset, body)
                    index += 1


def _cpus() -> int | None:
    """The cores this process may run on (Linux), else the machine's."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count()


def _skip_line(f: IO[bytes], head: bytes) -> tuple[int, int, bool]:
    """Read past the rest of a too-long line, CHUNK_BYTES at a time: (its bytes with the newline, 1 if a
    newline ended it, whether it is blank)."""
    size, blank = len(head), not head.strip()
    while chunk := f.readline(CHUNK_BYTES):
        size += len(chunk)
        blank = blank and not chunk.strip()
        if chunk[-1:] == b"\n":
            return size, 1, blank
    return size, 0, blank
