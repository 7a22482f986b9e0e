"""The Python-backend stub: one subprocess per model instance, like Triton's triton_python_backend_stub.

It imports the model's model.py with fleet's `triton_python_backend_utils` on sys.path, then serves
frames from the worker: init, execute (a list of requests -> one response per request, or for a
decoupled model `send` frames as the model sends), finalize; BLS calls go the other way
(workers/backends/stub_channel.py has the frames). The model's custom metrics go to the worker as an
`m` field of a reply, or a `metrics` frame, whenever they changed (fleet/custom_metrics.py: wire form).
User code runs here, so its crash, leak or GIL use costs this instance, not the worker.

    python -m workers.backends.python_stub FD_IN FD_OUT WORKER_PID

It dies with the worker: first thing, it asks the kernel for SIGKILL when its parent goes (and kills
itself if the worker WORKER_PID is already gone), so a hung execute() cannot outlive a killed worker.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from fleet import log_context, tensors
from fleet.lifetime import die_with_parent
from fleet.logs import configure_process_logging
from workers.backends.frames import PipeClosed
from workers.backends.stub_bls import BlsCaller
from workers.backends.stub_channel import StubChannel

SHIM_DIR = Path(__file__).parent / "python_shim"
METRICS_FLUSH_S = 1.0  # how often the flusher thread looks for metric changes made between calls
PIPE_READ_BUFFER = 1 << 16  # Linux's default pipe capacity: a call the worker wrote whole, in one read


def import_model_module(model_py: Path) -> Any:
    """model.py imported as Triton's stub does (as module `model`, its directory on sys.path); also used
    by workers/auto_complete.py's child."""
    sys.path.insert(0, str(model_py.parent))
    spec = importlib.util.spec_from_file_location("model", model_py)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {model_py}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    spec.loader.exec_module(module)
    return module


def _load_model(model_py: Path) -> Any:
    return import_model_module(model_py).TritonPythonModel()


def _decode_inputs(pb: Any, raw: list[Any]) -> list[Any]:
    out = []
    for name, datatype, shape, data in raw:
        dt = tensors.lookup(datatype)
        if dt.name == "BF16":  # widened to float32 (fleet.datatypes), still a BF16 tensor to the model
            out.append(pb.Tensor(name, tensors.from_bytes(data, dt, shape), pb._FROM_NAME["BF16"]))
        elif dt.name == "BYTES":
            out.append(pb.Tensor(name, tensors.from_bytes(data, dt, shape)))
        else:
            # bytearray: models get writable inputs, as in Triton.
            out.append(pb.Tensor(name, np.frombuffer(bytearray(data), dtype=dt.numpy).reshape(shape)))
    return out


def _encode_response(pb: Any, response: Any) -> dict[str, Any]:
    if response is None:
        return {"e": ["INTERNAL", "the model returned None for a request (decoupled models are not "
                      "supported on /infer)"]}
    if response.has_error():
        err = response.error()
        return {"e": [err.code().name, err.message()]}
    outputs = []
    for t in response.output_tensors():
        arr = np.asarray(t.as_numpy())
        dt = tensors.lookup(t._datatype())  # the declared type: BF16 stays BF16
        outputs.append([t.name(), dt.name, list(arr.shape), tensors.wire_view(arr, dt)])
    raw = response.parameters()
    params = json.loads(raw) if raw and raw != "{}" else None  # most responses have none: no decoder call
    return {"o": outputs, "p": params} if params else {"o": outputs}


def _encode_checked(pb: Any, response: Any) -> dict[str, Any]:
    """One response, or its request's error: a response that cannot be encoded fails only its request."""
    if response is not None and not isinstance(response, pb.InferenceResponse):
        return {"e": ["INTERNAL", f"execute() returned a {type(response).__name__} where an "
                                  "InferenceResponse was expected"]}
    try:
        return _encode_response(pb, response)
    except Exception as exc:
        return {"e": ["INTERNAL", f"the model's response cannot be encoded: {type(exc).__name__}: {exc}"]}


class Stub:
    def __init__(self, channel: StubChannel) -> None:
        self.channel = channel
        self.model: Any = None
        self.pb: Any = None
        self.loop = asyncio.new_event_loop()
        self.decoupled = False
        self.model_name, self.model_version = "", 0
        # A decoupled model's requests not complete yet (final flag not sent), by the worker's key.
        self._senders: dict[str, Any] = {}
        self._senders_lock = threading.Lock()
        channel.on_cancel = self.cancel
        # The model's custom metrics (pb_utils.MetricFamily): a snapshot goes to the worker with the next
        # reply after they changed, and from a flusher thread for changes made between calls. One lock
        # covers taking a snapshot and sending it, so the worker never gets an older one after a newer.
        self._metrics_lock = threading.Lock()
        self._metrics_reported = 0
        self._flusher: threading.Thread | None = None
        self._own_threads = threading.active_count()  # this one, before any model's (and the stub's below)

    def init(self, msg: dict[str, Any]) -> None:
        # The worker's format and verbose level: pb_utils.Logger's lines read like the worker's own.
        log_format, verbose = msg.get("log") or ("text", 0)
        configure_process_logging(log_format, verbose, "stub")
        args = msg["args"]
        self.model_name, self.model_version = args["model_name"], int(args["model_version"])
        log_context.bind(log_context.RequestLog(self.model_name, self.model_version))  # what initialize() logs
        sys.path.insert(0, str(SHIM_DIR))
        import triton_python_backend_utils as pb

        self.pb = pb
        caller = BlsCaller(self.channel, pb)
        pb._bls_executor = caller.exec
        pb._bls_async_executor = caller.async_exec
        self.decoupled = bool(msg.get("decoupled"))
        if self.decoupled:  # cancellations come while execute() runs and after it returned
            self.channel.start_reader()
        self.model = _load_model(Path(msg["model_py"]))
        if hasattr(self.model, "initialize"):
            self._call(self.model.initialize, msg["args"])

    def _call(self, fn: Any, *args: Any) -> Any:
        result = fn(*args)
        if inspect.isawaitable(result):
            result = self.loop.run_until_complete(result)
        return result

    def _requests(self, msg: dict[str, Any], senders: list[Any] | None = None) -> list[Any]:
        pb = self.pb
        return [
            pb._incoming_request(
                _decode_inputs(pb, r["i"]), request_id=r.get("id", ""), parameters=r.get("p") or {},
                requested_output_names=r.get("o") or [], correlation_id=r.get("c", 0), flags=r.get("f", 0),
                response_sender=None if senders is None else senders[i],
            )
            for i, r in enumerate(msg["requests"])
        ]

    def execute(self, msg: dict[str, Any]) -> dict[str, Any]:
        ids = [log_context.IdsOnly(r["k"]) for r in msg["requests"]]
        token = log_context.bind(log_context.BatchLog(self.model_name, self.model_version, ids))
        try:
            return self._execute(msg)
        finally:
            log_context.unbind(token)

    def _execute(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.decoupled:
            return self._execute_decoupled(msg)
        pb = self.pb
        requests = self._requests(msg)
        try:
            responses = self._call(self.model.execute, requests)
        except Exception as exc:  # Triton: an exception fails every request of the call
            return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        if responses is None:
            # A model may answer through the response senders instead (one response each).
            responses = [self._from_sender(r) for r in requests]
        try:
            responses = list(responses)
        except Exception as exc:  # not iterable, or a generator that raised
            return {"error": f"execute() must return a list of InferenceResponse, got "
                             f"{type(responses).__name__} ({type(exc).__name__}: {exc})"}
        if len(responses) != len(requests):
            return {"error": f"execute() returned {len(responses)} responses for {len(requests)} requests"}
        return {"responses": [_encode_checked(pb, r) for r in responses]}

    def _execute_decoupled(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Responses go to the worker as the model sends them (`send` frames, in order, before this
        call's reply when sent from execute()); execute() itself returns None."""
        pb = self.pb
        keys = [r["k"] for r in msg["requests"]]
        senders = [pb.InferenceResponseSender(on_send=functools.partial(self._sent, key)) for key in keys]
        with self._senders_lock:
            self._senders.update(zip(keys, senders, strict=True))
        try:
            result = self._call(self.model.execute, self._requests(msg, senders))
        except Exception as exc:  # every request not complete yet gets the error as its final response
            self._fail_open(senders, f"{type(exc).__name__}: {exc}")
            return {"decoupled": True, "trace": traceback.format_exc()}
        if result is not None:  # as Triton: an error for every request not complete yet
            message = (f"Python model '{self.model_name}' is using the decoupled mode and the execute function "
                       f"must return None.")
            self._fail_open(senders, message)
            return {"decoupled": True, "warning": message}
        return {"decoupled": True}

    def _fail_open(self, senders: list[Any], message: str) -> None:
        """`message` as the final response of each request whose sender is still open."""
        pb = self.pb
        error = pb.TritonError(message)
        for sender in senders:
            try:
                if not sender.closed:
                    sender.send(pb.InferenceResponse(error=error), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except pb.TritonModelException:  # closed meanwhile by one of the model's own threads
                pass

    def _sent(self, key: str, response: Any, flags: int) -> None:
        frame: dict[str, Any] = {"op": "send", "k": key, "f": int(flags)}
        if response is not None:
            frame["r"] = _encode_checked(self.pb, response)
        if flags & self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            with self._senders_lock:
                self._senders.pop(key, None)
        self.channel.send(frame)

    def cancel(self, keys: list[str]) -> None:
        """The callers of these requests went away: `request.is_cancelled()` turns true."""
        with self._senders_lock:
            senders = [self._senders[k] for k in keys if k in self._senders]
        for sender in senders:
            sender._cancel()

    def _from_sender(self, request: Any) -> Any:
        sent = [resp for resp, _flags in request.get_response_sender().sent if resp is not None]
        if len(sent) != 1:
            return self.pb.InferenceResponse(
                error=self.pb.TritonError(f"expected a single response, got {len(sent)}"))
        return sent[0]

    def reply(self, frame: dict[str, Any]) -> None:
        """Send a reply to init/execute/finalize, with the model's metrics if they changed (a model that
        defines none pays one integer comparison)."""
        with self._metrics_lock:
            snapshot = self._metrics_update()
            if snapshot is not None:
                frame["m"] = snapshot
            flushes = self.pb is not None and bool(self.pb._metric_families)
            # The worker reads a reply on the thread that made the call for as long as this stub writes
            # nothing between calls; it must hear when it may: once the flusher below runs, and once the
            # model has threads of its own (they may make BLS calls at any time).
            if flushes or self._model_threads():
                frame["between"] = True
            self.channel.send(frame)
        if self._flusher is None and flushes:
            self._flusher = threading.Thread(target=self._flush_metrics, name="stub-metrics", daemon=True)
            self._flusher.start()

    def _model_threads(self) -> bool:
        """Whether the model runs threads of its own (any beyond this one, the channel's reader and the
        metrics flusher)."""
        own = self._own_threads + self.channel.reading + (self._flusher is not None)
        return threading.active_count() > own

    def _metrics_update(self) -> list[Any] | None:
        pb = self.pb
        if pb is None or pb._metric_changes() == self._metrics_reported:
            return None
        self._metrics_reported = pb._metric_changes()
        return list(pb._metric_snapshot())

    def _flush_metrics(self) -> None:
        """Changes made outside a call (a model's own threads, a decoupled model's sends after execute()
        returned) reach the worker within METRICS_FLUSH_S."""
        while True:
            time.sleep(METRICS_FLUSH_S)
            try:
                with self._metrics_lock:
                    snapshot = self._metrics_update()
                    if snapshot is not None:
                        self.channel.send({"op": "metrics", "m": snapshot})
            except (PipeClosed, OSError, ValueError):
                return

    def finalize(self) -> None:
        """The model's finalize(), once: one that raised is not run again when the pipe then closes."""
        model, self.model = self.model, None
        if model is not None and hasattr(model, "finalize"):
            self._call(model.finalize)


def _drop_pipes(fds: tuple[int, ...]) -> None:
    """In a process the model forks (multiprocessing's default on Linux): the worker sees this stub die by its
    pipe's end, which a child holding the write end would keep open for as long as it lives; the worker's
    calls are this stub's alone. /dev/null in their place, so the child's copies of the files stay valid."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)


def main(argv: list[str]) -> int:
    # Armed after exec, not in a preexec_fn (unsafe in the threaded worker); the PID check covers a
    # worker that died before this line.
    die_with_parent(signal.SIGKILL, int(argv[3]))
    # The worker decides when this instance stops (finalize or closing the pipe), not a terminal's Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Buffered reading, a pipe's capacity at a time: a frame's length and body in one read of the pipe, not
    # one each (only this process reads it, one thread at a time, so nothing it buffers is anyone else's).
    channel = StubChannel(os.fdopen(int(argv[1]), "rb", buffering=PIPE_READ_BUFFER), os.fdopen(int(argv[2]), "wb"))
    os.register_at_fork(after_in_child=functools.partial(_drop_pipes, (int(argv[1]), int(argv[2]))))
    stub = Stub(channel)
    while True:
        msg = channel.next_op()
        if msg is None:
            stub.finalize()
            return 0
        op = msg.get("op")
        try:
            if op == "init":
                stub.init(msg)
                stub.reply({"ok": True})
            elif op == "execute":
                stub.reply(stub.execute(msg))
            elif op == "finalize":
                stub.finalize()
                stub.reply({"ok": True})
                return 0
            else:
                stub.reply({"error": f"unknown op {op!r}"})
        except PipeClosed:
            return 0
        except Exception as exc:
            stub.reply({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
