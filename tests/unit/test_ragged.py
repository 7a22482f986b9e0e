"""Ragged batching, pure parts (protocol.md §3.6): ragged inputs merged as 1-D tensors, Triton's batch input
kinds, scattering outputs back, and run_merged putting them together for framework backends."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching.merge import batch_input_parts, merge, scatter, split
from fleet.model_config import parse_config
from fleet.model_spec import BatchInputKind
from workers.backends.base import InferenceItem, InProcessBackend, batch_tensors, run_merged

K = BatchInputKind
I32, F32 = np.dtype("<i4"), np.dtype("<f4")


def concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts, axis=0)


# ---------------------------------------------------------------- batch input kinds (model_config.proto)

def test_accumulated_element_count_is_the_ragged_batching_guide_example() -> None:
    # ragged_batching.md: requests [1, 3], [1, 4], [1, 5] -> INDEX [3, 7, 12], one value per request.
    parts = batch_input_parts(K.ACCUMULATED_ELEMENT_COUNT, F32, [(1, 3), (1, 4), (1, 5)])
    assert [p.tolist() for p in parts] == [[3.0], [7.0], [12.0]]
    assert all(p.dtype == F32 and p.shape == (1,) for p in parts)


@pytest.mark.parametrize(("kind", "per_request", "batch_shape"), [
    # model_config.proto: two requests of 2 elements each.
    (K.ELEMENT_COUNT, [[2], [2]], (2,)),
    (K.ACCUMULATED_ELEMENT_COUNT, [[2], [4]], (2,)),
    (K.ACCUMULATED_ELEMENT_COUNT_WITH_ZERO, [[0, 2], [4]], (3,)),
])
def test_element_count_kinds(kind: BatchInputKind, per_request: list[list[int]], batch_shape: tuple[int]) -> None:
    parts = batch_input_parts(kind, I32, [(1, 2), (2, 1)])
    assert [p.tolist() for p in parts] == per_request
    assert concat(parts).shape == batch_shape and concat(parts).dtype == I32


def test_element_counts_include_every_row_of_a_request() -> None:
    assert [p.tolist() for p in batch_input_parts(K.ELEMENT_COUNT, I32, [(3, 4), (1, 0)])] == [[12], [0]]


def test_max_element_count_is_a_shape() -> None:
    parts = batch_input_parts(K.MAX_ELEMENT_COUNT_AS_SHAPE, F32, [(1, 3), (1, 7), (2, 2)])
    assert [p.shape for p in parts] == [(7,), (0,), (0,)]
    assert concat(parts).shape == (7,)


def test_item_shape_kinds_are_the_proto_example() -> None:
    # model_config.proto: a batch-2 input of shape [3, 1] and a batch-1 input of shape [2, 2].
    shapes = [(2, 3, 1), (1, 2, 2)]
    item = batch_input_parts(K.ITEM_SHAPE, I32, shapes)
    assert [p.shape for p in item] == [(2, 2), (1, 2)]
    assert concat(item).tolist() == [[3, 1], [3, 1], [2, 2]]
    flat = batch_input_parts(K.ITEM_SHAPE_FLATTEN, F32, shapes)
    assert concat(flat).tolist() == [3, 1, 3, 1, 2, 2] and concat(flat).dtype == F32


def test_batch_inputs_need_a_request() -> None:
    with pytest.raises(ValueError):
        batch_input_parts(K.ELEMENT_COUNT, I32, [])


# ---------------------------------------------------------------- merge / split / scatter round trips

@st.composite
def ragged_batches(draw: st.DrawFn) -> list[dict[str, np.ndarray]]:
    """Requests with a ragged FP32 input R of any [rows, n] (BYTES for some draws) and a fixed-shape
    INT32 input F of [rows, 2], rows shared within a request."""
    text = draw(st.booleans())
    requests = []
    for _ in range(draw(st.integers(1, 5))):
        rows, n = draw(st.integers(1, 3)), draw(st.integers(0, 4))
        if text:
            ragged = np.empty((rows, n), dtype=object)
            ragged.reshape(-1)[:] = [bytes([i % 256]) * (i % 3) for i in range(rows * n)]
        else:
            ragged = np.arange(rows * n, dtype=np.float32).reshape(rows, n) + draw(st.integers(0, 100))
        requests.append({"R": ragged, "F": np.full((rows, 2), draw(st.integers(-5, 5)), np.int32)})
    return requests


@settings(max_examples=150, deadline=None)
@given(ragged_batches())
def test_ragged_merge_round_trips_through_the_batch_inputs(requests: list[dict[str, np.ndarray]]) -> None:
    merged = merge(requests, ragged={"R"})
    assert merged["R"].ndim == 1 and merged["R"].size == sum(r["R"].size for r in requests)
    # The offsets a model gets find each request's elements in the 1-D tensor...
    bounds = concat(batch_input_parts(K.ACCUMULATED_ELEMENT_COUNT_WITH_ZERO, I32, [r["R"].shape for r in requests]))
    items = concat(batch_input_parts(K.ITEM_SHAPE, I32, [r["R"].shape for r in requests]))
    row = 0
    for i, request in enumerate(requests):
        mine = merged["R"][bounds[i]:bounds[i + 1]]
        np.testing.assert_array_equal(mine, request["R"].reshape(-1))
        assert all(tuple(items[row + k]) == request["R"].shape[1:] for k in range(request["R"].shape[0]))
        row += request["R"].shape[0]
    # ...scatter undoes the ragged merge, split the plain one: split(merge(x)) == x.
    back = scatter(merged["R"], [r["R"].shape for r in requests])
    plain = split({"F": merged["F"]}, [r["F"].shape[0] for r in requests])
    for request, r, f in zip(requests, back, plain, strict=True):
        np.testing.assert_array_equal(r, request["R"], strict=True)
        np.testing.assert_array_equal(f["F"], request["F"], strict=True)


def test_ragged_single_request_is_a_view() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    merged = merge([{"R": x}], ragged={"R"})
    assert merged["R"].shape == (6,) and np.shares_memory(merged["R"], x)


def test_ragged_merge_still_refuses_mixed_dtypes() -> None:
    with pytest.raises(ValueError, match="mixed dtypes"):
        merge([{"R": np.zeros((1, 2), np.float32)}, {"R": np.zeros((1, 3), np.float64)}], ragged={"R"})


@pytest.mark.parametrize("shapes", [[(1, 2), (1, 2)], [(1, 4)], [(1, -1), (1, 5)]])
def test_scatter_refuses_shapes_that_do_not_cover_the_output(shapes: list[tuple[int, ...]]) -> None:
    with pytest.raises(ValueError):
        scatter(np.zeros(5), shapes)


# ---------------------------------------------------------------- run_merged (framework backends)

SPEC = parse_config(
    'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    'input [ { name: "R", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true },'
    ' { name: "F", data_type: TYPE_INT32, dims: [ 2 ] } ]\n'
    'output [ { name: "PER_ROW", data_type: TYPE_FP32, dims: [ 1 ] },'
    ' { name: "SAME", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
    'batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "OFF" data_type: TYPE_INT32'
    ' source_input: "R" }, { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "MAX" data_type: TYPE_FP32'
    ' source_input: "R" } ]\n'
    'batch_output [ { target_name: "SAME" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "R" } ]\n',
    source="m", model_name="m")


def test_run_merged_feeds_ragged_inputs_flat_with_batch_inputs_and_scatters_outputs() -> None:
    xs = [np.array([[1, 2]], np.float32), np.array([[3, 4, 5], [6, 7, 8]], np.float32), np.array([[9]], np.float32)]
    items = [InferenceItem(inputs={"R": x, "F": np.full((x.shape[0], 2), i, np.int32)}) for i, x in enumerate(xs)]
    seen: dict[str, np.ndarray] = {}

    def run(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.update(batch)
        off = batch["OFF"]
        rows = [batch["R"][off[i]:off[i + 1]].sum() for i in range(len(off) - 1)]
        per_row = np.repeat(np.array(rows, np.float32), [x.shape[0] for x in xs]).reshape(-1, 1)
        return {"PER_ROW": per_row, "SAME": batch["R"] * 10}

    results = run_merged(SPEC, items, run)
    assert seen["R"].tolist() == list(range(1, 10)) and seen["F"].shape == (4, 2)
    assert seen["OFF"].tolist() == [0, 2, 8, 9] and seen["OFF"].dtype == I32
    assert seen["MAX"].shape == (6,) and seen["MAX"].dtype == F32
    for x, result in zip(xs, results, strict=True):
        assert result.error is None and result.outputs is not None
        assert list(result.outputs) == ["PER_ROW", "SAME"]  # the model's order
        assert result.outputs["PER_ROW"].tolist() == [[x.sum()]] * x.shape[0]
        np.testing.assert_array_equal(result.outputs["SAME"], x * 10)


def test_run_merged_fails_the_batch_when_a_scatter_does_not_fit() -> None:
    items = [InferenceItem(inputs={"R": np.ones((1, 3), np.float32), "F": np.zeros((1, 2), np.int32)})]
    results = run_merged(SPEC, items, lambda b: {"PER_ROW": np.zeros((1, 1), np.float32),
                                                 "SAME": np.zeros(4, np.float32)})
    assert results[0].error is not None and "cannot scatter" in results[0].error.message


def test_batch_tensors_need_the_source_input_in_every_request() -> None:
    with pytest.raises(Exception, match="needs input 'R' in every request"):
        batch_tensors(SPEC, [{"R": (1, 2)}, {"F": (1, 2)}])


def test_in_process_backends_are_never_dead_and_cannot_be_interrupted() -> None:
    backend = InProcessBackend()
    assert not backend.takes_wire and not backend.interruptible
    assert backend.alive and backend.revive()
    backend.kill()  # a no-op
