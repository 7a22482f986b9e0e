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

While no thread reads, the worker's event loop may read a reply itself (`read_on_loop`): the loop writes
an execute call and is woken by the stub's answer, with no instance thread between (workers/instance.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import queue
import threading
from collections.abc import Callable
from typing import IO, Any

import msgpack

from workers.backends.frames import LENGTH, PipeClosed, pack, read_frame, write_packed

# A frame that is not a reply: handled (True), or a reply (False). Must not raise: a reply left unread in the
# pipe would answer the next call.
Handle = Callable[["StubPipe", Any], bool]
READ: Any = object()  # `reply`'s first frame: none yet, read it
# The event loop takes a large reply a pipe's capacity at a time, with its other events between.
READ_CHUNK = 1 << 16
F_GETPIPE_SZ = 1032  # fcntl: a pipe's capacity (Linux)


class StubPipe:
    def __init__(self, inp: IO[bytes], out: IO[bytes], reader_name: str, handle: Handle,
                 closed: Callable[[], None], *, reader: bool) -> None:
        """`closed` is called once the stub's end is seen closed (or this end is, with no reader thread)."""
        self._in, self._out = inp, out
        self._reader_name = reader_name
        self._handle, self._closed = handle, closed
        self._write_lock = threading.Lock()
        self._replies: queue.SimpleQueue[Any] = queue.SimpleQueue()  # a reader thread's, in order
        self._reader_gone = False  # its reader thread saw the pipe close: no reply comes any more
        self._inline = True
        # Whether the read end is non-blocking now. The event loop reads it so, a thread blocking; each
        # sets it only when it is not (calls from the loop one after another leave it as it is: two
        # ioctls fewer a call).
        self._nonblocking = False
        try:  # what a write takes without waiting for the stub to read (the pipe is empty between calls)
            self.capacity = fcntl.fcntl(out.fileno(), F_GETPIPE_SZ)
        except OSError:
            self.capacity = 4096  # POSIX's least
        if reader:
            self._start_reader()

    @property
    def inline(self) -> bool:
        """No reader thread: whoever made the call reads its reply (a thread, or the event loop)."""
        return self._inline

    def reply(self, first: Any = READ) -> Any:
        """The reply to the call written last. `first`: its first frame, or the error that ended the pipe,
        as `read_on_loop` had it (the rest is read here, on the calling thread). Raises PipeClosed, OSError
        or ValueError (a pipe closed here)."""
        if isinstance(first, BaseException):
            self._closed()
            raise PipeClosed(str(first)) from first
        if self._inline:
            return self._inline_reply(first)
        if self._reader_gone and self._replies.empty():
            raise PipeClosed("the stub's pipe is closed")
        reply = self._replies.get()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def read_on_loop(self, loop: asyncio.AbstractEventLoop, on_frame: Callable[[Any], None]) -> None:
        """Read the next frame from the event loop without blocking it; `on_frame` gets it (or the error
        that ended the pipe) on the loop, or READ if the loop could not watch the pipe (a thread reads it
        then). Only while `inline`, and for the call written last."""
        buf = bytearray()

        def finish(result: Any) -> None:
            try:
                loop.remove_reader(fd)
            except (OSError, ValueError):  # the pipe closed here meanwhile: the frame is what it is
                pass
            on_frame(result)

        def readable() -> None:
            for _ in range(3):  # a small frame's length and body at once; a large one a chunk a time
                # Never past this frame: the next one (if any) is read by whoever reads after it.
                want = LENGTH.size - len(buf) if len(buf) < LENGTH.size else \
                    LENGTH.size + LENGTH.unpack_from(buf)[0] - len(buf)
                try:
                    chunk = os.read(fd, min(want, READ_CHUNK))
                except BlockingIOError:
                    return  # the rest is not there yet: the loop calls again when it is
                except OSError as exc:
                    finish(exc)
                    return
                if not chunk:
                    finish(PipeClosed("the other end closed the pipe"))
                    return
                buf.extend(chunk)
                if len(buf) >= LENGTH.size and len(buf) == LENGTH.size + LENGTH.unpack_from(buf)[0]:
                    try:
                        msg = msgpack.unpackb(memoryview(buf)[LENGTH.size:], raw=False)
                    except ValueError as exc:
                        finish(exc)
                        return
                    finish(msg)
                    return

        try:
            fd = self._in.fileno()
        except ValueError:  # closed here: the thread that reads it finds it so
            loop.call_soon(on_frame, READ)
            return
        try:
            # Non-blocking while the loop reads it (uvloop's add_reader makes it so too; asyncio's does not).
            # It stays so after the call: a thread that reads it next makes it blocking first (`_blocking`).
            if not self._nonblocking:
                os.set_blocking(fd, False)
                self._nonblocking = True
            loop.add_reader(fd, readable)
        except (OSError, ValueError):
            try:
                self._blocking()
            except (OSError, ValueError):
                pass
            loop.call_soon(on_frame, READ)

    def write(self, payload: bytes) -> None:
        """One frame of a message `pack`ed already (frames.py). Raises OSError or ValueError (a pipe closed
        here)."""
        with self._write_lock:
            write_packed(self._out, payload)

    def send(self, message: dict[str, Any]) -> None:
        """`write` a message, dropped if the stub is gone (its call died with it)."""
        try:
            self.write(pack(message))
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

    def _blocking(self) -> None:
        """Before a thread reads: the read end blocking, if the event loop left it not."""
        if self._nonblocking:
            os.set_blocking(self._in.fileno(), True)
            self._nonblocking = False

    def _inline_reply(self, first: Any) -> Any:
        msg = first
        while True:
            try:
                if msg is READ:
                    self._blocking()
                    msg = read_frame(self._in)
            except (PipeClosed, OSError, ValueError) as exc:
                self._closed()
                raise PipeClosed(str(exc)) from exc
            if self._handle(self, msg):
                msg = READ
                continue
            if isinstance(msg, dict) and msg.pop("between", False):
                self._start_reader()  # the stub may write between calls from now on: someone must read it
            return msg

    def _read(self) -> None:
        try:
            self._blocking()  # the loop read the last reply, and reads no more (no longer `inline`)
        except (OSError, ValueError):
            pass  # closed here: the read below says so
        while True:
            try:
                msg = read_frame(self._in)
            except (PipeClosed, OSError, ValueError) as exc:
                self._replies.put(PipeClosed(str(exc)))
                self._reader_gone = True
                self._closed()
                return
            if not self._handle(self, msg):
                self._replies.put(msg)
