"""A line parser's side (fleet/jobs/parse_pool.py): a forked child that parses the chunks of lines its job worker
sends and sends the items back, in order, until its input pipe ends."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
from typing import Any, NoReturn

import msgpack

from fleet.jobs.items import InputItem, ItemParser, RawLine
from fleet.jobs.parse_wire import encode_item, read_frame, write_frame
from fleet.lifetime import die_with_parent

# Blocked by the job worker around the fork, unblocked by the child once its own handlers are set.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def parse_chunk(lines: list[list[Any]], parse: ItemParser) -> bytes:
    """A child's work on one chunk: each [index, line, end_offset, body] parsed, its items packed in order."""
    items = [encode_item(parse(RawLine(index, line, end_offset, body))) for index, line, end_offset, body in lines]
    try:
        packed: bytes = msgpack.packb(items, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # some value msgpack cannot carry: only its line fails
        packed = msgpack.packb([_packable(fields) for fields in items], use_bin_type=True)
    return packed


def _packable(fields: list[Any]) -> list[Any]:
    try:
        msgpack.packb(fields, use_bin_type=True)
        return fields
    except (TypeError, ValueError, OverflowError):
        index, line, end_offset = fields[:3]
        return encode_item(InputItem(index, line, end_offset, None,
                                     error="the request cannot be encoded for the model's queue"))


def run_child(requests: int, results: int, parse: ItemParser, parent: int) -> NoReturn:
    """A forked child's whole life: chunks in, items out, until its input pipe ends. Never returns."""
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the job worker's handlers
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the job worker's to handle
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the parent around the fork
        die_with_parent(signal.SIGKILL, parent)
        keep = sorted((requests, results))
        os.closerange(3, keep[0])  # Redis sockets, the output file, other pools' pipes: not the child's
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 20)
        sys.setswitchinterval(0.0005)  # the reading thread gets the GIL soon after a frame comes, not 5 ms on
        frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=_read_frames, args=(requests, frames), daemon=True).start()
        while (frame := frames.get()) is not None:
            write_frame(results, parse_chunk(msgpack.unpackb(frame, raw=False), parse))
    except BrokenPipeError:
        pass  # the job worker closed the pool (the job ended early): nothing to say
    except BaseException as exc:  # noqa: BLE001 - a child reports and exits; the parent parses in its place
        code = 1
        try:
            os.write(2, f"a job's line parser (pid {os.getpid()}) failed: {exc!r}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def _read_frames(fd: int, frames: queue.SimpleQueue[bytes | None]) -> None:
    """A child's input pipe drained as it comes; None at its end (or a broken frame: the child then ends)."""
    try:
        while (frame := read_frame(fd)) is not None:
            frames.put(frame)
    except OSError:
        pass
    frames.put(None)
