"""`python`: Triton's Python backend. Each instance is a stub subprocess (workers/backends/python_stub)
fed over a pipe with length-prefixed msgpack frames carrying raw tensor bytes.

The stub hop costs one pipe round trip per batch (not per request). A stub that dies fails the batch
it held and is restarted, so a crashing model costs requests, never the worker.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

from fleet.envelope import WireTensor
from fleet.errors import ConfigError, InferenceFailed, from_code
from workers.backends.base import InferenceItem, ItemResult, LoadContext, failed
from workers.backends.frames import PipeClosed, read_frame, write_frame

log = logging.getLogger(__name__)


class PythonBackend:
    takes_wire = True  # the stub gets the envelope's tensor bytes as they are

    def __init__(self, ctx: LoadContext) -> None:
        self._ctx = ctx
        self._model_py = ctx.model_dir / str(ctx.version) / ctx.spec.default_model_filename
        if not self._model_py.exists():
            raise ConfigError(f"{ctx.spec.name}: {self._model_py} is missing")
        self._proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        ctx = self._ctx
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "workers.backends.python_stub", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._out = os.fdopen(to_child_w, "wb")
        self._in = os.fdopen(from_child_r, "rb", buffering=0)
        args = {
            "model_config": json.dumps(ctx.spec.to_json()),
            "model_instance_kind": "GPU" if ctx.device.startswith("cuda") else "CPU",
            "model_instance_name": ctx.instance_name,
            "model_instance_device_id": ctx.device.split(":")[1] if ":" in ctx.device else "0",
            "model_repository": str(ctx.model_dir),
            "model_version": str(ctx.version),
            "model_name": ctx.spec.name,
        }
        reply = self._roundtrip({"op": "init", "model_py": str(self._model_py), "args": args})
        if "error" in reply:
            self.close()
            raise ConfigError(f"{ctx.spec.name}: initialize() failed: {reply['error']}")

    def _roundtrip(self, message: dict[str, Any]) -> Any:
        try:
            write_frame(self._out, message)
            return read_frame(self._in)
        except (PipeClosed, BrokenPipeError, OSError) as exc:
            code = self._proc.poll() if self._proc else None
            raise InferenceFailed(f"the Python model instance {self._ctx.instance_name} stopped "
                                  f"(exit code {code})") from exc

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        requests = [
            {"id": item.request_id, "i": [[t.name, t.datatype, list(t.shape), t.data] for t in item.wire],
             "o": item.requested_outputs, "p": item.parameters}
            for item in items
        ]
        try:
            reply = self._roundtrip({"op": "execute", "requests": requests})
        except InferenceFailed as exc:
            log.error("%s; restarting it", exc)
            self._restart()
            return failed(items, exc)
        if "error" in reply:
            if reply.get("trace"):
                log.warning("%s execute() raised:\n%s", self._ctx.instance_name, reply["trace"])
            return failed(items, InferenceFailed(reply["error"]))
        return [self._result(r) for r in reply["responses"]]

    @staticmethod
    def _result(raw: dict[str, Any]) -> ItemResult:
        if "e" in raw:
            return ItemResult(error=from_code(raw["e"][0], raw["e"][1]))
        wire = {name: WireTensor(name, datatype, tuple(shape), data) for name, datatype, shape, data in raw["o"]}
        return ItemResult(wire_outputs=wire, parameters=raw.get("p") or {})

    def _restart(self) -> None:
        self.close()
        try:
            self._start()
        except Exception:
            log.exception("cannot restart %s", self._ctx.instance_name)

    def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                write_frame(self._out, {"op": "finalize"})
                read_frame(self._in)
        except (PipeClosed, OSError):
            pass
        for f in (self._out, self._in):
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None
