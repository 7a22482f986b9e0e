"""batching.merge: merge/split are inverses along the batch axis, for numeric and BYTES tensors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batching.merge import merge, split

NUMERIC_DTYPES = [np.bool_, np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """Requests with the same input names, per-name dtype and trailing shape; varying row counts."""
    rows = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
    names = draw(st.lists(st.sampled_from(["INPUT0", "INPUT1", "TEXT"]), min_size=1, unique=True))
    layout: dict[str, tuple[np.dtype | None, tuple[int, ...]]] = {}
    for name in names:
        trailing = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
        dtype = None if name == "TEXT" else np.dtype(draw(st.sampled_from(NUMERIC_DTYPES)))
        layout[name] = (dtype, trailing)
    requests = []
    for count in rows:
        request = {}
        for name, (dtype, trailing) in layout.items():
            shape = (count, *trailing)
            if dtype is None:  # BYTES: an object array of bytes, as the tensor codec produces
                cells = draw(st.lists(st.binary(max_size=6), min_size=int(np.prod(shape))))
                array = np.empty(shape, dtype=object)
                array.reshape(-1)[:] = cells[: array.size]
            else:
                array = draw(hnp.arrays(dtype, shape))
            request[name] = array
        requests.append(request)
    return requests, rows


def assert_same(left: np.ndarray, right: np.ndarray) -> None:
    assert left.dtype == right.dtype and left.shape == right.shape
    # equal_nan is not allowed for object arrays; bytes cells compare exactly anyway.
    np.testing.assert_array_equal(left, right, strict=True)


@settings(max_examples=200, deadline=None)
@given(batches())
def test_split_inverts_merge_one_result_per_request_in_order(
    batch: tuple[list[dict[str, np.ndarray]], list[int]],
) -> None:
    requests, rows = batch
    merged = merge(requests)
    for name, array in merged.items():
        assert array.shape[0] == sum(rows), name
    results = split(merged, rows)
    assert len(results) == len(requests)
    for original, result in zip(requests, results, strict=True):
        assert result.keys() == original.keys()
        for name in original:
            assert_same(result[name], original[name])


def test_single_request_is_not_copied() -> None:
    request = {"x": np.arange(6).reshape(2, 3), "s": np.array([b"a", b"bc"], dtype=object)}
    merged = merge([request])
    assert all(merged[k] is request[k] for k in request)


def test_merge_concatenates_in_request_order() -> None:
    a = {"x": np.array([[1, 2]], dtype=np.int32)}
    b = {"x": np.array([[3, 4], [5, 6]], dtype=np.int32)}
    np.testing.assert_array_equal(merge([a, b])["x"], [[1, 2], [3, 4], [5, 6]])


def test_split_returns_views() -> None:
    out = {"y": np.arange(10).reshape(5, 2)}
    first, second = split(out, [2, 3])
    assert np.shares_memory(first["y"], out["y"]) and np.shares_memory(second["y"], out["y"])
    np.testing.assert_array_equal(second["y"], [[4, 5], [6, 7], [8, 9]])


def test_bytes_of_different_widths_merge() -> None:
    merged = merge([{"s": np.array([b"a"])}, {"s": np.array([b"abc"])}])
    assert merged["s"].tolist() == [b"a", b"abc"]


@pytest.mark.parametrize(
    "requests",
    [
        [],
        [{"x": np.zeros(1)}, {"y": np.zeros(1)}],  # different input names
        [{"x": np.zeros(1)}, {"x": np.zeros(1), "y": np.zeros(1)}],  # optional input supplied once
        [{"x": np.zeros(1, np.float32)}, {"x": np.zeros(1, np.float64)}],  # would silently promote
        [{"x": np.zeros((1, 2))}, {"x": np.zeros((1, 3))}],  # trailing shapes differ
        [{"x": np.zeros(())}],  # scalar: no batch axis
    ],
)
def test_merge_refuses_inconsistent_requests(requests: list[dict[str, np.ndarray]]) -> None:
    with pytest.raises(ValueError):
        merge(requests)


@pytest.mark.parametrize(
    ("outputs", "rows"),
    [
        ({"y": np.zeros((4, 2))}, [1, 2]),  # first dim != sum(rows)
        ({"y": np.zeros(3), "z": np.zeros(2)}, [1, 2]),  # one output has the wrong row count
        ({"y": np.zeros(())}, [0]),  # scalar output
        ({"y": np.zeros(2)}, [3, -1]),  # negative row count
    ],
)
def test_split_refuses_row_mismatch(outputs: dict[str, np.ndarray], rows: list[int]) -> None:
    with pytest.raises(ValueError):
        split(outputs, rows)
