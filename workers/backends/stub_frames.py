"""What a Python-backend stub sends besides its replies, handled in the worker: BLS calls (answered
through the worker's BLS handler), a decoupled model's responses and the model's custom metrics. One
per instance (workers/backends/python_backend.py); each stub process it starts reports its metrics
under a name of its own (`stub`)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.backends.base import LoadContext
from workers.backends.decoupled import DecoupledCall
from workers.backends.stub_pipe import StubPipe

log = logging.getLogger(__name__)


class StubFrames:
    def __init__(self, ctx: LoadContext, link: str) -> None:
        self._ctx = ctx
        # The models waiting on what this instance runs now (their BLS chain, set per call) and this one.
        self.chain: list[str] = [link]
        self.decoupled: DecoupledCall | None = None  # the call in flight, for a decoupled model
        # BLS replies are written off the event loop that produced them (a large tensor must not stall it).
        self._writer: ThreadPoolExecutor | None = None

    def handled(self, stub: str, pipe: StubPipe, msg: Any) -> bool:
        """Handle a frame of `stub`'s that is not a reply (BLS call, decoupled response, metrics); return
        whether it was one. Custom metrics (`m`) are published before the reply that carries them is handed
        on. Never raises (stub_pipe.Handle)."""
        op = msg.get("op") if isinstance(msg, dict) else None
        try:
            if isinstance(msg, dict) and isinstance(msg.get("m"), list):
                self._metrics(stub, msg.pop("m"))
            if op == "bls":
                self._bls(msg, pipe)
            elif op == "send":
                self._on_send(msg)
        except Exception as exc:
            log.exception("%s: handling the stub's %s frame failed", self._ctx.instance_name, op or "reply")
            if op == "bls":  # the model waits for an answer
                pipe.send({"op": "bls_reply", "n": msg.get("n"), "final": True,
                           "e": ["INTERNAL", f"the BLS call failed: {type(exc).__name__}: {exc}"]})
        return op in ("metrics", "bls", "send")

    def gone(self, stub: str) -> None:
        """Its pipe closed: what it counted is kept, and a decoupled call waiting on it fails."""
        self._metrics(stub, None)
        call = self.decoupled
        if call is not None:
            call.stub_died()

    def close(self) -> None:
        """The stub stopped: its BLS replies' writer goes (the next stub's first BLS call starts another)."""
        if self._writer is not None:
            self._writer.shutdown(wait=False)
            self._writer = None

    def _metrics(self, stub: str, snapshot: object) -> None:
        """A snapshot of the stub's custom metrics to the worker's book; None once the stub is gone."""
        writes = self._ctx.writes
        if writes is None:  # loaded without a worker around it (tests): nowhere to publish
            return
        if snapshot is None:
            writes.custom_metrics.retire(self._ctx.spec.name, stub)
        else:
            writes.custom_metrics.report(self._ctx.spec.name, stub, snapshot)

    def _bls(self, msg: dict[str, Any], pipe: StubPipe) -> None:
        n = msg.get("n")
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"{self._ctx.instance_name}-bls-writer")
        writer = self._writer

        def reply(frame: dict[str, Any]) -> None:
            try:
                writer.submit(pipe.send, {**frame, "op": "bls_reply", "n": n})
            except RuntimeError:  # the writer was shut down: the stub that asked is gone, and its call
                pass

        bls = self._ctx.bls
        if bls is None:
            reply({"e": ["UNSUPPORTED", "BLS calls are not available in this process"], "final": True})
            return
        bls.call(msg, list(self.chain), reply)

    def _on_send(self, msg: dict[str, Any]) -> None:
        """A decoupled model's response (workers/backends/decoupled.py)."""
        call = self.decoupled
        if call is not None:
            call.on_send(msg)
        else:
            log.warning("%s sent a response for a request that is complete: dropped", self._ctx.instance_name)
