"""The stub's end of its pipe to the worker, multiplexed: a reader thread sorts what the worker sends.

Frames from the worker: `init`, `execute` and `finalize` go to the stub's main loop in order (one at a
time, each answered by one reply frame); `bls_reply` frames answer a BLS call the model made (each
carries the call's number `n`, several per call when the callee is decoupled); `cancel` marks requests
of a decoupled model cancelled (their callers went away). Frames to the worker: the replies, `bls`
calls, and `send` (a decoupled model's response, sent while execute() runs or from a thread after it
returned). Writes come from several threads (the main loop, a model's threads), so they take a lock.

Who reads: the main loop itself, in `next_op`, handing on the BLS replies that come meanwhile (to a
model's own thread's call), until a frame may come while it is not reading: a BLS call's replies while
execute() runs (or a model's thread waits for them while it does), a decoupled model's cancellations.
Then a reader thread reads and sorts from that moment on (`start_reader`). A reader handing each call to
the main loop cost every call a thread wake-up and a GIL hand-off (~36 µs of the stub's CPU a call at
`double`, C=1, and the wake's latency).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import IO, Any

from workers.backends.frames import PipeClosed, read_frame, write_frame

_CLOSED: dict[str, Any] = {"op": "closed"}
_GONE: dict[str, Any] = {"e": ["UNAVAILABLE", "the worker closed the stub's pipe"], "final": True}


class StubChannel:
    def __init__(self, inp: IO[bytes], out: IO[bytes]) -> None:
        self._in = inp
        self._out = out
        self._write_lock = threading.Lock()
        self._ops: queue.Queue[dict[str, Any]] = queue.Queue()
        self._calls: dict[int, Callable[[dict[str, Any]], None]] = {}
        self._calls_lock = threading.Lock()
        self._next_call = 0
        self.on_cancel: Callable[[list[str]], None] = lambda keys: None
        self._reader: threading.Thread | None = None
        self._main_reading = False  # the main loop is in next_op's read (changed under _calls_lock)
        self._closed = False  # the worker closed the pipe (under _calls_lock)

    @property
    def reading(self) -> bool:
        """Whether a reader thread reads the pipe (one of the stub's own threads, not a model's)."""
        return self._reader is not None

    def start_reader(self) -> None:
        """From now on a thread reads the pipe (the main loop must not be reading: see `call`)."""
        with self._calls_lock:
            self._start_reader()

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="stub-reader", daemon=True)
            self._reader.start()

    def next_op(self) -> dict[str, Any] | None:
        """The worker's next init/execute/finalize frame; None once the pipe closed."""
        while True:
            with self._calls_lock:
                if self._reader is not None:
                    break
                self._main_reading = True
            try:
                msg: dict[str, Any] = read_frame(self._in)
            except (PipeClosed, OSError, ValueError):
                with self._calls_lock:
                    self._main_reading = False
                self._gone()
                return None
            with self._calls_lock:
                self._main_reading = False
                if self._calls and msg.get("op") not in ("bls_reply", "cancel"):
                    self._start_reader()  # a model's thread waits for replies while the main loop runs msg
            if self._sorted(msg):
                return msg
        msg = self._ops.get()
        return None if msg is _CLOSED else msg

    def send(self, message: dict[str, Any]) -> None:
        with self._write_lock:
            write_frame(self._out, message)

    def call(self, message: dict[str, Any], on_reply: Callable[[dict[str, Any]], None]) -> int:
        """Send a BLS call; `on_reply` gets each of its reply frames (on the reader thread, or the main
        loop's while it reads). Unless the main loop reads now (the call is a model thread's, between
        calls), a reader thread must: the replies come while execute() runs."""
        with self._calls_lock:
            closed = self._closed
            if not closed:
                if not self._main_reading:
                    self._start_reader()
                self._next_call += 1
                n = self._next_call
                self._calls[n] = on_reply
        if closed:
            on_reply(_GONE)
            return 0
        try:
            self.send({**message, "n": n})
        except BaseException:
            self.forget(n)
            raise
        return n

    def forget(self, n: int) -> None:
        with self._calls_lock:
            self._calls.pop(n, None)

    def _read(self) -> None:
        while True:
            try:
                msg = read_frame(self._in)
            except (PipeClosed, OSError, ValueError):
                self._gone()
                self._ops.put(_CLOSED)
                return
            if self._sorted(msg):
                self._ops.put(msg)

    def _gone(self) -> None:
        """The worker closed the pipe: no BLS call waits for ever, now or later."""
        with self._calls_lock:
            self._closed = True
            calls, self._calls = list(self._calls.values()), {}
        for on_reply in calls:
            on_reply(_GONE)

    def _sorted(self, msg: dict[str, Any]) -> bool:
        """Hand a BLS reply or a cancellation on; True for the main loop's frames."""
        op = msg.get("op")
        if op == "bls_reply":
            with self._calls_lock:  # a final reply ends its call (the caller may forget it only later)
                n = msg.get("n", -1)
                handler = self._calls.pop(n, None) if msg.get("final", True) else self._calls.get(n)
            if handler is not None:
                handler(msg)
            return False
        if op == "cancel":
            self.on_cancel(list(msg.get("keys") or []))
            return False
        return True
