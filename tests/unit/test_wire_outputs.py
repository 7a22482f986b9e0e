"""Framework backends' outputs in wire form (workers/backends/base.py's `_wire_outputs`): each request gets
the bytes of its own rows of every output it may want, exactly what splitting the batch outputs and encoding
them per request gives; anything else (another type than declared, BYTES, scattered outputs, no batching)
goes the array way, where it is cast, refused or scattered as before."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet import tensors
from fleet.envelope import RequestEnvelope, WireTensor
from fleet.model_config import parse_config
from fleet.model_spec import ModelSpec
from workers.backends.base import InferenceItem, InProcessBackend, ItemResult, _split_outputs, run_merged
from workers.execute import run_batch
from workers.sequence_tensors import SequenceTensors

# name, config type, numpy type, the shape of a row the model returns (U: a variable dim, empty here)
OUTPUTS = [("F", "TYPE_FP32", np.float32, (3,)), ("I", "TYPE_INT64", np.int64, (2, 2)),
           ("H", "TYPE_FP16", np.float16, (1,)), ("B", "TYPE_BOOL", np.bool_, (2,)),
           ("U", "TYPE_UINT8", np.uint8, (0,))]


def _config_dims(dims: tuple[int, ...]) -> str:
    return ", ".join(str(d or -1) for d in dims)


def spec(max_batch_size: int = 8, extra: str = "") -> ModelSpec:
    outputs = ", ".join(f'{{ name: "{n}", data_type: {t}, dims: [ {_config_dims(d)} ] }}'
                        for n, t, _, d in OUTPUTS)
    return parse_config(f'platform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
                        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                        f'output [ {outputs} ]\n{extra}', source="m", model_name="m")


SPEC = spec()


def model(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output computed from the rows' values, in its declared type."""
    x = batch["X"][:, 0]
    rows = len(x)
    return {name: (x.reshape(rows, *[1] * len(dims)) * np.arange(1, 1 + int(np.prod(dims))).reshape(dims))
            .astype(numpy) for name, _, numpy, dims in OUTPUTS}


def items_of(rows: list[int], wanted: list[list[str] | None]) -> list[InferenceItem]:
    start, items = 0, []
    for count, names in zip(rows, wanted, strict=True):
        x = np.arange(start + 1, start + 1 + count, dtype=np.float32).reshape(count, 1)
        items.append(InferenceItem(inputs={"X": x}, requested_outputs=names))
        start += count
    return items


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.none() | st.lists(st.sampled_from([o[0] for o in OUTPUTS]),
                                                                   unique=True)), min_size=1, max_size=6))
def test_each_request_gets_its_rows_bytes_of_what_it_may_want(requests: list[tuple[int, list[str] | None]]) -> None:
    rows = [r for r, _ in requests]
    items = items_of(rows, [w for _, w in requests])
    results = run_merged(SPEC, items, model)
    expected = _split_outputs(SPEC, model({"X": np.concatenate([i.inputs["X"] for i in items])}), items)
    anyone_wants_all = any(w is None for _, w in requests)
    wanted_by_some = {n for _, w in requests for n in (w or [])}
    for result, arrays in zip(results, expected, strict=True):
        assert result.error is None and result.outputs is None and result.wire_outputs is not None
        names = [n for n, *_ in OUTPUTS if anyone_wants_all or n in wanted_by_some]
        assert list(result.wire_outputs) == names  # the model's order, only what some request may want
        for name in names:
            wire, array = result.wire_outputs[name], arrays[name]
            declared = SPEC.output(name)
            assert declared is not None
            assert (wire.name, wire.datatype, wire.shape) == (name, declared.datatype.name, array.shape)
            assert bytes(wire.data) == tensors.to_bytes(array, declared.datatype)


def test_the_bytes_are_a_copy_of_what_the_model_returned() -> None:
    buffer = np.zeros((3, 3), np.float32)

    def reusing(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        buffer[:] = batch["X"]
        return {"F": buffer}

    only_f = parse_config('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
                          'input [ { name: "X", data_type: TYPE_FP32, dims: [ 3 ] } ]\n'
                          'output [ { name: "F", data_type: TYPE_FP32, dims: [ 3 ] } ]', source="m", model_name="m")
    items = [InferenceItem(inputs={"X": np.full((n, 3), v, np.float32)}) for n, v in ((1, 1.0), (2, 2.0))]
    results = run_merged(only_f, items, reusing)
    buffer[:] = -1  # the model's next batch
    assert [result.wire_outputs is not None and np.frombuffer(result.wire_outputs["F"].data, np.float32).tolist()
            for result in results] == [[1.0] * 3, [2.0] * 6]


def _arrays_given(spec_: ModelSpec, outputs: dict[str, np.ndarray], rows: list[int]) -> list[ItemResult]:
    return run_merged(spec_, items_of(rows, [None] * len(rows)), lambda _: outputs)


def test_another_type_than_declared_goes_the_array_way() -> None:
    outputs = model({"X": np.ones((3, 1), np.float32)})
    outputs["F"] = outputs["F"].astype(np.float64)  # numpy's default; execute.py casts it within its kind
    results = _arrays_given(SPEC, outputs, [1, 2])
    assert all(r.wire_outputs is None and r.outputs is not None for r in results)
    assert results[1].outputs is not None and results[1].outputs["F"].shape == (2, 3)


def test_undeclared_outputs_bytes_outputs_and_unbatched_models_go_the_array_way() -> None:
    outputs = model({"X": np.ones((2, 1), np.float32)})
    undeclared = {**outputs, "EXTRA": np.zeros((2, 1), np.float32)}
    results = _arrays_given(SPEC, undeclared, [1, 1])
    assert all(r.error is None and r.wire_outputs is None and r.outputs is not None for r in results)
    strings = spec(extra='output [ { name: "S", data_type: TYPE_STRING, dims: [ 1 ] } ]')
    with_bytes = {**outputs, "S": np.array([[b"a"], [b"b"]], dtype=np.object_)}
    results = _arrays_given(strings, with_bytes, [1, 1])
    assert all(r.error is None and r.wire_outputs is None and r.outputs is not None for r in results)
    unbatched = spec(max_batch_size=0)
    single = {name: array[0] for name, array in model({"X": np.ones((1, 1), np.float32)}).items()}
    results = run_merged(unbatched, [InferenceItem(inputs={"X": np.ones(1, np.float32)})], lambda _: single)
    assert results[0].wire_outputs is None and results[0].outputs is not None


def test_an_output_without_the_batchs_rows_fails_the_batch_as_before() -> None:
    outputs = model({"X": np.ones((4, 1), np.float32)})  # four rows for a batch of three (and, alone, of 1 and 2)
    results = _arrays_given(SPEC, outputs, [1, 2])
    assert all(r.error is not None and "has 4 rows, the batch has" in r.error.message for r in results)


class Doubler(InProcessBackend):
    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        return run_merged(ONE, items, lambda batch: {"Y": batch["X"] * 2})

    def close(self) -> None:
        pass


ONE = parse_config('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
                   'input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
                   'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]', source="m", model_name="m")


def test_replies_carry_each_requests_rows() -> None:
    def env(rid: str, values: list[float], outputs: list[str] | None = None) -> RequestEnvelope:
        rows = len(values) // 2
        return RequestEnvelope(id=rid, model="m", version=1, reply_to="r", enqueued_at_us=0, outputs=outputs,
                               inputs=[WireTensor("X", "FP32", (rows, 2), struct.pack(f"<{len(values)}f", *values))])

    outcome = run_batch(ONE, Doubler(), [env("a", [1, 2]), env("b", [3, 4, 5, 6], ["Y"]), env("c", [7, 8], ["Z"])])
    a, b, c = outcome.replies
    assert a.outputs is not None and [(t.name, t.datatype, t.shape) for t in a.outputs] == [("Y", "FP32", (1, 2))]
    assert struct.unpack("<2f", a.outputs[0].data) == (2.0, 4.0)
    assert b.outputs is not None and b.outputs[0].shape == (2, 2)
    assert struct.unpack("<4f", b.outputs[0].data) == (6.0, 8.0, 10.0, 12.0)
    assert c.error_code == "INTERNAL" and "did not produce output 'Z'" in c.error_message


def test_a_sequence_models_state_is_kept_when_every_request_names_its_outputs() -> None:
    """The state outputs are the model's, never a client's: kept for the sequence's next request however the
    requests name their outputs (a gRPC client names them)."""
    seq = parse_config('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
                       'input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                       'output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
                       'sequence_batching { state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_FP32'
                       ' dims: [ 2 ] } ] }', source="m", model_name="m")
    assert seq.sequence is not None
    facing = seq.model_facing()  # what the backend runs: the state's output among the outputs
    states = SequenceTensors(seq.sequence, batched=True)

    def stateful(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = batch["X"]
        return {"Y": x * 2, "S_OUT": np.concatenate([x, x + 1], axis=1)}

    items = [InferenceItem(inputs={"X": np.full((1, 1), v, np.float32)}, requested_outputs=["Y"]) for v in (1, 5)]
    results = run_merged(facing, items, stateful)
    assert all(r.wire_outputs is not None and list(r.wire_outputs) == ["Y", "S_OUT"] for r in results)
    kept = [states.state_of(r) for r in results]
    assert all(isinstance(state, dict) for state in kept)
    assert [np.frombuffer(state["S_IN"].data, np.float32).tolist() for state in kept  # type: ignore[index]
            ] == [[1.0, 2.0], [5.0, 6.0]]
    assert all(type(state["S_IN"].data) is bytes for state in kept)  # type: ignore[index]  # its own bytes
