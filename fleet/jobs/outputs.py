"""Bulk-job output files: JSONL responses, or arrays (.npy / .npz) with a failure mask.

Writers receive items in input order, exactly once each, and `flush()` returns the resume offset the
runner stores with its cursor: reopening with that offset drops whatever was written after it, so a
resumed job produces the same file as an uninterrupted one. JSONL lines are the online /infer JSON
response (same `data` rendering) plus the item's `line` (fleet/jobs/jsonl_output.py); array writers write
rows in place into preallocated .npy files (mapped for the failure mask, resume and the .npz), so memory
stays flat whatever the job size.

A job that ends `failed` keeps its output (`finish(partial=True)`): JSONL holds the lines written before
it stopped, arrays hold every row with the rows never written flagged in `failed`. A cancelled job's
output is removed (`remove_output`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from fleet import tensors
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.jobs.items import InputItem
from fleet.jobs.jsonl_output import JsonlOutput
from fleet.jobs.sink import JobOutput, write_unpacked
from fleet.model_spec import ModelSpec, TensorSpec

OUTPUT_KINDS = ("jsonl", "npy", "npz")
FAILED = "failed"  # the mask's name in an .npz, and its file in the parts directory


def remove_output(path: Path) -> None:
    """Delete a job's output, whatever its format and however far it got (a cancelled job's), and its
    directory if that leaves it empty."""
    for extra in (path, Path(f"{path}.failed.npy"), Path(f"{path}.tmp")):
        extra.unlink(missing_ok=True)
    shutil.rmtree(Path(f"{path}.parts"), ignore_errors=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # not empty (or already gone): someone else's files stay


def open_output(path: Path, kind: str, spec: ModelSpec, total: int, resume_offset: int = 0) -> JobOutput:
    """A writer of `kind` for `total` items, positioned at `resume_offset` (0 = start afresh)."""
    if resume_offset < 0:
        raise InvalidInput(f"negative resume offset {resume_offset}")
    try:
        if kind == "jsonl":
            return JsonlOutput(path, resume_offset)
        if kind == "npy":
            return NpyOutput(path, spec, total, resume_offset)
        if kind == "npz":
            return NpzOutput(path, spec, total, resume_offset)
    except OSError as exc:
        raise InvalidInput(f"cannot open job output '{path}': {exc}") from exc
    raise InvalidInput(f"unknown job output kind '{kind}', expected one of {list(OUTPUT_KINDS)}")


def _array_output(spec: ModelSpec, ts: TensorSpec) -> tuple[int, ...]:
    """The per-row shape of an output stored in an array; it must be fixed and numeric."""
    if ts.datatype.name == "BYTES":
        raise InvalidInput(f"output '{ts.name}' of model '{spec.name}' is BYTES; write the job as JSONL")
    if any(d < 0 for d in ts.dims):
        raise InvalidInput(
            f"output '{ts.name}' of model '{spec.name}' has variable dims {list(ts.dims)}; write the job as JSONL"
        )
    if "/" in ts.name or ts.name in ("", ".", "..", FAILED):
        raise InvalidInput(f"output name '{ts.name}' cannot be stored as an array file")
    return ts.dims


def _memmap(path: Path, dtype: np.dtype, shape: tuple[int, ...], resume: bool) -> np.memmap:
    """A fresh zero-filled .npy memmap, or the existing one (checked) when resuming."""
    if not resume:
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    try:
        mm = np.lib.format.open_memmap(path, mode="r+")
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot resume '{path.name}': {exc}") from exc
    if mm.shape != shape or mm.dtype != dtype:
        raise InvalidInput(
            f"cannot resume '{path.name}': it holds {mm.dtype}{list(mm.shape)}, expected {dtype}{list(shape)}"
        )
    if not mm.flags.c_contiguous:  # rows are written at C-order offsets
        raise InvalidInput(f"cannot resume '{path.name}': it is stored in Fortran order")
    return mm


class _ArrayOutput:
    """Preallocated [total, *dims] memmaps, one per stored output, plus a bool failure mask.

    Row `item.index` is written (for array inputs it equals the row, `item.line`); a failed row is
    zeroed and flagged, so rewriting after a resume leaves no stale data.
    """

    def __init__(self, path: Path, spec: ModelSpec, total: int, resume_offset: int, outputs: Sequence[TensorSpec],
                 files: Sequence[Path], failed_file: Path) -> None:
        if resume_offset > total:
            raise InvalidInput(f"cannot resume '{path.name}' at row {resume_offset} of {total}")
        self.path = path
        self._total = total
        self._batched = spec.max_batch_size > 0
        resume = resume_offset > 0
        self._specs = list(outputs)
        self._arrays: dict[str, np.memmap] = {
            ts.name: _memmap(f, ts.datatype.numpy, (total, *_array_output(spec, ts)), resume)
            for ts, f in zip(self._specs, files, strict=True)
        }
        self._failed: np.memmap | None = _memmap(failed_file, np.dtype(np.bool_), (total,), resume)
        # Results are written through each file, not through its map: a map's first write to a page faults
        # the page in zeroed and then copies (~130 µs a 64-row batch of 256 floats here); a write copies once
        # (~24 µs). Both go to the one page cache (Linux's, macOS's unified buffer cache), so the maps
        # (failures, resume, the .npz) read what was written. An output holds two descriptors so (the map's
        # own and this one).
        with contextlib.ExitStack() as opened:
            self._files: dict[str, IO[bytes]] = {
                ts.name: opened.enter_context(open(f, "r+b", buffering=0))
                for ts, f in zip(self._specs, files, strict=True)
            }
            opened.pop_all()  # all open: closed in close()
        self._rows = resume_offset

    def _mask(self) -> np.memmap:
        if self._failed is None:
            raise ValueError(f"'{self.path.name}' is closed")
        return self._failed

    def write(
        self, item: InputItem, outputs: Sequence[WireTensor] | None, error: str | None, model: str, version: int
    ) -> None:
        """Store the item's rows (one, or a block of `item.count`); raises InvalidInput (after flagging the
        rows) if the outputs do not fit."""
        rows = slice(item.index, item.index + item.count)
        if item.index < 0 or item.index + item.count > self._total:
            raise InvalidInput(f"item {item.index} is outside the {self._total} rows of '{self.path.name}'")
        failed = self._mask()
        # Once, however often its rows are written (a refused reply's rows again as failed: write_each).
        self._rows = max(self._rows, item.index + item.count)
        if error is not None:
            self._fail(rows)
            return
        given = {t.name: t for t in outputs or ()}
        try:
            values = [self._rows_value(ts, given.get(ts.name), item.count) for ts in self._specs]
        except InvalidInput:
            self._fail(rows)
            raise
        for ts, value in zip(self._specs, values, strict=True):
            array = self._arrays[ts.name]
            data = np.ascontiguousarray(value, dtype=array.dtype).reshape(-1).view(np.uint8).data
            _write_at(self._files[ts.name], data, array.offset + item.index * array.strides[0])
        failed[rows] = False

    def write_reply(self, items: Sequence[InputItem], outputs: Sequence[WireTensor], model: str,
                    version: int) -> list[str | None]:
        return write_unpacked(self, items, outputs, model, version)

    def _rows_value(self, ts: TensorSpec, t: WireTensor | None, count: int) -> np.ndarray:
        if t is None:
            raise InvalidInput(f"the reply has no output '{ts.name}'")
        want = (count, *ts.dims) if self._batched else ts.dims
        if tuple(t.shape) != want:
            raise InvalidInput(f"output '{ts.name}' has shape {list(t.shape)}, {count} row(s) need {list(want)}")
        return tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape).reshape((count, *ts.dims))

    def _fail(self, rows: slice) -> None:
        for array in self._arrays.values():
            array[rows] = 0
        self._mask()[rows] = True

    def flush(self) -> int:
        """Rows written so far. Nothing to do: what was written (results through the files, the mask through
        its map) is already in the OS page cache, which outlives this process (a killed runner loses
        nothing); syncing (`_sync`) would write it to disk on every progress save and stall the feed behind
        the disk."""
        self._mask()
        return self._rows

    def _sync(self) -> None:
        for array in self._arrays.values():
            array.flush()
        for file in self._files.values():
            os.fsync(file.fileno())  # POSIX's msync need not cover pages a write() dirtied (Linux's does)
        self._mask().flush()

    def finish(self, partial: bool = False) -> None:
        if partial:
            self._mask()[self._rows:] = True  # never written: flagged, so no row reads as a result
        self.close()

    def close(self, sync: bool = True) -> None:
        """Write the files and maps to disk (unless they are about to be removed: `sync` False) and drop
        them; the files stay, ready for a resume."""
        try:
            if sync and self._failed is not None:
                self._sync()
        finally:
            for file in self._files.values():
                file.close()
            self._files = {}
            self._arrays = {}
            self._failed = None


def _write_at(file: IO[bytes], data: memoryview, offset: int) -> None:
    """All of `data` into `file` at `offset` (a write may take less than it is given)."""
    fd = file.fileno()
    while data:
        written = os.pwrite(fd, data, offset)
        if not written:
            raise OSError(f"nothing written to '{file.name}' at offset {offset}")
        data, offset = data[written:], offset + written


class NpyOutput(_ArrayOutput):
    """A single-output model's results as one [total, *dims] .npy, plus `<path>.failed.npy`."""

    def __init__(self, path: Path, spec: ModelSpec, total: int, resume_offset: int) -> None:
        if len(spec.outputs) != 1:
            names = [t.name for t in spec.outputs]
            raise InvalidInput(f"a .npy output holds one output, model '{spec.name}' has {names}; use .npz")
        super().__init__(path, spec, total, resume_offset, spec.outputs, [path], Path(f"{path}.failed.npy"))


class NpzOutput(_ArrayOutput):
    """Every output as a memmap under `<path>.parts/`; finish() assembles the .npz (with `failed`)."""

    def __init__(self, path: Path, spec: ModelSpec, total: int, resume_offset: int) -> None:
        self.parts = Path(f"{path}.parts")
        for ts in spec.outputs:
            _array_output(spec, ts)  # reject before creating anything
        if resume_offset == 0:
            self.parts.mkdir(exist_ok=True)
        elif not self.parts.is_dir():
            raise InvalidInput(f"cannot resume '{path.name}': '{self.parts.name}' is missing")
        files = [self.parts / f"{ts.name}.npy" for ts in spec.outputs]
        super().__init__(path, spec, total, resume_offset, spec.outputs, files, self.parts / f"{FAILED}.npy")

    def finish(self, partial: bool = False) -> None:
        """Write `<path>` atomically from the parts, then remove the parts directory."""
        try:
            if partial:
                self._mask()[self._rows:] = True
            # The maps read the page cache the results were written to: nothing needs to reach the disk first.
            arrays: dict[str, Any] = {**self._arrays, FAILED: self._mask()}
            tmp = Path(f"{self.path}.tmp")
            with tmp.open("wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, self.path)
        except BaseException:
            self.close()  # the parts stay, on disk, if the .npz could not be written
            raise
        self.close(sync=False)  # the parts are removed next: writing them to disk first would be for nothing
        shutil.rmtree(self.parts)
