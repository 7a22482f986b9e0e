"""What a bulk job's writers are to the feed (fleet/jobs/feed.py): `JobOutput`, and `write_each`, the items
of a request written one by one, each with its outputs or its error."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from fleet.envelope import WireTensor
from fleet.errors import InvalidInput
from fleet.jobs.items import InputItem
from fleet.jobs.packing import unpack


class JobOutput(Protocol):
    """Where results go, written in input order; `flush()` returns the resume offset."""

    path: Path

    def write(
        self, item: InputItem, outputs: Sequence[WireTensor] | None, error: str | None, model: str, version: int
    ) -> None: ...

    def write_reply(self, items: Sequence[InputItem], outputs: Sequence[WireTensor], model: str,
                    version: int) -> list[str | None]:
        """Items answered by one reply, whose `outputs` hold their rows in order along the batch axis (checked:
        packing.check_rows), as write_each writes them; returns each item's error (None: written)."""
        ...

    def flush(self) -> int: ...

    def finish(self, partial: bool = False) -> None:
        """Make the output final; `partial`: the job stopped early (failed), keep what was written."""
        ...

    def close(self) -> None: ...


def write_each(sink: JobOutput, items: Sequence[InputItem], outputs: Sequence[Sequence[WireTensor] | None],
               errors: Sequence[str | None], model: str, version: int) -> list[str | None]:
    """Each item with its outputs, or its error where it has one; an item whose outputs the writer refuses
    (a shape, a missing output, what JSON cannot carry) is written with that refusal as its error. Returns
    each item's error (None: its result was written)."""
    written: list[str | None] = []
    for item, item_outputs, error in zip(items, outputs, errors, strict=True):
        if error is None:
            try:
                sink.write(item, item_outputs, None, model, version)
            except InvalidInput as exc:
                error = exc.message
        if error is not None:
            sink.write(item, None, error, model, version)  # its line (or flagged rows) still
        written.append(error)
    return written


def write_unpacked(sink: JobOutput, items: Sequence[InputItem], outputs: Sequence[WireTensor], model: str,
                   version: int) -> list[str | None]:
    """JobOutput.write_reply item by item: the reply split (packing.unpack), each item's part written."""
    return write_each(sink, items, unpack(outputs, [item.rows for item in items]), [None] * len(items), model,
                      version)
