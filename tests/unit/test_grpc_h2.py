"""The gRPC server's HTTP/2 layer without sockets: HPACK decoding against the `hpack` library's encoder,
and H2Connection fed frames (any chunking) with an injected clock."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.grpc import h2
from gateway.grpc import h2_frames as wire
from gateway.grpc.calls import Call, decompress, parse_timeout, percent_encode
from gateway.grpc.handlers import Method, RpcError
from gateway.grpc.header_codec import HeaderDecoder, HeaderError, indexed, literal

# ---------------------------------------------------------------- HPACK

_names = st.sampled_from([b":path", b"content-type", b"te", b"grpc-timeout", b"authorization", b"x-custom",
                          b"user-agent", b"grpc-accept-encoding"]) | st.binary(min_size=1, max_size=20).map(
    lambda b: b.lower().replace(b":", b"x"))
_values = st.binary(max_size=60)
_header_lists = st.lists(st.tuples(_names, _values), max_size=12)


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(_header_lists, min_size=1, max_size=6), huffman=st.booleans(),
       table_size=st.sampled_from([0, 64, 256, 4096]))
def test_blocks_of_the_library_s_encoder_decode_to_their_fields(blocks: list[list[tuple[bytes, bytes]]],
                                                                huffman: bool, table_size: int) -> None:
    encoder = hpack.Encoder()
    if table_size != 4096:
        encoder.header_table_size = table_size  # announced in the next block (a size update)
    ours = HeaderDecoder()
    theirs = hpack.Decoder()
    for headers in blocks:
        block = encoder.encode(headers, huffman=huffman)
        decoded = ours.decode(block)
        assert decoded == headers
        assert decoded == [(bytes(k), bytes(v)) for k, v in theirs.decode(block, raw=True)]


def test_a_block_of_indexed_fields_is_cached_until_the_table_changes() -> None:
    encoder, decoder = hpack.Encoder(), HeaderDecoder()
    first = [(b":path", b"/inference.GRPCInferenceService/ModelInfer"), (b"te", b"trailers")]
    decoder.decode(encoder.encode(first))
    repeat = encoder.encode(first)
    assert all(b & 0x80 for b in repeat)  # indexed only
    assert decoder.decode(repeat) == first
    assert decoder.decode(repeat) is decoder.decode(repeat)
    # A new entry shifts the dynamic indices: the same bytes now mean other fields.
    decoder.decode(encoder.encode([(b"x-new", b"1")]))
    assert decoder.decode(repeat) != first


@pytest.mark.parametrize(("block", "fragment"), [
    (b"\x80", "index 0"),
    (b"\xff\x80", "ends inside an integer"),
    (b"\xfe", "does not exist"),
    (b"\x40\x05abc", "runs past the end"),
    (b"\x3f\xe2\x1f", "exceeds"),  # a table size update to 4097: past what SETTINGS allowed
    (b"\x82\x20", "after the first field"),
    (b"\xff\xff\xff\xff\xff\xff\xff\xff", "too long"),
])
def test_malformed_blocks_are_header_errors(block: bytes, fragment: str) -> None:
    with pytest.raises(HeaderError, match=fragment):
        HeaderDecoder().decode(block)


def test_a_header_list_over_the_limit_is_refused() -> None:
    block = hpack.Encoder().encode([(b"x-big", b"v" * 200)])
    with pytest.raises(HeaderError, match="exceeds 100 bytes"):
        HeaderDecoder(max_list_size=100).decode(block)


def test_what_the_server_sends_decodes_with_the_library() -> None:
    block = indexed(b":status", b"200") + literal(b"content-type", b"application/grpc") + \
        literal(b"grpc-message", b"x" * 300) + literal(b"x-own", b"1")
    assert hpack.Decoder().decode(block, raw=True) == [
        (b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-message", b"x" * 300),
        (b"x-own", b"1")]


# ---------------------------------------------------------------- frames


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return wire.frame(kind, flags, stream, payload)


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        kind, flags = data[pos + 3], data[pos + 4]
        stream = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        out.append((kind, flags, stream, data[pos + 9:pos + 9 + length]))
        pos += 9 + length
    return out


@dataclass
class Sink:
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: bool = False

    def on_data(self, data: bytes) -> None:
        self.data += data

    def on_end(self) -> None:
        self.ended = True

    def on_reset(self) -> None:
        self.reset = True


class Peer:
    """A client's side: encodes its header blocks, and the clock both sides read."""

    def __init__(self, **local: object) -> None:
        self.now = 0.0
        self.opened: dict[int, tuple[list[tuple[bytes, bytes]], Sink]] = {}
        self.conn = h2.H2Connection(wire.LocalSettings(**local), self._open, lambda: self.now)  # type: ignore[arg-type]
        self.encoder = hpack.Encoder()
        self.greeting = frames(self.conn.take_output())

    def _open(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> Sink:
        sink = Sink()
        self.opened[stream_id] = (headers, sink)
        return sink

    def handshake(self, *settings: tuple[int, int]) -> None:
        payload = b"".join(struct.pack(">HI", k, v) for k, v in settings)
        self.conn.receive(wire.PREFACE + frame(wire.SETTINGS, 0, 0, payload))

    def headers(self, stream: int, end_stream: bool = False, path: bytes = b"/svc/M") -> bytes:
        block = self.encoder.encode([(b":method", b"POST"), (b":path", path), (b"content-type", b"application/grpc")])
        return frame(wire.HEADERS, wire.END_HEADERS | (wire.END_STREAM if end_stream else 0), stream, block)

    def out(self) -> list[tuple[int, int, int, bytes]]:
        return frames(self.conn.take_output())


def test_the_server_speaks_first_and_acknowledges_the_client_s_settings() -> None:
    peer = Peer()
    kinds = [f[0] for f in peer.greeting]
    assert kinds == [wire.SETTINGS, wire.WINDOW_UPDATE]
    peer.handshake()
    assert peer.out() == [(wire.SETTINGS, wire.ACK, 0, b"")]


@pytest.mark.parametrize("start", [b"GET / HTTP/1.1\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"])
def test_anything_but_the_preface_is_a_protocol_error(start: bytes) -> None:
    with pytest.raises(wire.ConnectionError_) as caught:
        Peer().conn.receive(start)
    assert caught.value.code == wire.PROTOCOL_ERROR


def test_the_preface_must_be_followed_by_settings() -> None:
    with pytest.raises(wire.ConnectionError_, match="must start with SETTINGS"):
        Peer().conn.receive(wire.PREFACE + frame(wire.PING, 0, 0, b"12345678"))


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=20))
def test_a_request_arrives_whole_however_the_bytes_are_split(cuts: list[int]) -> None:
    peer = Peer()
    message = b"\x00\x00\x00\x00\x05hello"
    sent = wire.PREFACE + frame(wire.SETTINGS, 0, 0) + peer.headers(1) + frame(wire.DATA, 0, 1, message[:6]) + \
        frame(wire.DATA, wire.END_STREAM | wire.PADDED, 1, b"\x03" + message[6:] + b"\x00\x00\x00")
    pos = 0
    for cut in cuts:
        peer.conn.receive(sent[pos:pos + cut])
        pos += cut
    peer.conn.receive(sent[pos:])
    headers, sink = peer.opened[1]
    assert (b":path", b"/svc/M") in headers
    assert bytes(sink.data) == message and sink.ended


def test_headers_continue_across_continuation_frames() -> None:
    peer = Peer()
    peer.handshake()
    block = peer.encoder.encode([(b":method", b"POST"), (b":path", b"/svc/Long"), (b"x-pad", b"p" * 100)])
    peer.conn.receive(frame(wire.HEADERS, wire.END_STREAM, 1, block[:10]) +
                      frame(wire.CONTINUATION, 0, 1, block[10:50]) +
                      frame(wire.CONTINUATION, wire.END_HEADERS, 1, block[50:]))
    headers, sink = peer.opened[1]
    assert (b"x-pad", b"p" * 100) in headers and sink.ended


def test_a_header_block_interrupted_by_another_frame_is_a_protocol_error() -> None:
    peer = Peer()
    peer.handshake()
    block = peer.encoder.encode([(b":path", b"/svc/M")])
    with pytest.raises(wire.ConnectionError_, match="interrupted"):
        peer.conn.receive(frame(wire.HEADERS, 0, 1, block) + frame(wire.PING, 0, 0, b"12345678"))


@pytest.mark.parametrize(("sent", "code"), [
    (frame(wire.HEADERS, wire.END_HEADERS, 2, b"\x82"), wire.PROTOCOL_ERROR),  # a client opens odd streams only
    (frame(wire.DATA, 0, 0, b"x"), wire.PROTOCOL_ERROR),
    (frame(wire.DATA, 0, 7, b"x"), wire.PROTOCOL_ERROR),  # idle stream
    (frame(wire.SETTINGS, 0, 0, b"\x00\x05\x00\x00\x00\x01"), wire.PROTOCOL_ERROR),  # max frame size 1
    (frame(wire.SETTINGS, 0, 0, b"\x00\x04\xff\xff\xff\xff"), wire.FLOW_CONTROL_ERROR),
    (frame(wire.SETTINGS, 0, 0, b"\x00\x04\x00"), wire.FRAME_SIZE_ERROR),
    (frame(wire.PING, 0, 0, b"1234"), wire.FRAME_SIZE_ERROR),
    (frame(wire.WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), wire.PROTOCOL_ERROR),
    (frame(wire.WINDOW_UPDATE, 0, 0, b"\x7f\xff\xff\xff"), wire.FLOW_CONTROL_ERROR),
    (frame(wire.PUSH_PROMISE, 0, 1, b"\x00\x00\x00\x02"), wire.PROTOCOL_ERROR),
    (frame(wire.RST_STREAM, 0, 9, b"\x00\x00\x00\x08"), wire.PROTOCOL_ERROR),
    (frame(wire.HEADERS, wire.END_HEADERS, 1, b"\x80"), wire.COMPRESSION_ERROR),
    (b"\x10\x00\x01\x00\x00\x00\x00\x00\x00" + b"x" * 10, wire.FRAME_SIZE_ERROR),  # 1 MiB + 1: over the max
])
def test_connection_errors(sent: bytes, code: int) -> None:
    peer = Peer()
    peer.handshake()
    with pytest.raises(wire.ConnectionError_) as caught:
        peer.conn.receive(sent)
    assert caught.value.code == code


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=300))
def test_arbitrary_bytes_after_the_handshake_are_frames_or_a_connection_error(garbage: bytes) -> None:
    peer = Peer()
    peer.handshake()
    try:
        peer.conn.receive(garbage)
    except wire.ConnectionError_:
        pass


def test_sending_waits_for_the_peer_s_windows_and_frame_size() -> None:
    peer = Peer()
    peer.handshake((wire.SETTINGS_INITIAL_WINDOW_SIZE, 10))
    peer.out()
    peer.conn.receive(peer.headers(1, end_stream=True))
    peer.conn.send_headers(1, b"\x88")
    peer.conn.send_data(1, b"a" * 25)
    peer.conn.send_trailers(1, b"\x40")
    sent = peer.out()
    assert [(k, len(p)) for k, _, _, p in sent] == [(wire.HEADERS, 1), (wire.DATA, 10)]  # trailers wait for the data
    peer.conn.receive(frame(wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 10)))
    assert [(k, len(p)) for k, _, _, p in peer.out()] == [(wire.DATA, 10)]
    peer.conn.receive(frame(wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)))
    rest = peer.out()
    assert [(k, f, len(p)) for k, f, _, p in rest] == [(wire.DATA, 0, 5),
                                                       (wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 1)]
    assert 1 not in peer.conn.streams  # both sides closed


@pytest.mark.parametrize("window", [100, 10])
def test_a_unary_answer_goes_in_one_piece_or_waits_like_any_data(window: int) -> None:
    peer = Peer()
    peer.handshake((wire.SETTINGS_INITIAL_WINDOW_SIZE, window))
    peer.out()
    peer.conn.receive(peer.headers(1, end_stream=True))
    peer.conn.send_response(1, b"\x88", b"m" * 25, b"\x40")
    sent = [(k, f, len(p)) for k, f, _, p in peer.out()]
    if window >= 25:
        assert sent == [(wire.HEADERS, wire.END_HEADERS, 1), (wire.DATA, 0, 25),
                        (wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 1)]
        assert 1 not in peer.conn.streams
    else:
        assert sent == [(wire.HEADERS, wire.END_HEADERS, 1), (wire.DATA, 0, 10)]
        peer.conn.receive(frame(wire.WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)))
        assert [(k, len(p)) for k, _, _, p in peer.out()] == [(wire.DATA, 15), (wire.HEADERS, 1)]


def test_an_answer_to_a_reset_stream_is_dropped() -> None:
    peer = Peer()
    peer.handshake()
    peer.conn.receive(peer.headers(1))
    peer.conn.receive(frame(wire.RST_STREAM, 0, 1, struct.pack(">I", wire.CANCEL)))
    peer.out()
    peer.conn.send_response(1, b"\x88", b"late", b"\x40")
    assert peer.out() == []


def test_data_is_cut_to_the_peer_s_max_frame_size_and_the_connection_window() -> None:
    peer = Peer()
    peer.handshake((wire.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20))
    peer.out()
    peer.conn.receive(peer.headers(1, end_stream=True))
    peer.conn.send_data(1, b"b" * 70_000)
    sizes = [len(p) for k, _, _, p in peer.out() if k == wire.DATA]
    assert sizes == [16_384, 16_384, 16_384, 16_383]  # the connection window: 65,535 until the peer widens it
    peer.conn.receive(frame(wire.WINDOW_UPDATE, 0, 0, struct.pack(">I", 10_000)))
    assert [len(p) for k, _, _, p in peer.out() if k == wire.DATA] == [70_000 - 65_535]


def test_a_peer_sending_past_the_connection_window_is_a_flow_control_error() -> None:
    peer = Peer(connection_window=70_000)
    peer.handshake()
    peer.conn.receive(peer.headers(1))
    with pytest.raises(wire.ConnectionError_) as caught:
        peer.conn.receive(frame(wire.DATA, 0, 1, b"x" * 70_001))
    assert caught.value.code == wire.FLOW_CONTROL_ERROR


def test_received_data_is_returned_in_window_updates() -> None:
    peer = Peer(connection_window=100_000, initial_window=60_000)
    peer.handshake()
    peer.out()
    peer.conn.receive(peer.headers(1) + frame(wire.DATA, 0, 1, b"x" * 20_000))
    assert peer.out() == []  # less than half of either window: nothing returned yet
    peer.conn.receive(frame(wire.DATA, 0, 1, b"x" * 30_000))
    updates = {(s, struct.unpack(">I", p)[0]) for k, _, s, p in peer.out() if k == wire.WINDOW_UPDATE}
    assert updates == {(0, 50_000), (1, 50_000)}


def test_a_reset_reaches_the_stream_and_streams_past_the_limit_are_refused() -> None:
    peer = Peer(max_concurrent_streams=1)
    peer.handshake()
    peer.out()
    peer.conn.receive(peer.headers(1) + peer.headers(3))
    assert [(k, s, p) for k, _, s, p in peer.out()] == [(wire.RST_STREAM, 3, struct.pack(">I", wire.REFUSED_STREAM))]
    peer.conn.receive(frame(wire.RST_STREAM, 0, 1, struct.pack(">I", wire.CANCEL)))
    assert peer.opened[1][1].reset and 3 not in peer.opened
    peer.conn.receive(peer.headers(5))  # room again
    assert 5 in peer.opened


def test_after_goaway_new_streams_are_refused_and_the_last_one_is_named() -> None:
    peer = Peer()
    peer.handshake()
    peer.conn.receive(peer.headers(1))
    peer.out()
    peer.conn.goaway()
    peer.conn.receive(peer.headers(3))
    (goaway, reset) = peer.out()
    assert goaway[0] == wire.GOAWAY and struct.unpack(">II", goaway[3][:8]) == (1, wire.NO_ERROR)
    assert reset[0] == wire.RST_STREAM and reset[2] == 3


def test_pings_are_answered_and_too_many_without_data_end_the_connection() -> None:
    peer = Peer(min_recv_ping_interval_without_data_s=300.0, max_ping_strikes=2)
    peer.handshake()
    peer.conn.receive(peer.headers(1))  # a call in flight: pings are judged by the 300 s interval
    peer.out()
    for _ in range(3):  # the first ping and two strikes are tolerated
        peer.now += 1
        peer.conn.receive(frame(wire.PING, 0, 0, b"abcdefgh"))
        assert peer.out() == [(wire.PING, wire.ACK, 0, b"abcdefgh")]
    peer.conn.send_headers(1, b"\x88")  # the server sent something: the count starts again
    peer.conn.receive(frame(wire.PING, 0, 0, b"abcdefgh"))
    peer.now += 1
    peer.conn.receive(frame(wire.PING, 0, 0, b"abcdefgh"))
    peer.conn.receive(frame(wire.PING, 0, 0, b"abcdefgh"))
    with pytest.raises(wire.ConnectionError_, match="too_many_pings"):
        peer.conn.receive(frame(wire.PING, 0, 0, b"abcdefgh"))
    goaway = [f for f in peer.out() if f[0] == wire.GOAWAY]
    assert struct.unpack(">I", goaway[0][3][4:8])[0] == wire.ENHANCE_YOUR_CALM and goaway[0][3][8:] == b"too_many_pings"


def test_keepalive_pings_after_silence_and_gives_up_without_an_answer() -> None:
    peer = Peer(keepalive_time_s=10.0, keepalive_timeout_s=2.0, max_pings_without_data=2)
    peer.handshake()
    assert not peer.conn.keepalive_due()
    peer.now += 11
    assert not peer.conn.keepalive_due()  # no call, and pings without calls are not permitted
    peer.conn.receive(peer.headers(1))
    peer.now += 11
    assert peer.conn.keepalive_due()
    peer.conn.ping()
    assert not peer.conn.keepalive_due() and not peer.conn.keepalive_expired()
    peer.conn.receive(frame(wire.PING, wire.ACK, 0, b"fleetkap"))  # answered
    peer.now += 11
    peer.conn.ping()  # the second without data between
    peer.now += 11
    assert not peer.conn.keepalive_due()
    assert peer.conn.keepalive_expired()  # no answer within 2 s: the server closes the connection


# ---------------------------------------------------------------- call details


@pytest.mark.parametrize(("value", "seconds"), [(b"100m", 0.1), (b"5S", 5.0), (b"2M", 120.0), (b"1H", 3600.0),
                                                (b"250u", 250e-6), (b"99999999n", 0.099999999), (b"100", None),
                                                (b"123456789m", None), (b"-1S", None), (b"1x", None)])
def test_grpc_timeouts(value: bytes, seconds: float | None) -> None:
    assert parse_timeout(value) == (pytest.approx(seconds) if seconds is not None else None)


def test_grpc_messages_are_percent_encoded() -> None:
    assert percent_encode("Request for unknown model: 'x'") == b"Request for unknown model: 'x'"
    assert percent_encode("50% → done\n") == b"50%25 %E2%86%92 done%0A"


def test_decompression_is_bounded_and_unknown_encodings_are_unimplemented() -> None:
    import zlib
    bomb = zlib.compress(b"\x00" * 100_000)
    assert decompress(bomb, b"deflate", 100_000) == b"\x00" * 100_000
    with pytest.raises(RpcError, match="larger than max"):
        decompress(bomb, b"deflate", 1000)
    with pytest.raises(RpcError, match="'snappy' is not supported"):
        decompress(bomb, b"snappy", 1000)
    with pytest.raises(RpcError, match="Failed to decompress"):
        decompress(b"not gzip", b"gzip", 1000)


def test_a_header_block_over_the_peer_s_frame_size_continues_in_continuation_frames() -> None:
    peer = Peer()
    peer.handshake()
    peer.conn.receive(peer.headers(1, end_stream=True))
    peer.out()
    block = literal(b"grpc-status", b"13") + literal(b"grpc-message", b"m" * 40_000)
    peer.conn.send_headers(1, block, end_stream=True)
    sent = [f for f in peer.out() if f[0] in (wire.HEADERS, wire.CONTINUATION)]
    assert [k for k, *_ in sent] == [wire.HEADERS, wire.CONTINUATION, wire.CONTINUATION]
    assert all(len(p) <= wire.DEFAULT_MAX_FRAME for *_, p in sent)
    assert sent[0][1] == wire.END_STREAM and sent[-1][1] == wire.END_HEADERS  # END_HEADERS on the last only
    assert hpack.Decoder().decode(b"".join(p for *_, p in sent), raw=True)[1] == (b"grpc-message", b"m" * 40_000)


def test_goaway_is_sent_once_per_code_and_never_names_a_later_stream() -> None:
    peer = Peer()
    peer.handshake()
    peer.conn.receive(peer.headers(1))
    peer.out()
    peer.conn.goaway()
    peer.conn.receive(peer.headers(3))  # refused, but it raises the last stream seen
    peer.conn.goaway()
    peer.conn.goaway(wire.PROTOCOL_ERROR, "bad")
    peer.conn.goaway(wire.PROTOCOL_ERROR, "bad")
    goaways = [struct.unpack(">II", p[:8]) for k, _, _, p in peer.out() if k == wire.GOAWAY]
    assert goaways == [(1, wire.NO_ERROR), (1, wire.PROTOCOL_ERROR)]


def test_a_truncated_compressed_message_is_refused() -> None:
    import gzip as gz
    whole = gz.compress(b"a message of some length" * 10)
    with pytest.raises(RpcError, match="truncated"):
        decompress(whole[:len(whole) // 2], b"gzip", 10_000)


class _Recorder:
    """What a Call writes, in place of an H2Connection."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool = False) -> None:
        self.sent.append(("headers", block))

    def send_trailers(self, stream_id: int, block: bytes) -> None:
        self.sent.append(("trailers", block))


class _Connection:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.max_message_bytes = 1 << 20
        self.h2 = _Recorder()
        self.ended: list[int] = []

    def wrote(self) -> None:
        pass

    def call_ended(self, stream_id: int) -> None:
        self.ended.append(stream_id)


def test_a_call_cancelled_before_its_task_runs_is_still_answered() -> None:
    async def never(raw: bytes, context: object) -> bytes:
        raise AssertionError("the handler never starts")

    async def main() -> None:
        conn = _Connection()
        call = Call(conn, 1, Method("M", unary=never), [], None, b"identity", None)  # type: ignore[arg-type]
        call.on_data(b"\x00\x00\x00\x00\x02hi")
        call.on_end()  # the task is created...
        call.cancel()  # ...and cancelled in the same loop turn, before its first step
        await asyncio.sleep(0.01)
        assert call.done and conn.ended == [1]
        ((kind, block),) = conn.h2.sent
        assert (b"grpc-status", b"14") in hpack.Decoder().decode(block, raw=True)

    asyncio.run(main())
