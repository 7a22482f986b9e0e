"""fleet/status_snapshot.py and fleet/status_build.py: the status snapshot built from plain readings,
throughput between two snapshots and the per-process window, and the JSON round trip. No I/O, no clock."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.status_build import (
    ModelReading,
    Reading,
    StreamReading,
    build_snapshot,
    counters_of,
    lane_name,
    worker_status,
)
from fleet.status_snapshot import (
    Counters,
    JobStatus,
    LaneDepth,
    ModelStatus,
    Rate,
    RateWindow,
    Snapshot,
    WorkerStatus,
    WorkerUnit,
    from_json,
    rate_between,
    to_json,
    with_rates,
)

NOW_MS = 1_800_000_000_000
TTL_MS = 5_000


def beat(**fields: object) -> dict[str, str]:
    base: dict[str, object] = {"id": "w1", "device": "cpu", "pid": "4242", "host": "box", "at_ms": NOW_MS - 300,
                               "models": [["mlp", 1, "g"]], "units": [["mlp", 1, "g", "READY"]], "failed": {},
                               "queued": {}}
    base.update(fields)
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in base.items()}


def model(name: str = "mlp", **counters: int) -> ModelStatus:
    return ModelStatus(name, (1,), (1,), counters=Counters(**counters))


# ---------------------------------------------------------------- workers


def test_a_serving_worker_is_ready_with_its_models_host_and_heartbeat_age() -> None:
    w = worker_status("w1", beat(queued={"mlp": {"1": 3, "2": 1}}), NOW_MS + 4_000, NOW_MS, TTL_MS)
    assert w == WorkerStatus("w1", "box", 4242, "cpu", "ready", 0.3, (WorkerUnit("mlp", 1, "READY"),), queued=4)


@pytest.mark.parametrize(("units", "models", "state"), [
    ([["mlp", 1, "g", "LOADING"]], [], "loading"),
    ([["mlp", 1, "g", "READY"]], [], "unhealthy"),  # loaded, not advertised: its loop is not healthy
    ([], [], "idle"),
    ([["mlp", 1, "g", "READY"], ["big", 1, "g", "LOADING"]], [["mlp", 1, "g"]], "loading"),
])
def test_worker_state_follows_its_units(units: list[list[object]], models: list[list[object]], state: str) -> None:
    assert worker_status("w1", beat(units=units, models=models), NOW_MS, NOW_MS, TTL_MS).state == state


def test_a_unit_loaded_but_not_advertised_is_unavailable() -> None:
    w = worker_status("w1", beat(models=[]), NOW_MS, NOW_MS, TTL_MS)
    assert w.units == (WorkerUnit("mlp", 1, "UNAVAILABLE"),)


def test_a_registered_worker_without_heartbeat_is_gone_and_dated_by_its_expiry() -> None:
    w = worker_status("w9", None, NOW_MS - 2_000, NOW_MS, TTL_MS)
    assert (w.state, w.heartbeat_age_s, w.units) == ("gone", 7.0, ())


def test_a_heartbeat_without_its_time_is_dated_by_the_registry() -> None:
    b = beat()
    del b["at_ms"]
    assert worker_status("w1", b, NOW_MS + 4_000, NOW_MS, TTL_MS).heartbeat_age_s == 1.0


def test_a_damaged_heartbeat_field_costs_only_that_field() -> None:
    w = worker_status("w1", beat(units="not json", failed={"big": "no GPU"}), NOW_MS, NOW_MS, TTL_MS)
    assert (w.units, w.failed, w.pid, w.state) == ((), ("big",), 4242, "idle")


# ---------------------------------------------------------------- models


@pytest.mark.parametrize(("lanes", "names"), [(2, ["online", "bulk"]), (4, ["p1", "p2", "p3", "bulk"])])
def test_lane_names(lanes: int, names: list[str]) -> None:
    assert [lane_name(i, lanes) for i in range(lanes)] == names


def test_counters_sum_over_versions_and_ignore_other_fields() -> None:
    stats = {"1:success:count": 5, "2:success:count": 2, "1:fail:count": 3, "1:rejected:count": 1,
             "1:inference_count": 12, "1:execution_count": 4, "2:inference_count": 2, "2:execution_count": 2,
             "1:success:ns": 7_000_000, "1:queue:ns": 99, "1:batch:4:count": 3, "cache:hits": 8}
    c = counters_of(stats)
    assert c == Counters(success=7, failed=3, rejected=1, inferences=14, executions=6, success_ns=7_000_000)
    assert c.mean_batch_size == pytest.approx(14 / 6)
    assert c.mean_latency_ms == pytest.approx(1.0)


def test_no_batch_no_mean() -> None:
    assert (Counters().mean_batch_size, Counters().mean_latency_ms) == (None, None)


def test_lanes_waiting_in_flight_and_held_from_streams_and_heartbeats() -> None:
    streams = (StreamReading(1, 0, length=5, delivered=2), StreamReading(1, 1, length=1, delivered=0),
               StreamReading(2, 0, length=4, delivered=4), StreamReading(2, 1, length=0, delivered=0))
    reading = Reading(NOW_MS, TTL_MS, {"w1": NOW_MS + 1, "w2": NOW_MS + 1},
                      {"w1": beat(queued={"mlp": {"1": 2}}), "w2": beat(id="w2", queued={"mlp": {"2": 3}})},
                      [ModelReading("mlp", (1, 2), (1, 2), 2, streams=streams, dead_letters=4,
                                    stats={"1:success:count": 9})])
    (m,) = build_snapshot(reading).models
    assert m.lanes == (LaneDepth("online", 3), LaneDepth("bulk", 1))
    assert (m.waiting, m.in_flight, m.held, m.dead_letters, m.counters.success) == (4, 6, 5, 4, 9)


def test_a_model_without_config_has_no_lanes_and_says_why() -> None:
    (m,) = build_snapshot(Reading(NOW_MS, TTL_MS, {}, {}, [ModelReading("big", (), (), 0, reason="unloaded")])).models
    assert (m.lanes, m.ready, m.reason, m.waiting) == ((), False, "unloaded", 0)


def test_the_snapshot_sorts_workers_and_models_and_keeps_gone_workers_and_jobs() -> None:
    jobs = [{"id": "j2", "model": "mlp", "state": "running", "done": 5, "total": 10, "failed": 1, "throughput": 2.5},
            {"id": "j1", "model": "mlp", "state": "queued", "done": 0, "total": None, "failed": 0, "throughput": 0.0}]
    snap = build_snapshot(Reading(NOW_MS, TTL_MS, {"w2": NOW_MS + 1, "w1": NOW_MS - 10},
                                  {"w2": beat(id="w2")}, [ModelReading("zz", (1,), (1,), 2),
                                                          ModelReading("aa", (1,), (), 2, reason="no worker")], jobs))
    assert [(w.id, w.state) for w in snap.workers] == [("w1", "gone"), ("w2", "ready")]
    assert [m.name for m in snap.models] == ["aa", "zz"]
    assert snap.jobs == (JobStatus("j2", "mlp", "running", 5, 10, 1, 2.5),
                         JobStatus("j1", "mlp", "queued", 0, None, 0, 0.0))
    assert snap.at_ms == NOW_MS and snap.window_s is None


# ---------------------------------------------------------------- throughput


def test_rate_between_two_readings() -> None:
    rate = rate_between(Counters(success=10, inferences=40, executions=10),
                        Counters(success=30, inferences=100, executions=20), 2.0)
    assert rate == Rate(requests_per_s=10.0, inferences_per_s=30.0, batch_size=6.0)


def test_no_batch_in_the_window_means_no_batch_size() -> None:
    assert rate_between(Counters(success=3), Counters(success=3), 1.0) == Rate(0.0, 0.0, None)


@pytest.mark.parametrize(("after", "elapsed_s"), [(Counters(success=1), 1.0),  # counters went down: flushed
                                                  (Counters(success=9, inferences=9, executions=9), 0.0)])
def test_an_unknowable_rate_is_none(after: Counters, elapsed_s: float) -> None:
    assert rate_between(Counters(success=5, inferences=5, executions=5), after, elapsed_s) is None


def test_with_rates_sets_each_models_rate_and_the_window() -> None:
    before = Snapshot(0, models=(model("a", success=1),))
    after = Snapshot(1000, models=(model("a", success=5), model("new", success=100)))
    out = with_rates(before, after, 2.0)
    assert out.window_s == 2.0
    assert [m.rate for m in out.models] == [Rate(2.0, 0.0, None), None]  # a model new in the window: unknown
    assert out.rate_total() == Rate(2.0, 0.0, None)


def test_the_window_measures_against_the_newest_sample_at_least_min_s_old() -> None:
    window = RateWindow(min_s=1.0, max_s=10.0)
    snaps = {t: Snapshot(int(t * 1000), models=(model(success=int(t * 10)),)) for t in (0.0, 0.5, 1.5, 2.0)}
    assert window.observe(snaps[0.0], 0.0).window_s is None  # nothing to measure against yet
    assert window.observe(snaps[0.5], 0.5).window_s is None  # too short a window: not measured
    out = window.observe(snaps[1.5], 1.5)
    assert out.window_s == 1.0 and out.models[0].rate == Rate(10.0, 0.0, None)  # against 0.5, exactly 1 s old
    assert window.observe(snaps[2.0], 2.0).window_s == 1.5  # against 0.5, the newest a second old


def test_after_a_quiet_spell_the_first_rate_is_unknown() -> None:
    window = RateWindow(min_s=1.0, max_s=10.0)
    window.observe(Snapshot(0, models=(model(success=0),)), 0.0)
    assert window.observe(Snapshot(0, models=(model(success=500),)), 100.0).window_s is None
    assert window.observe(Snapshot(0, models=(model(success=510),)), 102.0).models[0].rate == Rate(5.0, 0.0, None)


# ---------------------------------------------------------------- JSON

_text = st.text(min_size=1, max_size=8)
_count = st.integers(min_value=0, max_value=10**12)
_real = st.floats(min_value=0, max_value=1e6, allow_nan=False)
_snapshots = st.builds(
    Snapshot, at_ms=_count,
    workers=st.lists(st.builds(WorkerStatus, _text, _text, st.none() | _count, _text, _text, st.none() | _real,
                               st.lists(st.builds(WorkerUnit, _text, _count, _text)).map(tuple), _count,
                               st.lists(_text).map(tuple)), max_size=3).map(tuple),
    models=st.lists(st.builds(ModelStatus, _text, st.lists(_count).map(tuple), st.lists(_count).map(tuple), _text,
                              st.lists(st.builds(LaneDepth, _text, _count)).map(tuple), _count, _count, _count,
                              st.builds(Counters, _count, _count, _count, _count, _count, _count),
                              st.none() | st.builds(Rate, _real, _real, st.none() | _real)), max_size=3).map(tuple),
    jobs=st.lists(st.builds(JobStatus, _text, _text, _text, _count, st.none() | _count, _count, _real),
                  max_size=3).map(tuple),
    window_s=st.none() | _real)


@given(_snapshots)
def test_json_round_trip(snapshot: Snapshot) -> None:
    assert from_json(json.loads(json.dumps(to_json(snapshot)))) == snapshot


def test_the_json_spells_out_the_derived_figures() -> None:
    m = replace(model(success=4, inferences=12, executions=3, success_ns=8_000_000), lanes=(LaneDepth("online", 2),),
                rate=Rate(1.0, 2.0, 3.0))
    doc = to_json(Snapshot(NOW_MS, workers=(worker_status("w1", beat(), NOW_MS, NOW_MS, TTL_MS),), models=(m,)))
    assert {k: doc["models"][0][k] for k in ("ready", "waiting", "mean_batch_size", "mean_latency_ms")} == \
        {"ready": True, "waiting": 2, "mean_batch_size": 4.0, "mean_latency_ms": 2.0}
    assert doc["totals"] == {"workers": 1, "models_ready": 1, "models": 1,
                             "rate": {"requests_per_s": 1.0, "inferences_per_s": 2.0, "batch_size": None}}
