"""fleet/envelope.py's out-of-band form: an envelope whose tensors hold OUT_OF_BAND_BYTES or more is its
msgpack head followed by the tensors' own buffers (never copied on the way out), decoded into views of the
payload (never copied on the way in); a smaller one is the one msgpack map it always was; a malformed one
is refused as any malformed envelope is."""

from __future__ import annotations

import struct

import hiredis
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.envelope import (
    OUT_OF_BAND_BYTES,
    ReplyEnvelope,
    RequestEnvelope,
    WireTensor,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    reply_payload,
    request_payload,
)
from fleet.errors import InvalidInput
from fleet.parts import Parts
from fleet.redis_link import _pack

sizes = st.one_of(st.integers(0, 64), st.integers(OUT_OF_BAND_BYTES // 2, OUT_OF_BAND_BYTES + 64))
tensor_lists = st.lists(sizes, max_size=4).map(
    lambda ns: [WireTensor(f"T{i}", "UINT8", (n,), bytes((i + k) % 256 for k in range(n)) if n < 100
                           else bytes([i]) * n) for i, n in enumerate(ns)])


def _request(inputs: list[WireTensor]) -> RequestEnvelope:
    return RequestEnvelope(id="g:1", model="m", version=2, inputs=inputs, reply_to="fleet:reply:g",
                           enqueued_at_us=5, outputs=["O"], parameters={"k": [1, "x"]}, priority=1,
                           client_id="c", trace={"a": 1})


def _plain(tensors: list[WireTensor]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    return [(t.name, t.datatype, t.shape, bytes(t.data)) for t in tensors]


@settings(max_examples=60, deadline=None)
@given(tensor_lists)
def test_requests_and_replies_come_back_equal_in_either_form(tensors: list[WireTensor]) -> None:
    big = sum(len(t.data) for t in tensors) >= OUT_OF_BAND_BYTES
    env = _request(tensors)
    payload = request_payload(env)
    assert isinstance(payload, Parts) == big
    joined = encode_request(env)
    assert joined == (payload.join() if isinstance(payload, Parts) else payload)
    assert (joined[0] == 0xC1) == big
    back = decode_request(joined)
    assert _plain(back.inputs) == _plain(tensors)
    back.inputs = env.inputs
    assert back == env
    rep = ReplyEnvelope(id="g:1", model_version=2, outputs=tensors, parameters={"p": 1}, queue_us=3,
                        compute_us=4, trace={"b": 2}, final=False)
    rep_payload = reply_payload(rep)
    assert isinstance(rep_payload, Parts) == big
    got = decode_reply(encode_reply(rep))
    assert _plain(got.outputs or []) == _plain(tensors)
    got.outputs = rep.outputs
    assert got == rep


def test_a_small_envelope_is_the_one_msgpack_map_it_was() -> None:
    data = b"\x01" * (OUT_OF_BAND_BYTES - 1)
    payload = request_payload(_request([WireTensor("A", "UINT8", (len(data),), data)]))
    assert isinstance(payload, bytes)
    assert msgpack.unpackb(payload)["i"] == [["A", "UINT8", [len(data)], data]]


def test_large_tensors_are_written_from_their_own_buffers_and_read_as_views_of_the_payload() -> None:
    a = np.arange(OUT_OF_BAND_BYTES, dtype=np.uint8).tobytes()
    wide = memoryview(np.arange(100, dtype=np.float32))  # type: ignore[arg-type]  # a view of 4-byte elements: sent as its bytes
    payload = request_payload(_request([WireTensor("A", "UINT8", (len(a),), a),
                                        WireTensor("B", "FP32", (100,), wide)]))
    assert isinstance(payload, Parts) and len(payload) == 3
    assert payload[1] is a  # the very buffer, not a copy
    assert isinstance(payload[2], memoryview) and payload[2].format == "B" and payload[2].nbytes == 400
    assert np.shares_memory(np.frombuffer(payload[2], np.uint8), np.asarray(wide))
    joined = payload.join()
    back = decode_request(joined)
    for t in back.inputs:
        assert isinstance(t.data, memoryview) and t.data.obj is joined  # views of the payload: no copies
    assert bytes(back.inputs[1].data) == wide.tobytes()


def test_a_redis_command_carries_parts_as_one_bulk_string() -> None:
    payload = request_payload(_request([WireTensor("A", "UINT8", (OUT_OF_BAND_BYTES,), b"\x02" * OUT_OF_BAND_BYTES)]))
    assert isinstance(payload, Parts)
    packed = _pack(("XADD", "k", "*", "d", payload, "n", 1))
    assert isinstance(packed, list)
    assert b"".join(packed) == hiredis.pack_command(("XADD", "k", "*", "d", payload.join(), "n", 1))  # type: ignore[arg-type]
    assert all(any(p is part for p in packed) for part in payload)
    small = Parts((b"ab", memoryview(b"cd")))  # a Parts of any size goes out as its pieces
    assert b"".join(_pack(("SET", "k", small))) == hiredis.pack_command(("SET", "k", b"abcd"))  # type: ignore[arg-type]


def _oob(head: object, data: bytes, head_len: int | None = None) -> bytes:
    packed: bytes = msgpack.packb(head)
    return struct.pack("<BI", 0xC1, len(packed) if head_len is None else head_len) + packed + data


BASE = {"id": "a", "m": "m", "v": 1, "r": "reply", "t": 0}


@pytest.mark.parametrize("payload", [
    b"\xc1",  # shorter than its prefix
    b"\xc1\x00\x00",
    _oob({**BASE, "i": []}, b"", head_len=1000),  # a head longer than the envelope
    _oob({**BASE, "i": [["A", "UINT8", [4], 4]]}, b"abc"),  # fewer bytes than the sizes say
    _oob({**BASE, "i": [["A", "UINT8", [2], 2]]}, b"abcd"),  # more
    _oob({**BASE, "i": [["A", "UINT8", [2], -2]]}, b""),
    _oob({**BASE, "i": [["A", "UINT8", [2], b"ab"]]}, b""),  # in-band bytes where a size belongs
    _oob({**BASE, "i": [["A", "UINT8", [2], 2.0]]}, b"ab"),
    _oob({**BASE, "i": [["A", "UINT8"]]}, b""),
    _oob([1, 2], b""),
])
def test_malformed_out_of_band_envelopes_are_refused(payload: bytes) -> None:
    with pytest.raises(InvalidInput, match="malformed request envelope"):
        decode_request(payload)


def test_a_well_formed_out_of_band_request_from_another_encoder_decodes() -> None:
    env = decode_request(_oob({**BASE, "i": [["A", "UINT8", [2], 2], ["B", "UINT8", [0], 0], ["C", "BYTES", [1], 5]]},
                              b"ab" + b"\x01\x00\x00\x00z"))
    assert _plain(env.inputs) == [("A", "UINT8", (2,), b"ab"), ("B", "UINT8", (0,), b""),
                                  ("C", "BYTES", (1,), b"\x01\x00\x00\x00z")]


def test_a_malformed_out_of_band_reply_raises() -> None:
    with pytest.raises(ValueError, match="add up"):
        decode_reply(_oob({"id": "a", "o": [["A", "UINT8", [4], 4]]}, b"abc"))
    assert decode_reply(encode_reply(ReplyEnvelope(id="e", error_code="INTERNAL", error_message="x"))).error_code \
        == "INTERNAL"


def test_a_long_binary_http_body_is_its_json_header_and_the_outputs_own_buffers() -> None:
    """render_infer's Parts: the header, then each binary output's very buffer (a view of the reply's
    payload), byte for byte the body it joined before; a short body is still one bytes."""
    import json

    from fleet.kserve import LONG_BLOBS, parse_infer, render_infer
    from fleet.model_config import parse_config

    spec = parse_config('name: "b"\nbackend: "python"\nmax_batch_size: 0\n'
                        'input { name: "I" data_type: TYPE_UINT8 dims: [ -1 ] }\n'
                        'output { name: "A" data_type: TYPE_UINT8 dims: [ -1 ] }\n'
                        'output { name: "B" data_type: TYPE_UINT8 dims: [ -1 ] }\n',
                        source="b/config.pbtxt", model_name="b")
    header = json.dumps({"inputs": [{"name": "I", "datatype": "UINT8", "shape": [1], "data": [1]}],
                         "outputs": [{"name": "A", "parameters": {"binary_data": True}},
                                     {"name": "B", "parameters": {"binary_data": True}}]}).encode()
    req = parse_infer(header, None, spec)
    a, b = memoryview(b"\x05" * LONG_BLOBS), b"\x06" * 10
    body, hlen = render_infer("b", 1, req, [WireTensor("A", "UINT8", (LONG_BLOBS,), a),
                                            WireTensor("B", "UINT8", (10,), b)], {})
    assert isinstance(body, Parts) and hlen is not None and len(body) == 3
    assert body[1] is a and body[2] is b
    joined = body.join()
    assert joined[hlen:] == bytes(a) + b and body.nbytes == len(joined)
    assert [o["parameters"]["binary_data_size"] for o in json.loads(joined[:hlen])["outputs"]] == [LONG_BLOBS, 10]
    short, _ = render_infer("b", 1, req, [WireTensor("A", "UINT8", (10,), b), WireTensor("B", "UINT8", (10,), b)], {})
    assert isinstance(short, bytes)


def test_a_request_says_whether_its_sender_reads_out_of_band_replies() -> None:
    """Every sender since the out-of-band form says so ("ob"); a request from an older one (no "ob")
    decodes False, and a reply marked for such a reader stays one msgpack map however large."""
    env = _request([])
    assert msgpack.unpackb(encode_request(env))["ob"] == 1 and decode_request(encode_request(env)).reads_out_of_band
    old = msgpack.packb({**BASE, "i": []})  # as a gateway from before the form encodes it
    assert decode_request(old).reads_out_of_band is False
    env.reads_out_of_band = False
    assert "ob" not in msgpack.unpackb(encode_request(env))
    big = [WireTensor("O", "UINT8", (OUT_OF_BAND_BYTES,), b"\x03" * OUT_OF_BAND_BYTES)]
    in_band = reply_payload(ReplyEnvelope(id="a", outputs=big, out_of_band=False))
    assert isinstance(in_band, bytes)
    assert msgpack.unpackb(in_band)["o"] == [["O", "UINT8", [OUT_OF_BAND_BYTES], big[0].data]]


def test_byte_view_and_sizes_of_other_buffers() -> None:
    from fleet.parts import byte_view

    assert byte_view(memoryview(np.zeros((0, 3), np.float32))) == b""  # an empty view of another shape
    wide = memoryview(np.arange(4, dtype=np.int32))
    assert Parts((b"ab", wide)).nbytes == 18  # a view's size in bytes, not its length in elements
    payload = request_payload(_request([WireTensor("A", "UINT8", (OUT_OF_BAND_BYTES,), bytearray(OUT_OF_BAND_BYTES))]))
    assert isinstance(payload, Parts) and payload.nbytes == len(payload.join())
