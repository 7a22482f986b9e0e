"""A gateway's tracer (gateway/tracer.py): Triton's sampling (rate, count), the trace records, and the
trace file's layout (rolling FILE.i with log_frequency, one growing array without)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fleet.envelope import ReplyEnvelope, WireTensor
from fleet.redis_time import RedisClock
from fleet.trace_points import HTTP_RECV_START, HTTP_SEND_END, ORDER, QUEUE_START, WORKER_READ
from fleet.trace_settings import GLOBAL, TraceState, model_scope, parse_trace_update
from gateway.tracer import Trace, Tracer


def tracer_with(tmp_path: Path, scopes: dict[str, dict[str, object]]) -> Tracer:
    tracer = Tracer(tmp_path / "trace.json", RedisClock())
    state = TraceState()
    for scope, doc in scopes.items():
        state = state.updated(scope, parse_trace_update(doc, str(tracer.file.path)))
    tracer.apply(state)
    return tracer


def run(tracer: Tracer, model: str, n: int) -> list[Trace]:
    traces = []
    for _ in range(n):
        trace = tracer.sample(model, HTTP_RECV_START) if tracer.active else None
        if trace is not None:
            trace.stamp(HTTP_SEND_END)
            trace.finish()
            traces.append(trace)
    return traces


def test_off_by_default_so_untraced_requests_pay_one_attribute_read(tmp_path: Path) -> None:
    tracer = tracer_with(tmp_path, {})
    assert not tracer.active
    assert tracer.response(None)["trace_level"] == ["OFF"]


def test_every_rate_th_request_is_traced_until_the_count_runs_out(tmp_path: Path) -> None:
    tracer = tracer_with(tmp_path, {GLOBAL: {"trace_level": ["TIMESTAMPS"], "trace_rate": "3", "trace_count": "2"}})
    traces = run(tracer, "m", 20)
    assert [t.id for t in traces] == [1, 2]
    assert not tracer.active  # nothing more to trace: back to the one check
    assert tracer.response(None)["trace_count"] == "0"
    # All `count` traces collected: written at once to FILE.0, as Triton does.
    records = json.loads((tmp_path / "trace.json.0").read_text())
    assert [r["id"] for r in records] == [1, 2]
    assert [ts["name"] for ts in records[0]["timestamps"]] == [HTTP_RECV_START, HTTP_SEND_END]


def test_a_models_own_setting_samples_apart_from_the_global_one(tmp_path: Path) -> None:
    tracer = tracer_with(tmp_path, {GLOBAL: {"trace_level": ["TIMESTAMPS"], "trace_rate": "1000"},
                                    model_scope("m"): {"trace_rate": "1", "log_frequency": "1"}})
    assert len(run(tracer, "m", 3)) == 3
    assert run(tracer, "other", 3) == []
    assert tracer.response("m")["trace_rate"] == "1" and tracer.response("other")["trace_rate"] == "1000"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json.0", "trace.json.1", "trace.json.2"]


def test_log_frequency_zero_keeps_one_valid_array_growing(tmp_path: Path) -> None:
    tracer = tracer_with(tmp_path, {GLOBAL: {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}})
    run(tracer, "m", 2)
    tracer.apply(tracer.state.updated(GLOBAL, parse_trace_update({"trace_rate": "1"}, str(tracer.file.path))))
    run(tracer, "m", 1)  # a renewed setting: the old one's traces were written when it was replaced
    tracer.close()
    records = json.loads((tmp_path / "trace.json").read_text())
    assert [r["id"] for r in records] == [1, 2, 3]


def test_a_trace_record_lists_its_hops_in_order_with_the_workers_stamps(tmp_path: Path) -> None:
    tracer = tracer_with(tmp_path, {GLOBAL: {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "1",
                                             "log_frequency": "1"}})
    trace = tracer.sample("m", HTTP_RECV_START)
    assert trace is not None
    data = np.arange(4, dtype=np.float32).tobytes()
    trace.request(3, "req-7", [WireTensor("IN", "FP32", (1, 4), data)])
    trace.stamp(QUEUE_START)
    start = trace.stamps[HTTP_RECV_START]
    trace.reply(ReplyEnvelope(id="x", outputs=[WireTensor("OUT", "BYTES", (1,), b"\x02\x00\x00\x00hi")],
                              trace={WORKER_READ: start + 5, QUEUE_START: trace.stamps[QUEUE_START]}))
    trace.finish()
    head, tin, tout = json.loads((tmp_path / "trace.json.0").read_text())
    assert head["model_name"] == "m" and head["model_version"] == 3 and head["request_id"] == "req-7"
    names = [ts["name"] for ts in head["timestamps"]]
    assert names == [n for n in ORDER if n in names] and WORKER_READ in names
    assert tin == {"id": trace.id, "activity": "TENSOR_QUEUE_INPUT",
                   "tensor": {"name": "IN", "data": "0.0,1.0,2.0,3.0", "shape": "1,4", "dtype": "FP32"}}
    assert tout["activity"] == "TENSOR_BACKEND_OUTPUT" and tout["tensor"]["data"] == '"hi"'
