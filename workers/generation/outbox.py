"""A generation engine's streamed responses, written off the engine thread and batched.

The engine thread must not wait on Redis once per token per sequence: it hands each piece to the outbox
and computes on. A writer thread takes everything queued, writes it in one pipeline (ModelWrites.
emit_many) and only then runs the callbacks queued with it (`after`): a request's slot is released, and
so its final reply written by the worker loop, only after every response before it has reached Redis,
which keeps a stream's responses in order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from workers.backends.base import InferenceItem, ModelWrites

log = logging.getLogger(__name__)

_BATCH = 256  # responses per pipeline at most


class Outbox:
    def __init__(self, writes: ModelWrites, name: str) -> None:
        self._writes = writes
        self._queue: queue.SimpleQueue[tuple[InferenceItem, dict[str, Any]] | Callable[[], None] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-outbox", daemon=True)
        self._thread.start()

    def send(self, item: InferenceItem, frame: dict[str, Any]) -> None:
        self._queue.put((item, frame))

    def after(self, callback: Callable[[], None]) -> None:
        """Runs `callback` once every response sent before it is written."""
        self._queue.put(callback)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            taken = [first]
            while len(taken) < _BATCH:
                try:
                    taken.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            frames = [t for t in taken if isinstance(t, tuple)]
            try:
                self._writes.emit_many(frames)
            except Exception:  # emit_many logs Redis errors itself; anything else must not stop the writer
                log.exception("streamed responses could not be written")
            for t in taken:
                if t is None:
                    return
                if not isinstance(t, tuple):
                    t()
