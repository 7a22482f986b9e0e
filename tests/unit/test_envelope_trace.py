"""Trace timestamps in the envelope (fleet/envelope.py): carried only by traced requests and their
replies; an untraced request's bytes hold nothing more than before tracing existed."""

from __future__ import annotations

import msgpack
import pytest

from fleet.envelope import (
    ReplyEnvelope,
    RequestEnvelope,
    WireTensor,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from fleet.errors import InvalidInput
from fleet.trace_points import REPLY_WRITE, WORKER_READ


def request(trace: dict[str, int] | None) -> RequestEnvelope:
    return RequestEnvelope(id="g:1", model="m", version=1, inputs=[WireTensor("A", "FP32", (1,), b"\x00" * 4)],
                           reply_to="r", enqueued_at_us=5, trace=trace)


def test_untraced_envelopes_carry_no_trace_field() -> None:
    assert "tr" not in msgpack.unpackb(encode_request(request(None)))
    assert "tr" not in msgpack.unpackb(encode_reply(ReplyEnvelope(id="g:1", outputs=[])))
    assert decode_request(encode_request(request(None))).trace is None


def test_traced_envelopes_round_trip_their_timestamps() -> None:
    env = request({})
    assert decode_request(encode_request(env)).trace == {}
    env.trace = {WORKER_READ: 1_700_000_000_000_000_001}
    assert decode_request(encode_request(env)) == env
    rep = ReplyEnvelope(id="g:1", outputs=[], trace={WORKER_READ: 1, REPLY_WRITE: 2})
    assert decode_reply(encode_reply(rep)) == rep


def test_a_malformed_trace_is_a_malformed_envelope() -> None:
    payload = msgpack.packb({**msgpack.unpackb(encode_request(request(None))), "tr": {"A": "x"}})
    with pytest.raises(InvalidInput, match="malformed request envelope"):
        decode_request(payload)
