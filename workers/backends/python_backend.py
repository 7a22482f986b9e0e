"""`python`: Triton's Python backend. Each instance is a stub subprocess (workers/backends/python_stub)
fed over a pipe with length-prefixed msgpack frames carrying raw tensor bytes.

The stub hop costs one pipe round trip per batch (not per request). While nothing about a call needs a
thread, the worker's event loop makes it itself (`start_on_loop`: it writes the call and the reply wakes
it); the rest of a call that does (a BLS call on the way, an error reply, a stub gone) is finished on the
instance's thread with `execute`'s recovery.

A model is contained, never the worker's problem: a stub that dies is restarted. When a call fails as a
whole (the stub died, execute() raised or returned the wrong number of responses) for a batch of several
requests, each request is run again alone, so only the one at fault gets the error. A request that kills
the stub each time it runs alone is tried `max_deliveries` times, then answered with PoisonRequest (the
loop dead-letters it).

Batch inputs (config `batch_input`, ragged batching): execute() gets a list of separate requests, each
with its own tensors, as in Triton; each request also carries its part of every batch input tensor,
computed over the requests of this call (workers.backends.base.batch_tensors: e.g. for
BATCH_ACCUMULATED_ELEMENT_COUNT, request i's tensor is [end offset of its elements]), read with
`pb_utils.get_input_tensor_by_name(request, target_name)`. Concatenating the parts over `requests` gives
the tensor a framework backend receives. (Triton's own Python backend creates no batch inputs at all.)

Stubs die with their worker: each is started from one spawner thread that lives as long as the worker
process and arms the kernel's parent-death signal (SIGKILL) first thing, so a worker killed with
SIGKILL leaves no stub behind, even one busy in execute() (an idle one would also see its pipe close).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from fleet.envelope import WireTensor
from fleet.errors import ConfigError, InferenceFailed, PoisonRequest, ServingError, from_code
from fleet.logs import current_log_settings, process_log_format
from workers.backends.base import InferenceItem, ItemResult, LoadContext, batch_tensors
from workers.backends.decoupled import DecoupledCall
from workers.backends.frames import LENGTH, PipeClosed, pack
from workers.backends.stub_frames import StubFrames
from workers.backends.stub_pipe import READ as _READ
from workers.backends.stub_pipe import StubPipe
from workers.backends.stub_process import call_or_kill, exit_status
from workers.backends.stub_process import spawn as _spawn

log = logging.getLogger(__name__)

_stub_numbers = itertools.count(1)
# How long an unload waits for the model's finalize() before killing its stub (Triton's Python backend waits
# its stub-timeout-seconds, 30 by default): a finalize() that never returns must not hold the unload for ever.
FINALIZE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class _CallFailed:
    """A call that failed as a whole: `crashed` if the stub died (or could not be reached)."""

    error: InferenceFailed
    crashed: bool


class PythonBackend:
    takes_wire: ClassVar[bool] = True  # the stub gets the envelope's tensor bytes as they are
    interruptible: ClassVar[bool] = True  # kill() ends a hung execute(): the stub is a process
    host_bound = True  # the stub computes on the host's CPU, unless its model moves work to a GPU (unknown here)
    runs_inline = False  # the stub computes; the loop makes the call itself where it can (start_on_loop)

    def __init__(self, ctx: LoadContext) -> None:
        self._ctx = ctx
        self._model_py = ctx.model_dir / str(ctx.version) / ctx.spec.default_model_filename
        if not self._model_py.exists():
            raise ConfigError(f"{ctx.spec.name}: {self._model_py} is missing")
        self._proc: subprocess.Popen[bytes] | None = None
        # A restart that failed (initialize() raising now): not alive until a start works. A restart in
        # progress (no process for the moment between the old one's end and the new one's spawn) is alive.
        self._failed = False
        # This instance's own link in BLS chains (what it runs now waits for the models it calls).
        self._link = f"{ctx.spec.name}:{ctx.version}"
        self._frames = StubFrames(ctx, self._link)
        # What request.requested_output_names() lists where the client named none: as in Triton, every
        # output of the config (a std::set there, so in name order).
        self._all_outputs = sorted(o.name for o in ctx.spec.outputs)
        self._start()

    def _start(self) -> None:
        ctx = self._ctx
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self._proc = _spawn(
            [sys.executable, "-m", "workers.backends.python_stub", str(to_child_r), str(from_child_w),
             str(os.getpid())],
            (to_child_r, from_child_w),
        )
        os.close(to_child_r)
        os.close(from_child_w)
        # This stub process's name among the worker's reporters of custom metrics (a restart is another).
        stub = f"{ctx.instance_name}:v{ctx.version}:{next(_stub_numbers)}"
        self._pipe = StubPipe(os.fdopen(from_child_r, "rb", buffering=0), os.fdopen(to_child_w, "wb"),
                              f"{ctx.instance_name}-reader", functools.partial(self._frames.handled, stub),
                              functools.partial(self._frames.gone, stub), reader=ctx.spec.decoupled)
        args = {
            "model_config": json.dumps(ctx.spec.to_json()),
            "model_instance_kind": "GPU" if ctx.device.startswith("cuda") else "CPU",
            "model_instance_name": ctx.instance_name,
            "model_instance_device_id": ctx.device.split(":")[1] if ":" in ctx.device else "0",
            "model_repository": str(ctx.model_dir),
            "model_version": str(ctx.version),
            "model_name": ctx.spec.name,
        }
        try:
            reply = self._roundtrip({"op": "init", "model_py": str(self._model_py), "args": args,
                                     "decoupled": ctx.spec.decoupled,
                                     "log": [process_log_format(), current_log_settings().log_verbose_level]})
        except InferenceFailed as exc:  # the stub died while importing or initializing the model
            self.close()
            raise ConfigError(f"{ctx.spec.name}: initialize() failed: {exc}") from exc
        if "error" in reply:
            self.close()
            raise ConfigError(f"{ctx.spec.name}: initialize() failed: {reply['error']}")
        self._failed = False

    def _roundtrip(self, message: dict[str, Any]) -> Any:
        return self._reply(self._send(pack(message)))

    def _send(self, payload: bytes) -> Any:
        """Write a call (`pack`ed); what `_reply` starts from: the reply still to read, or the error that
        stopped the write."""
        try:
            self._pipe.write(payload)
        except (OSError, ValueError) as exc:  # ValueError: a pipe closed on our side
            return exc
        return _READ

    def _reply(self, first: Any) -> Any:
        """The reply to the call written last (`first`: StubPipe.reply's); InferenceFailed if the stub is gone."""
        try:
            return self._pipe.reply(first)
        except (PipeClosed, OSError, ValueError) as exc:
            raise InferenceFailed(f"the Python model instance {self._ctx.instance_name} stopped: "
                                  f"{exit_status(self._proc)}") from exc

    def cancel_requests(self, keys: list[str]) -> None:
        """The callers of these requests went away: a decoupled model sees request.is_cancelled()."""
        if self._frames.decoupled is None or self._proc is None:
            return
        self._pipe.send({"op": "cancel", "keys": keys})

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return self._recover(items, self._call(items))

    def loop_ready(self, nbytes: int) -> bool:
        """Whether the event loop may make the next call itself (start_on_loop), for `nbytes` of tensors:
        the stub runs (not being started by a revive on the instance's thread), no thread reads its pipe,
        the tensors fit the pipe, and nothing about the call needs a thread (a decoupled model's
        responses, batch inputs)."""
        spec = self._ctx.spec
        return (self._proc is not None and not self._failed and self._pipe.inline and nbytes < self._pipe.capacity
                and not spec.decoupled and not spec.batch_inputs)

    def start_on_loop(self, items: list[InferenceItem], loop: asyncio.AbstractEventLoop,
                      on_results: Callable[[list[ItemResult] | Callable[[], list[ItemResult]]], None]) -> bool:
        """Write an execute call for `items` from the event loop (only when `loop_ready`) and read its reply
        there: `on_results` gets the results on the loop, for a plain reply. For anything else (a BLS call
        or metrics on the way, an error reply, a stub gone) it gets a callable instead, which finishes the
        call on the instance's thread with `execute`'s recovery (a restart, requests run alone). False,
        nothing written: the call is larger than the pipe takes without the stub reading (the loop never
        waits for it)."""
        call, frame = self._begin(items)
        payload = pack(frame)
        if LENGTH.size + len(payload) > self._pipe.capacity:
            return False

        def on_frame(first: Any) -> None:
            if isinstance(first, dict) and first.keys() == {"responses"}:
                try:
                    results = [self._result(r) for r in first["responses"]]
                except Exception:  # a malformed reply: the thread's way reports it, as it would its own
                    pass
                else:
                    on_results(results)
                    return
            on_results(functools.partial(self._rest, items, call, first))

        sent = self._send(payload)  # it fits the pipe: the loop never waits for the stub to read it
        if sent is _READ:
            self._pipe.read_on_loop(loop, on_frame)
        else:
            loop.call_soon(on_results, functools.partial(self._rest, items, call, sent))
        return True

    def _rest(self, items: list[InferenceItem], call: DecoupledCall | None, first: Any) -> list[ItemResult]:
        """On the instance's thread: a call started from the loop, from its first frame (or error) on."""
        return self._recover(items, self._end(call, first))

    def _recover(self, items: list[InferenceItem], outcome: list[ItemResult] | _CallFailed) -> list[ItemResult]:
        if not isinstance(outcome, _CallFailed):
            return outcome
        if self._ctx.spec.decoupled:  # responses may have gone out already: never run a request again
            return [ItemResult(error=outcome.error) for _ in items]
        if len(items) == 1:
            return [self._alone(items[0], outcome)]
        # Which request was at fault is unknown: run each alone, so only that one gets the error.
        log.warning("%s: a batch of %d failed as a whole (%s); running its requests one at a time",
                    self._ctx.instance_name, len(items), outcome.error)
        return [self._alone(item, None) for item in items]

    def _alone(self, item: InferenceItem, first: _CallFailed | None) -> ItemResult:
        """One request on its own; one that crashes the stub is tried up to max_deliveries times."""
        attempts = max(1, self._ctx.max_deliveries)
        outcome = first if first is not None else self._call([item])
        for attempt in range(1, attempts + 1):
            if not isinstance(outcome, _CallFailed):
                return outcome[0]
            if not outcome.crashed:
                return ItemResult(error=outcome.error)
            log.warning("%s: request %r crashed the instance when run alone (attempt %d of %d)",
                        self._ctx.instance_name, item.request_id or "(no id)", attempt, attempts)
            if attempt < attempts:
                outcome = self._call([item])
        assert isinstance(outcome, _CallFailed)
        return ItemResult(error=PoisonRequest(attempts, outcome.error.message))

    def _call(self, items: list[InferenceItem]) -> list[ItemResult] | _CallFailed:
        """One execute() in the stub: a result per request, or why the call failed as a whole."""
        if self._proc is None:  # an earlier restart failed: try again before giving up on this call
            try:
                self._start()
            except Exception as exc:
                return _CallFailed(InferenceFailed(f"the Python model instance {self._ctx.instance_name} "
                                                   f"cannot be started: {exc}"), crashed=False)
        try:
            call, frame = self._begin(items)
        except ServingError as exc:
            return _CallFailed(InferenceFailed(exc.message), crashed=False)
        return self._end(call, self._send(pack(frame)))

    def _begin(self, items: list[InferenceItem]) -> tuple[DecoupledCall | None, dict[str, Any]]:
        """The execute frame for `items`, and a decoupled model's call that gathers its responses (raises
        ServingError for batch inputs that cannot be computed)."""
        extra = self._batch_inputs(items)
        requests = []
        for item, more in zip(items, extra, strict=True):
            request: dict[str, Any] = {
                "id": item.request_id, "i": [[t.name, t.datatype, list(t.shape), t.data] for t in item.wire] + more,
                "o": self._all_outputs if item.requested_outputs is None else item.requested_outputs,
                "p": item.parameters, "k": item.key}
            if item.flags or item.correlation_id:  # a sequence's request (sequence batching)
                request["c"], request["f"] = item.correlation_id, item.flags
            requests.append(request)
        # BLS calls made while this runs wait on behalf of every request of the call: their chain is the
        # longest of the requests' (its length is the depth), then any other model waiting, then this one.
        longest = max((item.bls_chain for item in items), key=len, default=[])
        others = sorted({link for item in items for link in item.bls_chain} - set(longest))
        self._frames.chain = [*longest, *others, self._link]
        call = None
        if self._ctx.spec.decoupled:
            emit = self._ctx.emit
            assert emit is not None, "a decoupled model is loaded with somewhere to write its responses"
            call = self._frames.decoupled = DecoupledCall(items, emit)
        return call, {"op": "execute", "requests": requests}

    def _end(self, call: DecoupledCall | None, first: Any) -> list[ItemResult] | _CallFailed:
        """The rest of a call whose frame was written: its reply read (from `first`, StubPipe.reply's)."""
        try:
            reply = self._reply(first)
            # A decoupled call is complete once every request has its final flag (unless the stub could
            # not even run execute(): then no flag comes).
            if call is not None and "error" not in reply and not call.wait():
                raise InferenceFailed(f"the Python model instance {self._ctx.instance_name} stopped: "
                                      f"{exit_status(self._proc)}")
        except InferenceFailed as exc:
            log.error("%s; restarting it", exc)
            self._frames.decoupled = None
            self._restart()
            return _CallFailed(exc, crashed=True)
        self._frames.decoupled = None
        if call is not None:
            if reply.get("trace"):
                log.warning("%s execute() raised:\n%s", self._ctx.instance_name, reply["trace"])
            elif reply.get("warning"):
                log.warning("%s: %s", self._ctx.instance_name, reply["warning"])
            # The stub could not run the call (its reply an error, no final flags): the requests not
            # complete fail with it, not end as empty successes.
            failed = InferenceFailed(reply["error"]) if "error" in reply else None
            return call.results(self._result, failed)
        if "error" in reply:
            if reply.get("trace"):
                log.warning("%s execute() raised:\n%s", self._ctx.instance_name, reply["trace"])
            return _CallFailed(InferenceFailed(reply["error"]), crashed=False)
        return [self._result(r) for r in reply["responses"]]

    def _batch_inputs(self, items: list[InferenceItem]) -> list[list[list[Any]]]:
        """Each request's parts of the config's batch inputs, as wire tensors (computed from shapes only)."""
        spec = self._ctx.spec
        if not spec.batch_inputs:
            return [[] for _ in items]
        parts = batch_tensors(spec, [{t.name: t.shape for t in item.wire} for item in items])
        by_name = {b.target_name: b.datatype for b in spec.batch_inputs}
        return [[[name, by_name[name].name, list(arr.shape), arr.astype(by_name[name].numpy).tobytes()]
                 for name, arr in part.items()] for part in parts]

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
            self._proc = None  # the next call tries again
            self._failed = True

    @property
    def context(self) -> LoadContext:
        """How this instance was loaded (BLS starts nested instances of a model from it)."""
        return self._ctx

    @property
    def alive(self) -> bool:
        """False after a restart failed: the worker stops advertising the model until revive() works (or a
        call's own start does). A restart after a crash is alive while it runs: the requests meanwhile
        wait for it, as they would behind a long batch, rather than find the model unadvertised."""
        return not self._failed

    def revive(self) -> bool:
        """Start the stub again if it is not running (on the instance's own thread); whether it runs."""
        if self._proc is None:
            try:
                self._start()
            except Exception as exc:
                log.warning("%s still cannot be started: %s", self._ctx.instance_name, exc)
                self._proc = None
        return self._proc is not None

    def kill(self) -> None:
        """The watchdog's way out of a hung execute(): SIGKILL the stub. The call in flight then fails
        as a crash (and is retried alone, up to max_deliveries); the instance restarts. Thread-safe."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _finalize_call(self) -> None:
        try:
            self._roundtrip({"op": "finalize"})
        except InferenceFailed:
            pass  # the stub is gone already

    def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            call_or_kill(self._finalize_call, proc, FINALIZE_TIMEOUT_S,
                         f"{self._ctx.instance_name}: finalize()")
        self._pipe.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._frames.close()
        self._proc = None
