"""gateway/grpc/response_heads.py: a reply's ModelInferResponse serialized from a kept head is, byte for byte, what
protobuf serializes for the message codec.py's encode_infer builds; what a head cannot make is left to it."""

from __future__ import annotations

from array import array
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.envelope import WireTensor
from fleet.kserve import ParsedInfer
from gateway.grpc.codec import encode_infer
from gateway.grpc.response_heads import ResponseHeads, varint
from gateway.grpc.service_proto import service_pb2 as pb


def parsed(client_id: str = "", shm_outputs: dict[str, Any] | None = None) -> ParsedInfer:
    return ParsedInfer(client_id=client_id, inputs=[], outputs=None, binary_outputs=frozenset(), binary_default=True,
                       shm_outputs=shm_outputs or {})


def protobufs(model: str, version: int, req: ParsedInfer, outputs: list[WireTensor]) -> bytes:
    return bytes(encode_infer(model, version, req, outputs, {}).SerializeToString())


names = st.text(min_size=1, max_size=12)
# Lengths across one, two and three varint bytes (128, 16,384), as bytes, as a view of a larger buffer, or as a
# view of 4-byte floats (its length in elements, not bytes).
def _data(n: int, kind: int) -> bytes | memoryview:
    if kind == 0:
        return b"\x07" * n
    if kind == 1:
        return memoryview(b"\x01" + b"\x09" * n)[1:]
    return memoryview(array("f", [1.5] * (n // 4)))


datas = st.builds(_data, st.integers(0, 20_000), st.integers(0, 2))
tensors = st.builds(WireTensor, names, st.sampled_from(["FP32", "INT64", "BYTES", "BOOL"]),
                    st.lists(st.integers(0, 2 ** 40), max_size=4).map(tuple), datas)


@settings(max_examples=200, deadline=None)
@given(names, st.integers(0, 2 ** 31), st.lists(st.lists(tensors, max_size=3), min_size=1, max_size=4))
def test_the_bytes_are_protobufs_first_seen_or_known(model: str, version: int,
                                                     replies: list[list[WireTensor]]) -> None:
    heads = ResponseHeads()
    for outputs in replies + replies:  # each reply first seen, then from its known head
        got = heads.serialize(model, version, parsed(), outputs, {})
        assert got == protobufs(model, version, parsed(), outputs)
        response = pb.ModelInferResponse.FromString(got)
        assert [bytes(t.data) for t in outputs] == list(response.raw_output_contents)
    assert len(heads) == len({tuple((t.name, t.datatype, t.shape) for t in outputs) for outputs in replies})


def test_a_head_is_kept_per_model_version_and_outputs() -> None:
    heads = ResponseHeads()
    a = [WireTensor("Y", "FP32", (1, 2), b"\x00" * 8)]
    b = [WireTensor("Y", "FP32", (2, 2), b"\x00" * 16)]  # another shape: another head
    for model, version, outputs in [("m", 1, a), ("m", 1, a), ("m", 2, a), ("n", 1, a), ("m", 1, b)]:
        assert heads.serialize(model, version, parsed(), outputs, {}) == protobufs(model, version, parsed(), outputs)
    assert len(heads) == 4


def test_what_a_head_does_not_make_is_left_to_protobuf() -> None:
    heads = ResponseHeads()
    outputs = [WireTensor("Y", "FP32", (1,), b"\x00" * 4)]
    assert heads.serialize("m", 1, parsed(), outputs, {"sequence_end": True}) is None  # response parameters
    assert heads.serialize("m", 1, parsed(client_id="req-7"), outputs, {}) is None  # an id: never seen again
    assert heads.serialize("m", 1, parsed(shm_outputs={"Y": object()}), outputs, {}) is None  # into a region
    assert len(heads) == 0


def test_the_least_recently_used_head_goes_first_past_the_capacity() -> None:
    heads = ResponseHeads(capacity=2)
    outputs = [WireTensor("Y", "FP32", (1,), b"\x00" * 4)]
    for model in ("a", "b", "a", "c"):  # "a" used again after "b": "b" goes
        heads.serialize(model, 1, parsed(), outputs, {})
    assert len(heads) == 2 and set(key[0] for key in heads._heads.keys()) == {"a", "c"}
    assert heads.serialize("b", 1, parsed(), outputs, {}) == protobufs("b", 1, parsed(), outputs)


def test_a_view_that_is_not_contiguous_is_left_to_protobuf() -> None:
    strided = memoryview(b"\x00\x01" * 8)[::2]
    outputs = [WireTensor("Y", "UINT8", (8,), strided)]
    assert ResponseHeads().serialize("m", 1, parsed(), outputs, {}) is None
    assert pb.ModelInferResponse.FromString(protobufs("m", 1, parsed(), outputs)).raw_output_contents == [b"\x00" * 8]


@given(st.integers(0, 2 ** 63))
def test_varint_is_protobufs(n: int) -> None:
    # A uint64 field is written as its tag and the value as a varint: protobuf's own encoding of n.
    message = pb.InferParameter(uint64_param=n)
    assert message.SerializeToString() == b"\x28" + varint(n)  # field 5, wire type 0
