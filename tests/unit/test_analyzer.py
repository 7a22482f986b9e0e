"""`fleet analyze`'s pure parts (fleet/analyzer): the sweep plan, the config each point loads, the choice
within a latency budget, the request body it sends, and the report."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from fleet.analyzer.load import LoadError, request_body
from fleet.analyzer.report import chart, svg, table
from fleet.analyzer.run import pbtxt
from fleet.analyzer.sweep import Measurement, Point, SweepError, best, configure, current_point, estimate_s, plan
from fleet.kserve import parse_infer
from fleet.model_config import parse_config

MLP: dict[str, Any] = {
    "name": "mlp", "platform": "pytorch_libtorch", "backend": "pytorch", "max_batch_size": 64,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["256"]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["10"]}],
    "instance_group": [{"name": "mlp_0", "kind": "KIND_CPU", "count": 1}],
    "dynamic_batching": {"preferred_batch_size": [64], "max_queue_delay_microseconds": "100"},
    "parameters": {"INTRA_OP_THREAD_COUNT": {"string_value": "1"}},
}
PYTHON_NO_BATCH: dict[str, Any] = {"name": "add_sub", "backend": "python", "max_batch_size": 0,
                                   "instance_group": [{"kind": "KIND_CPU", "count": 2}]}


def m(point: Point, c: int, infer_s: float, p99: float, errors: int = 0) -> Measurement:
    return Measurement(point, c, infer_s, p99 / 2, p99, 4.0, errors)


def test_the_current_config_is_the_first_point() -> None:
    assert current_point(MLP) == Point(1, 100, (64,), 1)
    assert current_point(PYTHON_NO_BATCH) == Point(2, None, (), None)


def test_plan_is_the_product_with_the_current_point_first_and_no_repeats() -> None:
    points = plan(MLP, instances=[1, 2], delays_us=[100, 1000], preferred=[(), (64,)])
    assert points[0] == Point(1, 100, (64,), 1)
    assert len(points) == 8 and len(set(points)) == 8
    assert Point(2, 1000, (), 1) in points
    assert plan(MLP) == [Point(1, 100, (64,), 1)]
    assert plan(PYTHON_NO_BATCH, instances=[1, 2, 3]) == [Point(2, None, (), None), Point(1, None, (), None),
                                                         Point(3, None, (), None)]


@pytest.mark.parametrize("config, kwargs, message", [
    (PYTHON_NO_BATCH, {"delays_us": [0, 100]}, "max_batch_size 0: it cannot batch"),
    (PYTHON_NO_BATCH, {"threads": [1, 2]}, "has no intra-op thread setting"),
    (MLP, {"instances": [0]}, "at least 1"),
    (MLP, {"preferred": [(128,)]}, r"1..max_batch_size \(64\)"),
    (MLP, {"delays_us": [-5]}, "must not be negative"),
    ({"name": "e", "platform": "ensemble", "max_batch_size": 8}, {}, "is an ensemble"),
    ({"name": "g", "backend": "llm", "max_batch_size": 0}, {"instances": [2]}, "measure it with bench/llm.py"),
    ({**MLP, "sequence_batching": {}}, {"delays_us": [0]}, "uses the sequence batcher"),
])
def test_what_a_model_cannot_take_is_refused(config: dict[str, Any], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SweepError, match=message):
        plan(config, **kwargs)


def test_configure_sets_the_point_and_keeps_the_rest() -> None:
    out = configure(MLP, Point(3, 2000, (), 2))
    assert out["instance_group"] == [{"kind": "KIND_CPU", "count": 3}]
    assert out["dynamic_batching"] == {"max_queue_delay_microseconds": 2000}
    assert out["parameters"] == {"INTRA_OP_THREAD_COUNT": {"string_value": "2"}}
    assert out["input"] == MLP["input"] and out["max_batch_size"] == 64
    assert MLP["instance_group"][0]["count"] == 1  # the original is not touched
    assert configure(MLP, Point(1, 0, (8, 16), 1))["dynamic_batching"]["preferred_batch_size"] == [8, 16]
    # Every configured point is a config fleet accepts (the override the gateway would load).
    spec = parse_config(pbtxt(out), source="override", model_name="mlp")
    assert spec.instance_count == 3 and spec.parameters["INTRA_OP_THREAD_COUNT"] == "2"


def test_best_is_the_highest_throughput_within_the_budget() -> None:
    a, b, c = Point(1, 0, (), 1), Point(2, 0, (), 1), Point(2, 1000, (), 1)
    rows = [m(a, 1, 300, 2.0), m(a, 32, 2000, 30.0), m(b, 1, 320, 2.5), m(b, 32, 2600, 25.0),
            m(c, 1, 250, 4.0), m(c, 32, 3000, 12.0, errors=3)]
    assert best(rows, None) == rows[3]  # c's 3000 had errors: never chosen
    assert best(rows, 20.0) == rows[2]  # within 20 ms: the C=1 rows only
    assert best(rows, 1.0) is None
    # A tie goes to the lower p99, then to the earlier point (the current config: no change without a gain).
    assert best([m(a, 1, 500, 3.0), m(b, 1, 500, 2.0)], None) == m(b, 1, 500, 2.0)
    assert best([m(a, 1, 500, 2.0), m(b, 1, 500, 2.0)], None) == m(a, 1, 500, 2.0)
    # The current config (the first point) stays unless beaten by more than min_gain.
    assert best([m(a, 1, 500, 2.0), m(b, 1, 520, 2.0)], None, min_gain=0.05) == m(a, 1, 500, 2.0)
    assert best([m(a, 1, 500, 2.0), m(b, 1, 530, 2.0)], None, min_gain=0.05) == m(b, 1, 530, 2.0)
    assert best([m(a, 1, 500, 30.0), m(b, 1, 400, 2.0)], 20.0, min_gain=0.05) == m(b, 1, 400, 2.0)


def test_estimate_counts_loads_and_windows() -> None:
    assert estimate_s(points=4, concurrencies=3, seconds=3.0, warmup_s=1.0, load_s=3.0) == 4 * (3 + 3 * 4)


def test_the_request_body_is_one_item_the_gateway_accepts() -> None:
    spec = parse_config('backend: "python"\nmax_batch_size: 8\n'
                        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 4 ] }, '
                        '{ name: "T", data_type: TYPE_STRING, dims: [ -1 ] } ]\n'
                        'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 4 ] } ]', source="m", model_name="m")
    metadata = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 4]},
                           {"name": "T", "datatype": "BYTES", "shape": [-1, -1]}],
                "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 4]}]}
    with pytest.raises(LoadError, match="--shape T:D1"):
        request_body(metadata, True, {})
    body, header_length = request_body(metadata, True, {"T": [3]})
    parsed = parse_infer(body, str(header_length), spec)
    shapes = {t.name: list(t.shape) for t in parsed.inputs}
    assert shapes == {"X": [1, 4], "T": [1, 3]}
    assert parsed.is_binary("Y")
    x = next(t for t in parsed.inputs if t.name == "X")
    values = np.frombuffer(bytes(x.data), np.float32)
    assert values.shape == (4,) and ((values >= 0) & (values < 1)).all()
    with pytest.raises(LoadError, match="does not fit"):
        request_body(metadata, True, {"X": [5]})


def test_the_report_renders_and_the_plot_is_svg() -> None:
    a, b = Point(1, 0, (), 1), Point(2, 100, (8,), 1)
    rows = [m(a, 1, 300, 2.0), m(a, 8, 900, 9.0), m(b, 1, 310, 2.1), m(b, 8, 1400, 7.5)]
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(table(rows, best(rows, 8.0), 8.0))
    console.print(chart(rows, 8.0))
    text = console.export_text()
    assert "best" in text and "over budget" in text and "1,400/s at C=8" in text
    root = ET.fromstring(svg(rows, 8.0, "fleet analyze mlp"))
    assert root.tag.endswith("svg")
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2
