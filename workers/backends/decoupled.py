"""A decoupled Python model's responses (`model_transaction_policy { decoupled: true }`).

The stub sends each response as the model sends it (`send` frames, workers/backends/python_stub.py).
Every response but the last is written to its caller's reply stream at once, one reply entry per
response, marked not final (`emit`, workers/replies.py), on the thread that reads the stub's pipe, so
they reach Redis in the order the model sent them. The response that carries the final flag (or the
flag alone) becomes the request's result, answered and acknowledged by the worker loop like any other,
after the ones before it.

An instance of a decoupled model takes its next batch once every request of the current one is complete
(the final flag sent), whether the model sends from execute() or from its own threads after execute()
returned: a request's message stays held, and its instance busy, until it is answered in full.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet.errors import ServingError
from workers.backends.base import InferenceItem, ItemResult

FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
Emit = Callable[[InferenceItem, dict[str, Any]], None]


@dataclass(slots=True)
class _Open:
    item: InferenceItem
    last: dict[str, Any] | None = None  # the response sent with the final flag, if any
    done: bool = False


class DecoupledCall:
    """The requests of one execute() of a decoupled model, until each has its final flag."""

    def __init__(self, items: list[InferenceItem], emit: Emit) -> None:
        self._open = {item.key: _Open(item) for item in items}
        self._order = [item.key for item in items]
        self._emit = emit
        self._cv = threading.Condition()
        self._died = False

    def on_send(self, msg: dict[str, Any]) -> None:
        """A `send` frame (the pipe's reader thread)."""
        entry = self._open.get(str(msg.get("k")))
        if entry is None or entry.done:
            return
        if not int(msg.get("f", 0)) & FINAL:
            if "r" in msg:
                self._emit(entry.item, msg["r"])
            return
        with self._cv:
            entry.last = msg.get("r")
            entry.done = True
            self._cv.notify_all()

    def stub_died(self) -> None:
        with self._cv:
            self._died = True
            self._cv.notify_all()

    def wait(self) -> bool:
        """Until every request is complete (True) or the stub died (False)."""
        with self._cv:
            self._cv.wait_for(lambda: self._died or all(e.done for e in self._open.values()))
            return all(e.done for e in self._open.values())

    def results(self, decode: Callable[[dict[str, Any]], ItemResult],
                failed: ServingError | None = None) -> list[ItemResult]:
        """Each request's last word; `failed`: the error of those with no final flag (the call failed)."""
        out = []
        for key in self._order:
            entry = self._open[key]
            if failed is not None and not entry.done:
                out.append(ItemResult(error=failed))
            else:
                out.append(ItemResult(empty=True) if entry.last is None else decode(entry.last))
        return out
