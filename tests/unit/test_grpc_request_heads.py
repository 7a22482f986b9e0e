"""gateway/grpc/request_heads.py: a ModelInferRequest decoded from a known head is what decode_infer makes of
it, error or result, whatever its fields and raw contents; only heads whose result depends on them alone
are kept, and the request keeps every field but its raw contents."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from fleet.errors import ServingError
from fleet.model_config import parse_config
from fleet.tensor_regions import RegionRef
from gateway.grpc.codec import decode_infer
from gateway.grpc.request_heads import RequestHeads
from tests.support.parsed_infer import CONFIG, SPEC, outcome, same

Tensor = pb.ModelInferRequest.InferInputTensor


def _request(inputs: list[Any], raw: list[bytes], **fields_: Any) -> Any:
    return pb.ModelInferRequest(model_name="m", inputs=inputs, raw_input_contents=raw, **fields_)


def _two(rows: int = 1, width: int = 2) -> list[Any]:
    return [Tensor(name="A", datatype="FP32", shape=[rows, 4]), Tensor(name="B", datatype="INT32", shape=[rows, width])]


def _copy(request: Any) -> Any:
    return pb.ModelInferRequest.FromString(request.SerializeToString())


def _check(heads: RequestHeads, request: Any) -> None:
    """Decoded through `heads` as decode_infer decodes it. A request with raw contents and no id leaves without
    them (they are in the result); nothing else of it changes."""
    want = outcome(lambda: decode_infer(_copy(request), SPEC, None))
    after = _copy(request)
    if after.raw_input_contents and not after.id:
        after.ClearField("raw_input_contents")
    same(outcome(lambda: heads.decode(request, SPEC, None)), want)
    assert request.SerializeToString(deterministic=True) == after.SerializeToString(deterministic=True)  # (map order)


def test_a_known_head_gives_each_request_its_own_inputs() -> None:
    heads = RequestHeads()
    params = {"priority": pb.InferParameter(int64_param=2), "k": pb.InferParameter(string_param="v")}
    outputs = [pb.ModelInferRequest.InferRequestedOutputTensor(name="Y")]
    first = heads.decode(_request(_two(), [bytes(range(16)), bytes(range(16, 24))], parameters=params,
                                  outputs=outputs), SPEC, None)
    assert len(heads) == 1
    later = _request(_two(), [bytes(range(100, 116)), bytes(range(116, 124))], parameters=params, outputs=outputs)
    want = decode_infer(_copy(later), SPEC, None)
    second = heads.decode(later, SPEC, None)
    assert len(heads) == 1
    same(second, want)
    assert bytes(first.inputs[0].data) == bytes(range(16)) and bytes(second.inputs[1].data) == bytes(range(116, 124))
    # Nothing mutable is shared between the requests made from one entry.
    second.parameters["x"] = 1
    assert second.outputs is not None
    second.outputs.append("Z")
    _check(heads, _request(_two(), [bytes(16), bytes(8)], parameters=params, outputs=outputs))


def test_raw_contents_of_other_sizes_get_decode_infers_error() -> None:
    heads = RequestHeads()
    heads.decode(_request(_two(), [bytes(16), bytes(8)]), SPEC, None)
    for raw in ([bytes(16), bytes(7)], [bytes(17), bytes(8)], [bytes(16)], [bytes(16), bytes(8), bytes(4)]):
        _check(heads, _request(_two(), raw))
    assert len(heads) == 1


@pytest.mark.parametrize("request_message", [
    _request(_two(), [bytes(16), bytes(8)], id="r1"),
    _request([Tensor(name="A", datatype="FP32", shape=[1, 4]),
              Tensor(name="B", datatype="INT32", shape=[1, 1], contents=pb.InferTensorContents(int_contents=[7]))],
             [], ),
    _request([*_two(1, 1), Tensor(name="S", datatype="BYTES", shape=[1, 1])],
             [bytes(16), bytes(4), b"\x02\x00\x00\x00hi"]),
], ids=["request id", "typed contents alone (no raw contents to match)", "BYTES"])
def test_heads_whose_result_depends_on_more_are_decoded_each_time(request_message: Any) -> None:
    heads = RequestHeads()
    _check(heads, request_message)
    assert len(heads) == 0


class _Slice:
    """A place in a region whose bytes the test changes between requests (what a client's own process does)."""

    def __init__(self, ref: RegionRef, store: dict[str, bytes]) -> None:
        self.ref = ref
        self._store = store

    def read(self) -> bytes:
        return self._store[self.ref.region][self.ref.offset:self.ref.offset + self.ref.byte_size]

    def write(self, output: str, data: bytes | memoryview) -> None:
        self._store[self.ref.region] = bytes(data)


class _Regions:
    def __init__(self) -> None:
        self.store: dict[str, bytes] = {}

    def slice(self, ref: RegionRef) -> _Slice:
        return _Slice(ref, self.store)


def test_what_a_region_holds_is_read_for_every_request() -> None:
    """An input from a region beside a raw one, and an output into a region: decoded each time."""
    regions, heads = _Regions(), RequestHeads()
    a = Tensor(name="A", datatype="FP32", shape=[1, 4])
    a.parameters["shared_memory_region"].string_param = "r"
    a.parameters["shared_memory_byte_size"].int64_param = 16
    b = Tensor(name="B", datatype="INT32", shape=[1, 2])
    for fill in (1, 2):
        regions.store["r"] = bytes([fill]) * 16
        got = heads.decode(_request([a, b], [bytes(8)]), SPEC, regions)
        assert bytes(got.inputs[0].data) == bytes([fill]) * 16
    y = pb.ModelInferRequest.InferRequestedOutputTensor(name="Y")
    y.parameters["shared_memory_region"].string_param = "r"
    y.parameters["shared_memory_byte_size"].int64_param = 16
    for _ in range(2):
        assert "Y" in heads.decode(_request(_two(), [bytes(16), bytes(8)], outputs=[y]), SPEC, regions).shm_outputs
    assert len(heads) == 0


def test_a_reloaded_config_is_checked_anew() -> None:
    heads = RequestHeads()
    heads.decode(_request(_two(), [bytes(16), bytes(8)]), SPEC, None)
    reloaded = parse_config(CONFIG.replace("dims: [ 4 ]", "dims: [ 5 ]", 1), source="test", model_name="m")
    with pytest.raises(ServingError) as refused:
        heads.decode(_request(_two(), [bytes(16), bytes(8)]), reloaded, None)
    assert "unexpected shape" in refused.value.message


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[Any], dict[str, Any], list[int]]:
    """Mostly valid requests for SPEC (so that many are kept and then known), each part sometimes wrong:
    (inputs, the request's other fields, each raw entry's size as the inputs declare it)."""
    def wrong() -> bool:
        return draw(st.integers(0, 5)) == 0

    rows = draw(st.integers(0, 9)) if wrong() else draw(st.integers(1, 8))
    inputs, sizes = [], []
    for name, datatype, width in (("A", "FP32", 4), ("B", "INT32", draw(st.integers(0, 3)))):
        if draw(st.integers(0, 9)) == 0:
            continue  # missing
        shape = draw(st.lists(st.integers(0, 5), max_size=3)) if wrong() else [rows, width]
        count = 1
        for d in shape:
            count *= d
        tensor = Tensor(name=name, datatype="FP64" if wrong() else datatype, shape=shape)
        if draw(st.integers(0, 9)) == 0:
            tensor.parameters["x"].int64_param = draw(st.integers(0, 3))
        if draw(st.integers(0, 9)) == 0:
            tensor.contents.int_contents.extend([1] * count)  # typed: beside raw contents, refused
        inputs.append(tensor)
        sizes.append(count * 4)
    if draw(st.integers(0, 5)) == 0:
        inputs.append(Tensor(name=draw(st.sampled_from(["S", "Q"])), datatype="BYTES", shape=[rows, 1]))
        sizes.append(6)
    other: dict[str, Any] = {}
    if draw(st.booleans()):
        other["outputs"] = [pb.ModelInferRequest.InferRequestedOutputTensor(name=name) for name in draw(
            st.lists(st.sampled_from(["Y", "Z", "W"]), max_size=2))]
    if draw(st.booleans()):
        other["parameters"] = {key: pb.InferParameter(int64_param=value) if isinstance(value, int)
                               else pb.InferParameter(string_param=value)
                               for key, value in draw(st.dictionaries(
                                   st.sampled_from(["priority", "timeout", "k", "triton_x"]),
                                   st.one_of(st.integers(-1, 3), st.text(max_size=2)), max_size=2)).items()}
    if draw(st.integers(0, 9)) == 0:
        other["id"] = draw(st.text(max_size=3))
    order = draw(st.permutations(range(len(inputs))))
    return [inputs[i] for i in order], other, [sizes[i] for i in order]


@settings(max_examples=300, deadline=None)
@given(request=requests(), strays=st.lists(st.lists(st.binary(max_size=40), max_size=3), min_size=1, max_size=3),
       data=st.data())
def test_every_request_decodes_as_decode_infer_decodes_it(request: tuple[list[Any], dict[str, Any], list[int]],
                                                          strays: list[list[bytes]], data: st.DataObject) -> None:
    """Whatever the fields, first seen or known, and whatever raw contents come with them: decode_infer's result
    or error, the same twice."""
    inputs, other, sizes = request
    fitting = data.draw(st.lists(st.tuples(*(st.binary(min_size=n, max_size=n) for n in sizes)).map(list),
                                 min_size=2, max_size=3))
    heads = RequestHeads()
    for raw in [*fitting, *strays]:
        for _ in range(2):  # the same again, through the entry it may have made
            _check(heads, _request(inputs, raw, **other))
