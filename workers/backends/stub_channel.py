"""The stub's end of its pipe to the worker, multiplexed: a reader thread sorts what the worker sends.

Frames from the worker: `init`, `execute` and `finalize` go to the stub's main loop in order (one at a
time, each answered by one reply frame); `bls_reply` frames answer a BLS call the model made (each
carries the call's number `n`, several per call when the callee is decoupled); `cancel` marks requests
of a decoupled model cancelled (their callers went away). Frames to the worker: the replies, `bls`
calls, and `send` (a decoupled model's response, sent while execute() runs or from a thread after it
returned). Writes come from several threads (the main loop, a model's threads), so they take a lock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import IO, Any

from workers.backends.frames import PipeClosed, read_frame, write_frame

_CLOSED: dict[str, Any] = {"op": "closed"}


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
        self._reader = threading.Thread(target=self._read, name="stub-reader", daemon=True)
        self._reader.start()

    def next_op(self) -> dict[str, Any] | None:
        """The worker's next init/execute/finalize frame; None once the pipe closed."""
        msg = self._ops.get()
        return None if msg is _CLOSED else msg

    def send(self, message: dict[str, Any]) -> None:
        with self._write_lock:
            write_frame(self._out, message)

    def call(self, message: dict[str, Any], on_reply: Callable[[dict[str, Any]], None]) -> int:
        """Send a BLS call; `on_reply` gets each of its reply frames (on the reader thread)."""
        with self._calls_lock:
            self._next_call += 1
            n = self._next_call
            self._calls[n] = on_reply
        self.send({**message, "n": n})
        return n

    def forget(self, n: int) -> None:
        with self._calls_lock:
            self._calls.pop(n, None)

    def _read(self) -> None:
        while True:
            try:
                msg = read_frame(self._in)
            except (PipeClosed, OSError, ValueError):
                with self._calls_lock:
                    calls, self._calls = list(self._calls.values()), {}
                for on_reply in calls:  # the worker is gone: no BLS call waits for ever
                    on_reply({"e": ["UNAVAILABLE", "the worker closed the stub's pipe"], "final": True})
                self._ops.put(_CLOSED)
                return
            op = msg.get("op")
            if op == "bls_reply":
                with self._calls_lock:
                    handler = self._calls.get(msg.get("n", -1))
                if handler is not None:
                    handler(msg)
            elif op == "cancel":
                self.on_cancel(list(msg.get("keys") or []))
            else:
                self._ops.put(msg)
