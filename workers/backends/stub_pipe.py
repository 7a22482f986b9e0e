"""The worker's end of a Python-backend stub's pipes (workers/backends/stub_channel.py is the stub's end).

Frames (frames.py) are written under a lock: an instance's calls, BLS replies from their writer thread and
cancellations come from different threads. Each call (init, execute, finalize) is answered by one reply
frame, in order; other frames (BLS calls, a decoupled model's responses, custom metrics) go to the
`handle` callable as they come.

Who reads: until the stub can write outside a call, the thread that makes a call reads its reply itself. A
reader thread handing each reply on cost every batch a thread wake-up and a GIL hand-off each way (25
futex calls a batch at perf_analyzer's `double`, C=32). A decoupled model sends responses after execute()
returns; a model with custom metrics has its stub flush them between calls; a model's own threads may make
BLS calls at any time. Those stubs get a reader thread: decoupled ones from the start (`reader=True`), the
others from the first reply that says `between` (python_stub.py's `reply`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import IO, Any

from workers.backends.frames import PipeClosed, read_frame, write_frame

# A frame that is not a reply: handled (True), or a reply (False). Must not raise: a reply left unread in the
# pipe would answer the next call.
Handle = Callable[["StubPipe", Any], bool]


class StubPipe:
    def __init__(self, inp: IO[bytes], out: IO[bytes], reader_name: str, handle: Handle,
                 closed: Callable[[], None], *, reader: bool) -> None:
        """`closed` is called once the stub's end is seen closed (or this end is, with no reader thread)."""
        self._in, self._out = inp, out
        self._reader_name = reader_name
        self._handle, self._closed = handle, closed
        self._write_lock = threading.Lock()
        self._replies: queue.SimpleQueue[Any] = queue.SimpleQueue()  # a reader thread's, in order
        self._inline = True
        if reader:
            self._start_reader()

    def call(self, message: dict[str, Any]) -> Any:
        """Write a call and return its reply. Raises PipeClosed, OSError or ValueError (a pipe closed here)."""
        self.write(message)
        if self._inline:
            return self._inline_reply()
        reply = self._replies.get()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def write(self, message: dict[str, Any]) -> None:
        with self._write_lock:
            write_frame(self._out, message)

    def send(self, message: dict[str, Any]) -> None:
        """`write`, dropped if the stub is gone (its call died with it)."""
        try:
            self.write(message)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        for f in (self._out, self._in):
            try:
                f.close()
            except OSError:
                pass
        if self._inline:  # no reader thread to see the pipe close
            self._closed()

    def _start_reader(self) -> None:
        self._inline = False
        threading.Thread(target=self._read, daemon=True, name=self._reader_name).start()

    def _inline_reply(self) -> Any:
        while True:
            try:
                msg = read_frame(self._in)
            except (PipeClosed, OSError, ValueError) as exc:
                self._closed()
                raise PipeClosed(str(exc)) from exc
            if self._handle(self, msg):
                continue
            if isinstance(msg, dict) and msg.pop("between", False):
                self._start_reader()  # the stub may write between calls from now on: someone must read it
            return msg

    def _read(self) -> None:
        while True:
            try:
                msg = read_frame(self._in)
            except (PipeClosed, OSError, ValueError) as exc:
                self._replies.put(PipeClosed(str(exc)))
                self._closed()
                return
            if not self._handle(self, msg):
                self._replies.put(msg)
