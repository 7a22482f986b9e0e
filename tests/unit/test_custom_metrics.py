"""Python models' custom metrics: the wire form, combining stubs and workers, the Prometheus text
(fleet/custom_metrics.py), one worker's book (workers/custom_metrics.py), the gateway's fleet total
(gateway/custom_metrics.py) and what the pb_utils shim reports."""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet import custom_metrics as cm
from fleet.custom_metrics import Family, Kind, Series
from gateway.custom_metrics import fleet_total, names_in
from workers.custom_metrics import CustomMetricsBook

SHIM_DIR = Path(__file__).resolve().parents[2] / "workers" / "backends" / "python_shim"
if str(SHIM_DIR) not in sys.path:
    sys.path.insert(0, str(SHIM_DIR))

import triton_python_backend_utils as pb_utils

MV = (("model", "custom_metrics"), ("version", "1"))


def counter(name: str, value: float, labels: cm.Labels = MV, help_text: str = "h") -> Family:
    return Family(name, help_text, Kind.COUNTER, (Series(labels, value),))


def gauge(name: str, value: float, labels: cm.Labels = MV) -> Family:
    return Family(name, "g", Kind.GAUGE, (Series(labels, value),))


def histogram(name: str, counts: tuple[int, ...], total: float, bounds: tuple[float, ...] = (0.1, 1.0)) -> Family:
    return Family(name, "hist", Kind.HISTOGRAM, (Series(MV, bounds=bounds, counts=counts, sum=total,
                                                        count=sum(counts)),))


# --- wire form ----------------------------------------------------------------------------------

label_names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(cm.valid_label)
labels_st = st.dictionaries(label_names, st.text(max_size=8), max_size=3).map(lambda d: tuple(sorted(d.items())))
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=0, max_value=1e12)


@st.composite
def families_st(draw: st.DrawFn) -> list[Family]:
    names = draw(st.lists(st.from_regex(r"[a-z_:][a-z0-9_:]{0,8}", fullmatch=True), unique=True, max_size=4))
    out = []
    for name in sorted(names):
        kind = draw(st.sampled_from(list(Kind)))
        series_labels = draw(st.lists(labels_st, unique=True, max_size=3))
        if kind == Kind.HISTOGRAM:
            bounds = tuple(sorted(set(draw(st.lists(finite, max_size=4)))))
            series = [Series(lab, bounds=bounds, counts=tuple(draw(st.lists(st.integers(0, 99), min_size=len(bounds)
                                                                            + 1, max_size=len(bounds) + 1))),
                             sum=draw(finite), count=draw(st.integers(0, 99))) for lab in series_labels]
        else:
            series = [Series(lab, draw(finite)) for lab in series_labels]
        out.append(Family(name, draw(st.text(max_size=10)), kind, tuple(sorted(series, key=lambda s: s.labels))))
    return out


@given(families_st())
def test_decode_encode_round_trip(families: list[Family]) -> None:
    wire = msgpack.unpackb(msgpack.packb(cm.encode(families), use_bin_type=True), raw=False)
    assert cm.decode(wire) == families


def test_decode_drops_what_is_malformed() -> None:
    good = cm.encode([counter("ok", 1)])[0]
    bad = [
        "not a family",
        ["bad name!", "h", 0, []],
        ["x_kind", "h", 7, []],
        ["x_negative", "h", 0, [[[], -1.0]]],  # a counter below zero
        ["x_le", "h", 2, [[[["le", "1"]], [1.0], [0, 0], 0.0, 0]]],  # `le` is the histogram's own label
        ["x_unsorted", "h", 2, [[[], [2.0, 1.0], [0, 0, 0], 0.0, 0]]],
        ["x_counts", "h", 2, [[[], [1.0], [0], 0.0, 0]]],  # one count short
        ["x_bool", "h", 1, [[[], True]]],
    ]
    decoded = cm.decode([good, *bad])
    # A bad name or kind drops the family; a bad series only the series (the family stays, empty).
    assert [(f.name, len(f.series)) for f in decoded] == [
        ("ok", 1), ("x_bool", 0), ("x_counts", 0), ("x_le", 0), ("x_negative", 0), ("x_unsorted", 0)]
    assert cm.decode({"not": "a list"}) == []
    assert cm.decode([["e", "h", 1, [[[["__x", "y"]], 1.0]]]]) == [Family("e", "h", Kind.GAUGE, ())]


def test_decode_bounds_families_series_and_text() -> None:
    many = [counter(f"f{i:03d}", 1) for i in range(cm.MAX_FAMILIES + 10)]
    assert len(cm.decode(cm.encode(many))) == cm.MAX_FAMILIES
    wide = Family("wide", "h" * (cm.MAX_TEXT + 5), Kind.GAUGE,
                  tuple(Series((("i", f"{i:05d}"),), 1.0) for i in range(cm.MAX_SERIES + 5)))
    (got,) = cm.decode(cm.encode([wide]))
    assert len(got.series) == cm.MAX_SERIES and len(got.help) == cm.MAX_TEXT
    # The cap is over all the model's families: the first (in name order) keep theirs.
    a, b = cm.decode(cm.encode([wide, Family("a", "h", Kind.GAUGE, (Series((), 1.0),) * 1)]))
    assert (a.name, len(a.series), b.name, len(b.series)) == ("a", 1, "wide", cm.MAX_SERIES - 1)


# --- combining ----------------------------------------------------------------------------------


def test_combine_sums_counters_gauges_and_histograms_series_by_series() -> None:
    one = [counter("c", 5), gauge("g", 2), histogram("h", (1, 0, 2), 7.5)]
    two = [counter("c", 3), counter("c", 4, (("model", "other"),)), gauge("g", 1), histogram("h", (0, 1, 0), 0.5)]
    c, g, h = cm.combine([one, two])
    assert c.series == (Series(MV, 8.0), Series((("model", "other"),), 4.0))
    assert g.series == (Series(MV, 3.0),)
    assert h.series[0].counts == (1, 1, 2) and h.series[0].sum == 8.0 and h.series[0].count == 4


def test_combine_keeps_the_first_kind_help_and_bucket_layout() -> None:
    first = [counter("x", 1, help_text="first description"), histogram("h", (1, 0, 0), 0.05)]
    later = [gauge("x", 10), counter("x", 1, help_text="second description"),
             histogram("h", (5, 5), 9.0, bounds=(2.0,))]
    h, x = cm.combine([first, later])
    assert (x.kind, x.help, x.series[0].value) == (Kind.COUNTER, "first description", 2.0)
    assert h.series[0].counts == (1, 0, 0)  # other bounds cannot be added: dropped


def test_lasting_keeps_counters_and_histograms_only() -> None:
    parts = [counter("c", 1), gauge("g", 1), histogram("h", (1, 0, 0), 0.05)]
    assert [f.name for f in cm.lasting(parts)] == ["c", "h"]


# --- Prometheus text ----------------------------------------------------------------------------


def test_render_writes_tritons_text() -> None:
    """The lines Triton's custom_metrics example and its QA test (L0_backend_python custom_metrics) look for."""
    hist = Family("test_histogram_e2e", "test metric histogram kind end to end", Kind.HISTOGRAM, (Series(
        (("example1", "histogram_label1"), ("example2", "histogram_label2")), bounds=(0.1, 1.0, 2.5, 5.0, 10.0),
        counts=(1, 0, 1, 0, 1, 0), sum=7.55, count=3),))
    text = cm.render([counter("requests_process_latency_ns", 223406, help_text="Cumulative time spent processing "
                                                                               "requests"), hist])
    assert "# HELP requests_process_latency_ns Cumulative time spent processing requests\n" in text
    assert "# TYPE requests_process_latency_ns counter\n" in text
    assert 'requests_process_latency_ns{model="custom_metrics",version="1"} 223406\n' in text
    labels = 'example1="histogram_label1",example2="histogram_label2"'
    for line in (f"test_histogram_e2e_count{{{labels}}} 3", f"test_histogram_e2e_sum{{{labels}}} 7.55",
                 f'test_histogram_e2e_bucket{{{labels},le="0.1"}} 1', f'test_histogram_e2e_bucket{{{labels},le="1"}} 1',
                 f'test_histogram_e2e_bucket{{{labels},le="2.5"}} 2', f'test_histogram_e2e_bucket{{{labels},le="5"}} 2',
                 f'test_histogram_e2e_bucket{{{labels},le="10"}} 3',
                 f'test_histogram_e2e_bucket{{{labels},le="+Inf"}} 3'):
        assert line + "\n" in text
    assert "# TYPE test_histogram_e2e histogram\n" in text


def test_render_escapes_and_leaves_out_taken_names() -> None:
    fam = Family("m", 'a\\b\nc', Kind.GAUGE, (Series((("path", 'x"y\\z\n'),), 0.5), Series((), 2.0)))
    assert cm.render([fam]) == '# HELP m a\\\\b\\nc\n# TYPE m gauge\nm{path="x\\"y\\\\z\\n"} 0.5\nm 2\n'
    assert cm.render([fam, counter("nv_inference_count", 1)], taken=frozenset({"nv_inference_count"})).count(
        "# TYPE") == 1


# --- one worker's book --------------------------------------------------------------------------


def test_book_publishes_each_change_and_keeps_what_a_stopped_stub_counted() -> None:
    published: list[tuple[str, list[Family]]] = []
    book = CustomMetricsBook(lambda model, blob: published.append((model, cm.decode(msgpack.unpackb(blob)))))
    book.report("m", "m_0:v1:1", cm.encode([counter("c", 5), gauge("g", 7)]))
    book.report("m", "m_1:v1:2", cm.encode([counter("c", 1), gauge("g", 1)]))
    assert published[-1] == ("m", [counter("c", 6), gauge("g", 8)])
    book.retire("m", "m_0:v1:1")  # crashed: its counter stays, its gauge goes
    assert published[-1] == ("m", [counter("c", 6), gauge("g", 1)])
    book.report("m", "m_0:v1:3", cm.encode([counter("c", 2), gauge("g", 4)]))  # the restarted stub, from zero
    assert published[-1] == ("m", [counter("c", 8), gauge("g", 5)])
    book.retire("m", "gone:v1:9")  # never reported: nothing to publish
    assert len(published) == 4


def test_book_retries_a_failed_publish_with_the_next_change() -> None:
    published: list[str] = []
    failing = {"on": True}

    def publish(model: str, blob: bytes) -> None:
        if failing["on"]:
            raise ConnectionError("Redis away")
        published.append(model)

    book = CustomMetricsBook(publish)
    book.report("a", "a_0:v1:1", cm.encode([counter("c", 1)]))
    failing["on"] = False
    book.report("b", "b_0:v1:2", cm.encode([counter("c", 1)]))
    assert published == ["a", "b"]
    assert book.part("a") == [counter("c", 1)]


# --- the gateway's fleet total ------------------------------------------------------------------


def _blob(families: list[Family]) -> bytes:
    return bytes(msgpack.packb(cm.encode(families), use_bin_type=True))


def test_fleet_total_keeps_a_dead_workers_counters_and_drops_its_gauges() -> None:
    parts = {
        "custom_metrics": {"w1": _blob([counter("c", 5), gauge("g", 1)]),
                           "w2": _blob([counter("c", 3), gauge("g", 1), histogram("h", (1, 1, 0), 0.6)]),
                           "w3": b"\xc1 not msgpack"},
        "other": {"w1": _blob([counter("c", 2, (("model", "other"),))])},
    }
    c, g, h = fleet_total(parts, live={"w1", "w3"})
    assert c.series == (Series(MV, 8.0), Series((("model", "other"),), 2.0))
    assert g.series == (Series(MV, 1.0),)  # w2 is dead: its gauge is gone
    assert h.series[0].count == 2


def test_the_caps_apply_per_model_not_to_the_fleet_page() -> None:
    wide = [Family("w", "", Kind.COUNTER, tuple(Series((("m", m), ("i", f"{i:04d}")), 1.0) for i in range(500)))
            for m in ("a", "b", "c")]
    parts = {m: {"w1": _blob([f])} for m, f in zip("abc", wide, strict=True)}
    [family] = fleet_total(parts, live={"w1"})
    assert len(family.series) == 1500  # each model's 500 under its own cap of MAX_SERIES
    assert 1500 > cm.MAX_SERIES


def test_names_in_reads_family_and_sample_names() -> None:
    page = b'# HELP nv_x_total d\n# TYPE nv_x_total counter\nnv_x_total{model="a"} 1.0\nfleet_workers 1.0\n'
    assert names_in(page) == {"nv_x_total", "fleet_workers"}


# --- the shim -----------------------------------------------------------------------------------


def test_shim_raises_tritons_exception_and_checks_buckets_as_triton_does() -> None:
    family = pb_utils.MetricFamily("test_cm_hist_args", "h", pb_utils.MetricFamily.HISTOGRAM)
    for buckets in (None, [2.5, 0.1, 1.0], [1, 1, 2]):
        with pytest.raises(pb_utils.TritonModelException):
            family.Metric(labels={}, buckets=buckets)
    family.Metric(labels={}, buckets=[])  # empty is allowed: one +Inf bucket
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.MetricFamily("not a name", "d", pb_utils.MetricFamily.COUNTER)
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.MetricFamily("test_cm_labels", "d", pb_utils.MetricFamily.GAUGE).Metric(labels={"le": "1"})


def test_shim_snapshot_follows_every_change() -> None:
    before = pb_utils._metric_changes()
    first = pb_utils.MetricFamily("test_cm_snapshot", "first description", pb_utils.MetricFamily.COUNTER)
    pb_utils.MetricFamily("test_cm_snapshot", "second description", pb_utils.MetricFamily.COUNTER)
    metric = first.Metric(labels={"version": "1", "model": "m"})
    metric.increment(2.5)
    assert pb_utils._metric_changes() > before
    hist = pb_utils.MetricFamily("test_cm_snapshot_h", "h", pb_utils.MetricFamily.HISTOGRAM).Metric(
        labels={"model": "m"}, buckets=[1.0])
    hist.observe(0.5)
    hist.observe(3)
    families = {f.name: f for f in cm.decode(pb_utils._metric_snapshot())}
    assert families["test_cm_snapshot"] == Family("test_cm_snapshot", "first description", Kind.COUNTER,
                                                  (Series((("model", "m"), ("version", "1")), 2.5),))
    assert families["test_cm_snapshot_h"].series == (Series((("model", "m"),), bounds=(1.0,), counts=(1, 1),
                                                            sum=3.5, count=2),)
    seen = pb_utils._metric_changes()
    assert metric.value() == 2.5 and pb_utils._metric_changes() == seen  # reading changes nothing
