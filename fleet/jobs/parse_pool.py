"""A JSONL job's lines parsed by forked helper processes, handed back in input order.

A JSONL job is bound by the job worker's one thread, and parsing a line (JSON, the checks against the
model's config, the conversion to wire bytes) is about half of that thread's work (bench/RESULTS.md, stop
60). Here the job worker reads and numbers the lines itself, as before, and sends them in chunks to
`processes` children forked from it, each parsing whole chunks with the job's own parser; the results come
back chunk by chunk in the order the chunks were sent. So resume cursors, line numbers and errors are
exactly those of parsing in process, and each line is parsed once.

- The children are forked, not started afresh: they inherit the model's spec and the parser, and start in
  milliseconds (their side: fleet/jobs/parse_child.py). A child closes every file descriptor but its two
  pipes and stderr (no Redis, no output file), keeps the parent's objects out of its garbage collector
  (gc.freeze), leaves with os._exit whatever happens, gets SIGKILL when the job worker dies
  (PR_SET_PDEATHSIG) and ends at the end of its input pipe. (The parser may still log a parser bug, to
  stderr.)
- The pipes carry length-prefixed msgpack frames (never pickle): lines out, items back
  (fleet/jobs/parse_wire.py).
- Up to DEPTH chunks in flight per child, so a child always has its next chunk when it finishes one. A
  thread in the child reads its input pipe as frames come (into memory: DEPTH chunks at most), so the job
  worker's writes never wait on a child that is itself waiting for the job worker to read its results.
- A child that dies, stops answering or taking its chunks for RESULT_TIMEOUT_S, or sends what cannot be read
  costs nothing but speed: it is dropped (a warning in the log) and its chunks are parsed in process; once
  every child is gone, so is the rest of the input. An error reading the input itself is the job's, as in
  process (raised as it is met: the chunks already sent to the children are not handed on before it).
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack

from fleet.jobs.items import InputItem, ItemParser, RawLine
from fleet.jobs.parse_child import STOP_SIGNALS, run_child
from fleet.jobs.parse_wire import decode_item, read_frame, write_frame

log = logging.getLogger(__name__)

Entry = InputItem | RawLine  # a line to parse, or an item already made (a line over the limit)

CHUNK_LINES = 128  # lines a chunk at most (~420 KB of 256-float lines)
CHUNK_BYTES = 1 << 20  # and at most this many bytes of lines, unless one line alone is more
DEPTH = 2  # chunks sent to a child and not read back yet, at most
# Each pipe holds this much (Linux's default 64 KiB would take a chunk in several reads, and a thread that
# reads between the child's parsing waits for the GIL before each).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_STOP_WAIT_S = 2.0
# A chunk's result (or room for the next chunk in its pipe) not coming within this long: the child is taken for
# hung (a chunk of 128 lines takes milliseconds; one 16 MiB line, the longest a job takes, well under a second).
RESULT_TIMEOUT_S = 60.0


def auto_processes(cpus: int | None) -> int:
    """Helpers when the setting is not given (None): two on a host of four cores or more, else none.

    One helper only moves the parsing (~36 µs a 256-float line, a little more than in process) to another
    process, so it pays nothing alone; two parse faster than the job worker does the rest of a line (~35 µs:
    reading, sending, collecting, writing its output), so more would stay idle. On a 2-core host (bench/
    RESULTS.md, stop 60) two made a GPU-like model's JSONL job 1.18-1.28x but a CPU model's 0.88-1.04x (its
    forward takes a core, Redis and the worker most of the other): there the job worker parses itself
    unless told otherwise (FLEET_JOB_PARSE_PROCESSES=2)."""
    return 2 if (cpus or 1) >= 4 else 0


# ---------------------------------------------------------------- the pool


@dataclass(eq=False)
class _Helper:
    pid: int
    requests: int  # write end: chunks to the child
    results: int  # read end: items from the child
    in_flight: int = 0  # chunks sent, their results not read yet


class ParsePool:
    """`processes` forked parsers for one read of a JSONL input; `items()` yields every entry's item in order.
    Use it once; `close()` (also at the end of `items()`) stops the children and reaps them."""

    def __init__(self, parse: ItemParser, processes: int) -> None:
        self._parse = parse
        self._helpers: list[_Helper] = []
        # Chunks sent, oldest first: (the chunk's entries, the helper parsing its lines or None).
        self._sent: deque[tuple[list[Entry], _Helper | None]] = deque()
        self._source: Iterator[Entry] = iter(())
        self._exhausted = False
        try:
            for _ in range(processes):
                helper = self._fork()
                if helper is None:
                    break
                self._helpers.append(helper)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [h.pid for h in self._helpers]

    def _fork(self) -> _Helper | None:
        parent = os.getpid()
        try:
            to_child_r, to_child_w = os.pipe()
            from_child_r, from_child_w = os.pipe()
        except OSError as exc:
            log.warning("job input: no pipes for a parser process (%s); parsing in process", exc)
            return None
        for fd in (to_child_w, from_child_w):
            try:
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # over /proc/sys/fs/pipe-max-size for this user: the default size works, slower
                pass
        # No collection across the fork (the child freezes what it inherits: no finalizer of the parent's objects
        # runs there, and no page of them is copied for it); the stop signals wait until the child has its own
        # handlers. Restored in the parent whatever happens.
        collecting = gc.isenabled()
        gc.disable()
        signals = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = -1
        try:
            pid = os.fork()
            if pid == 0:
                try:  # the child: only its own ends of its own pipes stay open; it never returns from here
                    gc.freeze()
                    gc.enable()
                    os.close(to_child_w)
                    os.close(from_child_r)
                finally:
                    run_child(to_child_r, from_child_w, self._parse, parent)
        except OSError as exc:
            log.warning("job input: cannot fork a parser process (%s); parsing in process", exc)
        finally:
            if pid != 0:
                signal.pthread_sigmask(signal.SIG_SETMASK, signals)
                if collecting:
                    gc.enable()
                os.close(to_child_r)
                os.close(from_child_w)
                if pid < 0:
                    os.close(to_child_w)
                    os.close(from_child_r)
        if pid < 0:
            return None
        os.set_blocking(to_child_w, False)  # its writes wait in _write_all, bounded (the child's end blocks)
        return _Helper(pid, to_child_w, from_child_r)

    def items(self, entries: Iterator[Entry]) -> Iterator[InputItem]:
        """Every entry as its item, in order: lines parsed by the children (in process without any), items
        passed through. Closing this generator early stops the children too."""
        try:
            if not self._helpers:
                yield from self._in_process(entries)
                return
            self._source = iter(entries)
            self._exhausted = False
            while True:
                self._refill()
                if not self._sent:
                    if self._exhausted:
                        return
                    # every helper gone: the rest in process, as it comes
                    yield from self._in_process(self._source)
                    return
                chunk, helper = self._sent.popleft()
                parsed = self._receive(helper, chunk) if helper is not None else None
                if parsed is None:  # a helper failed, or nothing to parse: this chunk in process
                    parsed = list(self._in_process(chunk))
                yield from parsed
        finally:
            self.close()

    def _in_process(self, entries: Iterable[Entry]) -> Iterator[InputItem]:
        """Each entry's item, parsed here: the lines a helper did not take, or all of them without helpers."""
        return (e if isinstance(e, InputItem) else self._parse(e) for e in entries)

    def _refill(self) -> None:
        """A chunk to every idle helper, while the input lasts."""
        while not self._exhausted and (idle := self._idle()) is not None:
            chunk = _next_chunk(self._source)
            if not chunk:
                self._exhausted = True
                return
            self._sent.append((chunk, self._send(idle, chunk)))

    def _idle(self) -> _Helper | None:
        """The helper with the fewest chunks in flight, if it has room for one more."""
        helper = min(self._helpers, key=lambda h: h.in_flight, default=None)
        return helper if helper is not None and helper.in_flight < DEPTH else None

    def _send(self, helper: _Helper, chunk: list[Entry]) -> _Helper | None:
        lines = [[e.index, e.line, e.end_offset, e.body] for e in chunk if isinstance(e, RawLine)]
        if not lines:  # only items made already (lines over the limit): they pass through as they are
            return None
        try:
            # (a stopped child's pipe could stay full: the same timeout as its results')
            write_frame(helper.requests, msgpack.packb(lines, use_bin_type=True), RESULT_TIMEOUT_S)
        except OSError as exc:  # a child gone (EPIPE), or TimeoutError
            self._lose(helper, f"cannot write to it ({exc})")
            return None
        helper.in_flight += 1
        return helper

    def _receive(self, helper: _Helper, chunk: list[Entry]) -> list[InputItem] | None:
        """The chunk's items, its lines parsed by `helper`; None if the helper failed (it is dropped)."""
        if helper not in self._helpers:  # dropped since this chunk was sent
            return None
        try:
            frame = read_frame(helper.results, RESULT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            self._lose(helper, f"its result could not be read ({exc!r})")
            return None
        if frame is None:
            self._lose(helper, "it exited")
            return None
        helper.in_flight -= 1
        self._refill()  # its next chunk goes out before this one is decoded (an error reading the input is the job's)
        try:
            parsed = iter([decode_item(fields) for fields in msgpack.unpackb(frame, raw=False)])
            items = [entry if isinstance(entry, InputItem) else next(parsed) for entry in chunk]
            if next(parsed, None) is not None:
                raise ValueError("more items than lines")
        except (ValueError, TypeError, StopIteration, msgpack.UnpackException) as exc:
            self._lose(helper, f"its result does not match the chunk it was sent ({exc!r})")
            return None
        return items

    def _lose(self, helper: _Helper, why: str) -> None:
        if helper not in self._helpers:
            return
        log.warning("job input: parser process %d dropped: %s; its lines are parsed in process", helper.pid, why)
        self._helpers.remove(helper)
        self._stop([helper])

    def close(self) -> None:
        helpers, self._helpers = self._helpers, []
        self._stop(helpers)

    @staticmethod
    def _stop(helpers: list[_Helper]) -> None:
        """Close the pipes (a child reading its input then ends), then reap each child; one still there after
        _STOP_WAIT_S (mid-chunk on a huge line) is killed."""
        for h in helpers:
            for fd in (h.requests, h.results):
                try:
                    os.close(fd)
                except OSError:
                    pass
        deadline = time.monotonic() + _STOP_WAIT_S
        for h in helpers:
            while True:
                try:
                    done, _ = os.waitpid(h.pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                if time.monotonic() >= deadline:
                    try:
                        os.kill(h.pid, signal.SIGKILL)
                        os.waitpid(h.pid, 0)
                    except (ProcessLookupError, ChildProcessError):
                        pass
                    break
                time.sleep(0.005)


def _next_chunk(source: Iterator[Entry]) -> list[Entry]:
    """Up to CHUNK_LINES lines (and the items among them), at most CHUNK_BYTES of lines unless one is more."""
    chunk: list[Entry] = []
    lines = size = 0
    for entry in source:
        chunk.append(entry)
        if isinstance(entry, RawLine):
            lines += 1
            size += len(entry.body)
            if lines >= CHUNK_LINES or size >= CHUNK_BYTES:
                break
    return chunk
