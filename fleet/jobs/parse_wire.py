"""The wire between a job worker and its line parsers (fleet/jobs/parse_pool.py): length-prefixed frames on a
pipe, with optional deadlines for the job worker's side (its ends are non-blocking), and a job item as msgpack
fields (never pickle)."""

from __future__ import annotations

import os
import select
import struct
import time
from typing import Any

from fleet.envelope import WireTensor
from fleet.jobs.items import InputItem

_LEN = struct.Struct("<Q")


def _wait(fd: int, event: int, deadline: float) -> None:
    """Until `fd` is ready for `event` (select.POLLIN / POLLOUT); TimeoutError once `deadline` (monotonic) passed."""
    poller = select.poll()
    poller.register(fd, event)
    while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        if time.monotonic() >= deadline:
            raise TimeoutError("could not write in time" if event == select.POLLOUT else "nothing came in time")


def _write_all(fd: int, data: bytes | memoryview, timeout_s: float | None = None) -> None:
    """All of `data` to `fd`. With `timeout_s` (the fd non-blocking: the parent's ends), TimeoutError when it
    is not all written by then: a pipe that stays full does not hold the job worker."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            if deadline is None:
                raise
            _wait(fd, select.POLLOUT, deadline)


def _read_exact(fd: int, size: int, timeout_s: float | None = None) -> bytes | None:
    """`size` bytes from `fd`, or None at the end of the pipe (before any of them, or inside them). With
    `timeout_s`, TimeoutError when they have not all come by then."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    parts: list[bytes] = []
    left = size
    while left:
        if deadline is not None:
            _wait(fd, select.POLLIN, deadline)
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def write_frame(fd: int, payload: bytes, timeout_s: float | None = None) -> None:
    _write_all(fd, _LEN.pack(len(payload)), timeout_s)
    _write_all(fd, payload, timeout_s)


def read_frame(fd: int, timeout_s: float | None = None) -> bytes | None:
    """A frame's payload; None at the end of the pipe. `timeout_s` bounds the wait for the frame's start, then
    for its rest."""
    head = _read_exact(fd, _LEN.size, timeout_s)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    return _read_exact(fd, size, timeout_s)


def encode_item(item: InputItem) -> list[Any]:
    inputs = None if item.inputs is None else [[t.name, t.datatype, list(t.shape), t.data] for t in item.inputs]
    return [item.index, item.line, item.end_offset, item.error, inputs, item.outputs, item.client_id,
            item.parameters, item.rows, item.count]


def decode_item(fields: list[Any]) -> InputItem:
    index, line, end_offset, error, inputs, outputs, client_id, parameters, rows, count = fields
    tensors = None if inputs is None else [WireTensor(name, datatype, tuple(shape), data)
                                           for name, datatype, shape, data in inputs]
    return InputItem(index, line, end_offset, tensors, outputs, client_id, parameters, error, rows, count)
