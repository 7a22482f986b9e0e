"""This gateway process's traces (Triton's trace extension, `trace_mode` "triton"): which requests are
traced, the timestamps each collects, and the JSON trace file they are written to.

Sampling follows Triton's TraceManager: one sampler per scope in force (the global setting, and each
model with a setting of its own); every `rate`-th request of a scope is traced while its `count` lasts
(-1: no end). Samplers, and so counts, are this process's: each gateway process samples its own requests
and writes its own file (Settings.trace_file), as one Triton server does.

Cost for requests not traced: `Tracer.active` is one attribute read on the infer path; nothing is added
to their envelopes. A traced request carries a timestamp map in its envelope, which the worker fills in
and sends back (fleet/trace_points.py names the hops); all stamps are ns on Redis's clock.

File (Triton's layout, one JSON array): with `log_frequency` N, every N traces go to FILE.0, FILE.1, ...;
with 0, traces are appended to FILE itself (kept a valid JSON array after each write, every
FLUSH_EVERY traces and when the setting changes or the gateway stops). Once `count` traces are all
collected they are written at once, to the next FILE.i, as Triton does. Each trace is one object:
`{"id", "model_name", "model_version", "request_id"?, "timestamps": [{"name", "ns"}, ...]}` (Triton's
trace_summary.py reads it), plus, at level TENSORS, Triton's `{"id", "activity", "tensor"}` objects.
Writes are small and rare (traced requests only) and happen on the event loop.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet import tensors
from fleet.envelope import ReplyEnvelope, WireTensor
from fleet.redis_time import RedisClock
from fleet.trace_points import ORDER
from fleet.trace_settings import DEFAULT, TraceSetting, TraceState

log = logging.getLogger(__name__)

FLUSH_EVERY = 100  # traces buffered at most before they are appended to FILE (log_frequency 0)


class TraceFile:
    """Where one gateway's traces go; write errors are logged, never raised into a request."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._index = 0
        self._appended = False  # FILE written by this process yet (the first write starts it afresh)

    def write_indexed(self, records: list[dict[str, Any]]) -> None:
        target = self.path.with_name(f"{self.path.name}.{self._index}")
        self._index += 1
        self._write(target, lambda f: f.write(_array(records)), "wb")

    def append(self, records: list[dict[str, Any]]) -> None:
        """Add to FILE's array, leaving it a valid JSON array after each write."""
        if not self._appended:
            self._appended = self._write(self.path, lambda f: f.write(_array(records)), "wb")
            return

        def extend(f: Any) -> None:
            f.seek(-1, 2)  # over the closing bracket
            f.write(b"," + _array(records)[1:])
        self._write(self.path, extend, "r+b")

    def _write(self, target: Path, body: Any, mode: str) -> bool:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, mode) as f:
                body(f)
            return True
        except OSError as exc:
            log.error("cannot write traces to %s: %s", target, exc)
            return False


def _array(records: list[dict[str, Any]]) -> bytes:
    return json.dumps(records, separators=(",", ":")).encode()


class _Sampler:
    """One scope's setting in force, with its counters (Triton's TraceSetting)."""

    def __init__(self, setting: TraceSetting, version: tuple[int, int], file: TraceFile) -> None:
        self.setting = setting
        self.version = version
        self.file = file
        self.remaining = setting.count
        self.seen = 0
        self.created = 0
        self.collected = 0
        self.buffer: list[dict[str, Any]] = []
        self.buffered = 0  # traces in the buffer
        self.closed = False

    @property
    def live(self) -> bool:
        return bool(self.setting.level) and self.setting.rate > 0 and self.remaining != 0 and not self.closed

    def take(self) -> bool:
        if not self.live:
            return False
        self.seen += 1
        if self.seen % self.setting.rate:
            return False
        if self.remaining > 0:
            self.remaining -= 1
        self.created += 1
        return True

    def collect(self, records: list[dict[str, Any]]) -> None:
        self.buffer.extend(records)
        self.buffered += 1
        self.collected += 1
        frequency = self.setting.log_frequency
        if self.closed or (self.remaining == 0 and self.collected >= self.created) \
                or (frequency and self.buffered >= frequency):
            self._flush(indexed=not self.closed or frequency > 0)
        elif not frequency and self.buffered >= FLUSH_EVERY:
            self._flush(indexed=False)

    def close(self) -> None:
        """Replaced (or the gateway stops): write what is buffered; traces still running are written
        as they finish."""
        self.closed = True
        if self.buffer:
            self._flush(indexed=self.setting.log_frequency > 0)

    def _flush(self, indexed: bool) -> None:
        records, self.buffer, self.buffered = self.buffer, [], 0
        if indexed:
            self.file.write_indexed(records)
        else:
            self.file.append(records)


@dataclass(slots=True)
class Trace:
    """One traced request: its timestamps (Redis's clock, ns) and, at level TENSORS, its tensors."""

    id: int
    model: str
    sampler: _Sampler
    tracer: Tracer
    version: int = -1
    request_id: str = ""
    stamps: dict[str, int] = field(default_factory=dict)
    inputs: list[WireTensor] = field(default_factory=list)
    outputs: list[WireTensor] = field(default_factory=list)

    def stamp(self, name: str) -> None:
        self.stamps[name] = self.tracer.clock.now_ns()

    def finish(self) -> None:
        """The request is answered (or its client gone): the trace goes to the file."""
        self.tracer.finish(self)

    def request(self, version: int, request_id: str, inputs: list[WireTensor]) -> None:
        """What the data plane knows once it has parsed the request."""
        self.version = version
        self.request_id = request_id
        if "TENSORS" in self.sampler.setting.level:
            self.inputs = inputs

    def reply(self, reply: ReplyEnvelope) -> None:
        """The worker's timestamps (and the outputs) its reply brought back."""
        if reply.trace:
            self.stamps.update(reply.trace)
        if "TENSORS" in self.sampler.setting.level and reply.outputs:
            self.outputs = reply.outputs

    def records(self) -> list[dict[str, Any]]:
        head: dict[str, Any] = {"id": self.id, "model_name": self.model, "model_version": self.version}
        if self.request_id:
            head["request_id"] = self.request_id
        if "TIMESTAMPS" in self.sampler.setting.level:
            head["timestamps"] = [{"name": n, "ns": self.stamps[n]} for n in ORDER if n in self.stamps]
        out = [head]
        out += [_tensor_record(self.id, "TENSOR_QUEUE_INPUT", t) for t in self.inputs]
        out += [_tensor_record(self.id, "TENSOR_BACKEND_OUTPUT", t) for t in self.outputs]
        return out


def _tensor_record(trace_id: int, activity: str, t: WireTensor) -> dict[str, Any]:
    """Triton's tensor activity: values comma-separated (BYTES elements quoted), shape as "1,16"."""
    try:
        values = tensors.from_bytes(t.data, tensors.lookup(t.datatype), t.shape).ravel().tolist()
        if t.datatype == "BYTES":
            data = ",".join('"' + bytes(v).decode("utf-8", "replace") + '"' for v in values)
        else:
            data = ",".join(str(v) for v in values)
    except Exception:  # a trace must never fail its request
        data = ""
    return {"id": trace_id, "activity": activity,
            "tensor": {"name": t.name, "data": data, "shape": ",".join(str(d) for d in t.shape), "dtype": t.datatype}}


class Tracer:
    """The trace settings in force in this process (applied from Redis) and their samplers."""

    def __init__(self, trace_file: Path, clock: RedisClock) -> None:
        self.file = TraceFile(trace_file)
        self.clock = clock
        self.active = False  # some scope may trace: the one check untraced requests pay
        self.state = TraceState()
        self._global = _Sampler(DEFAULT, self.state.version(None), self.file)
        self._models: dict[str, _Sampler] = {}
        self._ids = itertools.count(1)

    def sample(self, model: str, first: str) -> Trace | None:
        """A new trace for this request of `model` if its scope samples it, stamped `first` (e.g.
        HTTP_RECV_START); None otherwise. Call only while `active`."""
        sampler = self._models.get(model, self._global)
        if not sampler.take():
            if sampler.remaining == 0:
                self._refresh_active()
            return None
        trace = Trace(next(self._ids), model, sampler, self)
        trace.stamp(first)
        return trace

    def finish(self, trace: Trace) -> None:
        """The request is answered: its trace goes to the file (now, or with the next batch of traces)."""
        trace.sampler.collect(trace.records())
        if trace.sampler.remaining == 0:
            self._refresh_active()

    def apply(self, state: TraceState) -> None:
        """Take the settings Redis holds: a scope updated since (or whose values differ) samples afresh."""
        self.state = state
        self._global = self._renewed(self._global, state, None)
        models = set(state.models())
        for name in list(self._models):
            if name not in models:
                self._models.pop(name).close()
        for name in models:
            current = self._models.get(name)
            self._models[name] = self._renewed(current, state, name)
        self._refresh_active()

    def _renewed(self, current: _Sampler | None, state: TraceState, model: str | None) -> _Sampler:
        setting, version = state.effective(model), state.version(model)
        if current is not None and current.setting == setting and current.version == version:
            return current
        if current is not None:
            current.close()
        return _Sampler(setting, version, self.file)

    def response(self, model: str | None) -> dict[str, Any]:
        """The settings answer for `model` (None: global), with this process's remaining count."""
        sampler = self._models.get(model, self._global) if model is not None else self._global
        return sampler.setting.response(sampler.remaining, str(self.file.path))

    def close(self) -> None:
        """The gateway stops: write what is buffered."""
        self.active = False
        for sampler in [self._global, *self._models.values()]:
            sampler.close()

    def _refresh_active(self) -> None:
        self.active = self._global.live or any(s.live for s in self._models.values())
