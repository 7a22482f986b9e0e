"""Triton's classification extension (fleet/classification.py): the top K classes of an output per batch entry,
as the BYTES strings Triton's front ends write ("value:index[:label]", C++'s std::to_string for the value)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fleet import tensors
from fleet.classification import MAX_ELEMENTS, classify, read_labels, requested_classes
from fleet.envelope import WireTensor
from fleet.errors import InvalidInput


def wire(array: np.ndarray, datatype: str) -> WireTensor:
    return WireTensor("OUT", datatype, tuple(array.shape), array.tobytes())


def classes(t: WireTensor) -> list[str]:
    assert t.datatype == "BYTES"
    return [s.decode() for s in tensors.deserialize_bytes(t.data, tensors.element_count(t.shape)).tolist()]


def test_what_triton_answers_for_a_batched_float_output() -> None:
    # tritonserver 2.51 answers `double` (OUTPUT0 = 2 * INPUT0, FP32 [-1, 16]) with class_count=3 so.
    out = classify(wire(np.arange(32, dtype=np.float32).reshape(2, 16) * 2, "FP32"), 3, batched=True)
    assert out.shape == (2, 3)
    assert classes(out) == ["30.000000:15", "28.000000:14", "26.000000:13", "62.000000:15", "60.000000:14",
                            "58.000000:13"]


def test_without_a_batch_dimension_the_whole_tensor_is_one_entry() -> None:
    out = classify(wire(np.array([[0.5, 2.0], [1.25, -3.0]], np.float64), "FP64"), 2, batched=False)
    assert out.shape == (2,)
    assert classes(out) == ["2.000000:1", "1.250000:2"]


def test_integers_are_written_as_their_digits() -> None:
    assert classes(classify(wire(np.array([[-7, 3, 12]], np.int32), "INT32"), 2, batched=True)) == ["12:2", "3:1"]
    big = np.array([[2**64 - 1, 0, 2**63]], np.uint64)
    assert classes(classify(wire(big, "UINT64"), 3, batched=True)) == [f"{2**64 - 1}:0", f"{2**63}:2", "0:1"]


def test_labels_name_the_classes_that_have_one() -> None:
    out = classify(wire(np.array([[0.1, 0.7, 0.2, 0.9]], np.float32), "FP32"), 4, batched=True,
                   labels=[b"cat", b"dog", b""])
    assert classes(out) == ["0.900000:3", "0.700000:1:dog", "0.200000:2", "0.100000:0:cat"]


def test_equal_values_keep_the_lower_index_first() -> None:
    assert classes(classify(wire(np.array([5, 7, 7, 1], np.int8), "INT8"), 3, batched=False)) == ["7:1", "7:2", "5:0"]


def test_more_classes_than_values_gives_every_value() -> None:
    out = classify(wire(np.array([[1.0, 2.0]], np.float32), "FP32"), 5, batched=True)
    assert out.shape == (1, 2) and classes(out) == ["2.000000:1", "1.000000:0"]


@pytest.mark.parametrize("datatype", ["BYTES", "BOOL", "FP16", "BF16"])
def test_outputs_that_cannot_be_classified_are_refused_with_tritons_words(datatype: str) -> None:
    with pytest.raises(InvalidInput, match=f"class result not available for output due to unsupported type "
                                           f"'{datatype}'"):
        requested_classes({"classification": 2}, "OUT", datatype)


def test_an_entry_past_tritons_limit_is_refused() -> None:
    with pytest.raises(InvalidInput, match="classification output tensor too large"):
        classify(wire(np.zeros((1, MAX_ELEMENTS + 1), np.float32), "FP32"), 1, batched=True)


@pytest.mark.parametrize("value", [True, -1, "3", 1.5, 2**32, None])
def test_a_count_that_is_not_a_non_negative_integer_is_refused(value: object) -> None:
    with pytest.raises(InvalidInput, match="'classification' must be a non-negative integer"):
        requested_classes({"classification": value}, "OUT", "FP32")


def test_no_count_or_zero_asks_for_the_tensor_itself() -> None:
    assert requested_classes({}, "OUT", "BYTES") == 0
    assert requested_classes({"classification": 0}, "OUT", "BYTES") == 0
    assert requested_classes({"classification": 3}, "OUT", "UINT16") == 3


def test_labels_are_read_as_tritons_getline_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "labels.txt"
    path.write_bytes(b"cat\ndog\n\nbird\x85x\r\n\xff\n")
    # Split at "\n" only: a CRLF line keeps its "\r", other line breaks and bytes that are not UTF-8 stay.
    assert read_labels(path) == (b"cat", b"dog", b"", b"bird\x85x\r", b"\xff")
    path.write_bytes(b"a\nb")
    assert read_labels(path) == (b"a", b"b")
    assert read_labels(tmp_path / "missing.txt") == ()


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=3, max_side=6),
                  elements=st.floats(-1e6, 1e6, width=32)), st.integers(1, 40))
def test_each_entry_is_its_largest_values_in_order(values: np.ndarray, k: int) -> None:
    out = classify(wire(values, "FP32"), k, batched=True)
    rows = values.reshape(values.shape[0], -1)
    want = []
    for row in rows:
        order = sorted(range(row.size), key=lambda i: (-float(row[i]), i))[:k]
        want += [f"{float(row[i]):f}:{i}" for i in order]
    assert out.shape == (values.shape[0], min(k, rows.shape[1]))
    assert classes(out) == want
