"""The gateway's HTTP edge (gateway/http_protocol.py) against real gateway processes over raw sockets: slow
clients, the size of heads and bodies, the body bytes a process holds, protocol errors as JSON, and a
fuzzer of the raw HTTP/1.1 a client may send.

Three gateways share one Redis and one worker, each with the limits its tests need lowered through the
environment, as an operator would set them: `slow` (read timeout 2 s, a head at most 4 s), `budget`
(300 kB of bodies in flight) and `fuzz` (read timeout 0.3 s, so that a request the fuzzer left
unfinished costs little time).
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bench.rawhttp import Connection
from fleet.redis_server import free_port
from tests.support.processes import Cluster
from tests.support.raw_http import Answer, answers, exchange

ROOT = Path(__file__).resolve().parents[2]
MODEL = "doubler"  # OUT = 2 * IN, FP32 [-1]
INFER = b"/v2/models/doubler/infer"
MAX_INPUT = 1_000_000
MAX_UPLOAD = 3_000_000
MAX_HEAD = 65536  # the default FLEET_MAX_HEADER_BYTES
BUDGET = 300_000
READ_TIMEOUT_S, HEAD_MAX_S = 2.0, 4.0  # the slow gateway's
KEEP_ALIVE_S = 5.0  # uvicorn's default timeout_keep_alive, which the gateway keeps
ENV = {"FLEET_KEY_PREFIX": "edge", "FLEET_MAX_INPUT_BYTES": str(MAX_INPUT),
       "FLEET_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}


@dataclass
class Edge:
    cluster: Cluster
    slow: int  # ports
    budget: int
    fuzz: int

    def up(self) -> None:
        """Every gateway process is still running."""
        assert all(g is not None and g.poll() is None for g in [self.cluster.gateway, *self.cluster.extra_gateways]), \
            self.cluster.logs()


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 8192 and (hard == resource.RLIM_INFINITY or hard > soft):
        # 1,000 slow clients hold a socket each here and in the gateway, which inherits this limit.
        resource.setrlimit(resource.RLIMIT_NOFILE, (8192 if hard == resource.RLIM_INFINITY else min(8192, hard), hard))
    tmp = tmp_path_factory.mktemp("edge")
    repo = tmp / "models"
    (repo / MODEL / "1").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "models" / MODEL / "1" / "model.py", repo / MODEL / "1" / "model.py")
    (repo / MODEL / "config.pbtxt").write_text("""
backend: "python"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
""")
    c = Cluster(tmp, repo, ENV)
    budget, fuzz = free_port(), free_port()
    c.start_redis()
    c.start_gateway({"FLEET_READ_TIMEOUT_S": str(READ_TIMEOUT_S), "FLEET_HEADER_TIMEOUT_MAX_S": str(HEAD_MAX_S)})
    c.start_gateway({"FLEET_MAX_IN_FLIGHT_BYTES": str(BUDGET)}, http_port=budget)
    c.start_gateway({"FLEET_READ_TIMEOUT_S": "0.3", "FLEET_HEADER_TIMEOUT_MAX_S": "0.6"}, http_port=fuzz)
    c.start_worker()
    try:
        for port in (c.http_port, budget, fuzz):
            c.wait_ready(base_url=f"http://127.0.0.1:{port}")
        yield Edge(c, c.http_port, budget, fuzz)
    finally:
        c.stop()


def _infer_body(values: list[float], request_id: str = "") -> bytes:
    doc: dict[str, object] = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, len(values)],
                                          "data": values}]}
    if request_id:
        doc["id"] = request_id
    return json.dumps(doc).encode()


def _post(target: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (target, len(body), extra, body))


def _one(port: int, pieces: bytes | list[bytes], timeout_s: float = 10.0) -> Answer:
    """The single answer to `pieces`, after which the server must have closed the connection."""
    stream, closed = exchange(port, pieces, timeout_s)
    assert closed, f"the connection is still open after {timeout_s} s: {stream[:300]!r}"
    (answer,) = answers(stream)
    return answer


# --- slow clients ------------------------------------------------------------------------------------------


async def _latencies(port: int, n: int, until: float | None = None) -> list[float]:
    """Up to `n` requests' latencies on one connection; with `until` (monotonic s), none started after it
    once 10 are measured (a loaded host must not run the measurement past the slow clients' timeouts)."""
    conn = Connection("127.0.0.1", port)
    doc = json.loads(_infer_body([1.0, 2.0]))
    took: list[float] = []
    try:
        for _ in range(n):
            if until is not None and len(took) >= 10 and time.monotonic() > until:
                break
            t0 = time.monotonic()
            status, _, payload = await conn.post(INFER.decode(), doc)
            took.append(time.monotonic() - t0)
            assert status == 200 and json.loads(payload)["outputs"][0]["data"] == [2.0, 4.0], payload
    finally:
        conn.close()
    return took


async def _slow_client(port: int, kind: str) -> tuple[str, float, float, bytes]:
    """(kind, when it connected, when the server closed, what it answered): `idle` sends nothing, `half` half
    a head, `drip` a whole head and then its body a byte every 0.25 s, `kept` one whole request and then
    nothing, keeping the connection alive."""
    opened = time.monotonic()  # before the server accepts, which starts its clock
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if kind == "half":
        writer.write(b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: x\r\nContent-Ty")
    elif kind == "drip":
        writer.write(b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    elif kind == "kept":
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    reading = asyncio.ensure_future(reader.read())  # until the server closes
    try:
        while kind == "drip" and not reading.done() and time.monotonic() - opened < 30:
            await asyncio.wait([reading], timeout=0.25)
            if not reading.done():
                writer.write(b" ")
        answer = await asyncio.wait_for(reading, 30)
        return kind, opened, time.monotonic(), answer
    finally:
        writer.close()


def test_slow_clients_get_408_after_the_read_timeouts_while_others_keep_their_latency(edge: Edge) -> None:
    """1,000 connections that send nothing, half a head, or a body a byte at a time are closed once their
    read timeout (2 s, extended 1 s per 500 bytes received; a head at most 4 s) has passed, with a JSON
    408 for those that had sent something; requests on another connection meanwhile keep their latency.
    A connection idle between requests keeps uvicorn's keep-alive timeout (5 s), and gets no 408."""

    async def main() -> tuple[list[float], list[float], float, list[tuple[str, float, float, bytes]]]:
        before = await _latencies(edge.slow, 60)
        kinds = ["idle"] * 100 + ["half"] * 450 + ["drip"] * 450 + ["kept"] * 20
        started = time.monotonic()
        clients = [asyncio.ensure_future(_slow_client(edge.slow, kind)) for kind in kinds]
        await asyncio.sleep(0.5)  # all connected and sending
        # Measured while every slow client is still open: they are closed 2 s (the read timeout) after
        # they connected, so no request starts past 1.5 s (10 at least).
        during = await _latencies(edge.slow, 60, until=started + 1.5)
        measured = time.monotonic()
        return before, during, measured, await asyncio.gather(*clients)

    before, during, measured, clients = asyncio.run(main())
    held = [round(closed - opened, 2) for _, opened, closed, _ in clients]
    print(f"\np50 alone {statistics.median(before) * 1000:.2f} ms, beside 1,000 slow clients "
          f"{statistics.median(during) * 1000:.2f} ms; slow clients closed after {min(held)}-{max(held)} s")
    assert measured < min(closed for _, _, closed, _ in clients), "measured after the slow clients were gone"
    for kind, opened, closed, answer in clients:
        if kind == "kept":
            assert KEEP_ALIVE_S - 0.1 <= closed - opened <= KEEP_ALIVE_S + 3, (kind, closed - opened)
            assert [a.status for a in answers(answer)] == [200]
            continue
        assert READ_TIMEOUT_S - 0.1 <= closed - opened <= HEAD_MAX_S + 3, (kind, closed - opened)
        if kind == "idle":
            assert answer == b""  # nothing was asked: closed as an idle connection is
        else:
            (a,) = answers(answer)
            what = "head" if kind == "half" else "body"
            assert a.status == 408 and f"did not send the request {what}" in a.error(), a
    # The 1,000 clients share this test's event loop with the measuring one, so a loaded host adds to what is
    # measured here; a server held up by the slow clients would add their timeouts (seconds).
    assert statistics.median(during) <= max(3 * statistics.median(before), statistics.median(before) + 0.1)
    edge.up()


# --- the size of a head ------------------------------------------------------------------------------------


def _get(size: int, target: bytes = b"/v2/health/live") -> bytes:
    """A GET whose request line and headers are exactly `size` bytes."""
    start, end = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nX-Pad: ", b"\r\nConnection: close\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def test_a_head_over_the_limit_is_a_json_431_however_it_arrives(edge: Edge) -> None:
    """The head is counted on the wire before the parser sees it: exactly FLEET_MAX_HEADER_BYTES is served,
    one byte more is 431, whether it comes in one read (the parser would have taken it whole) or split
    anywhere, the final CRLFCRLF included; a long URL too; a head pipelined behind another as well."""
    fits, over = _get(MAX_HEAD), _get(MAX_HEAD + 1)
    assert len(fits) == MAX_HEAD
    for pieces in ([fits], [fits[:1000], fits[1000:MAX_HEAD - 3], fits[MAX_HEAD - 3:]]):
        assert _one(edge.slow, pieces).status == 200
    big = _get(80_000)
    for pieces in ([over], [over[:MAX_HEAD - 2], over[MAX_HEAD - 2:]], [_get(100_000)], [big[:40_000], big[40_000:]]):
        a = _one(edge.slow, pieces)
        assert a.status == 431 and a.headers["connection"] == "close", ([len(p) for p in pieces], a)
        assert a.error() == f"request line and headers exceed the limit of {MAX_HEAD} bytes"
    a = _one(edge.slow, _get(70_000, b"/v2/health/live?" + b"q" * 66_000))
    assert a.status == 431 and "exceed the limit" in a.error(), a
    # Pipelined in one read behind a small request: the second head is counted too.
    stream, closed = exchange(edge.slow, _get(200).replace(b"Connection: close\r\n", b"") + _get(100_000))
    assert closed and [a.status for a in answers(stream)] == [200, 431], stream[:500]
    edge.up()


# --- protocol errors ---------------------------------------------------------------------------------------

MALFORMED = [
    (b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n", "invalid method"),
    (b"GET / HTTP/7.1\r\nHost: x\r\n\r\n", "invalid http version"),
    (b"GET /v2/health/live HTTP/1.1\nHost: x\n\n", "expected crlf"),
    (b"GET /v2/health/live HTTP/1.1\r\nX: a\x01b\r\n\r\n", "invalid header value char"),
    (b"GET /v2/health/live HTTP/1.1\r\nBad Name: x\r\n\r\n", "invalid header token"),
    (b"GET /v2/\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n", "url"),
    (b"POST /v2/models/doubler/infer HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "content-length"),
    (b"POST /v2/models/doubler/infer HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab",
     "duplicate content-length"),
    (b"POST /v2/models/doubler/infer HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
     "content-length overflow"),
    (b"POST /v2/models/doubler/infer HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
     "can't be present with"),
    (b"POST /v2/models/doubler/infer HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", "transfer-encoding"),
    (b"POST /v2/models/doubler/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
     "invalid character in chunk size"),
    (b"POST /v2/models/doubler/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
     "chunk"),
]


@pytest.mark.parametrize(("request_bytes", "says"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_a_request_the_parser_refuses_is_a_json_400_that_says_why(edge: Edge, request_bytes: bytes,
                                                                    says: str) -> None:
    a = _one(edge.slow, request_bytes)
    assert a.status == 400 and a.headers["connection"] == "close", a
    message = a.error()
    assert message.startswith("malformed HTTP request: ") and says in message.lower(), message
    edge.up()


# --- the size of a body ------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_from_its_content_length_before_it_is_sent(edge: Edge) -> None:
    """Answered from the head alone (nothing of the body is ever sent here); job uploads have their own,
    larger limit; a chunked body, with no length announced, is refused once it passes the limit."""
    t0 = time.monotonic()
    a = _one(edge.slow, b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
             % (MAX_INPUT + 1), timeout_s=3)
    assert time.monotonic() - t0 < 1.5
    assert a.status == 413 and a.headers["connection"] == "close", a
    assert a.error() == f"the request body of {MAX_INPUT + 1} bytes exceeds the limit of {MAX_INPUT} bytes"

    # Pipelined behind a request still being answered, the refusal waits its turn (HTTP/1.1 answers in order).
    stream, closed = exchange(edge.slow, _post(INFER, _infer_body([2.0], "first"))
                              + b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (INFER, MAX_INPUT + 1))
    first, refused = answers(stream)
    assert closed and first.status == 200 and first.json()["outputs"][0]["data"] == [4.0], first
    assert refused.status == 413, refused
    # A client that asked before sending its body (Expect: 100-continue) is refused without a 100 Continue.
    stream, closed = exchange(edge.slow, b"POST %s HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                              b"Content-Length: %d\r\n\r\n" % (INFER, MAX_INPUT + 1), timeout_s=3)
    assert closed and stream.startswith(b"HTTP/1.1 413 "), stream

    upload = b"/v2/jobs/uploads?name=edge.jsonl"
    a = _one(edge.slow, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (upload, MAX_UPLOAD + 1))
    assert a.status == 413 and f"exceeds the limit of {MAX_UPLOAD} bytes" in a.error(), a
    line = _infer_body([1.0]) + b"\n"
    body = line * (MAX_INPUT // len(line) + 10)
    a = _one(edge.slow, _post(upload, body, b"Connection: close\r\n"))
    assert a.status == 201 and a.json()["bytes"] == len(body) > MAX_INPUT, a

    head = b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (100_000, b"x" * 100_000)
    a = _one(edge.slow, [head, chunk * 11 + b"0\r\n\r\n"])
    assert a.status == 413 and a.error() == f"the request body exceeds the limit of {MAX_INPUT} bytes", a
    # Under the limit, chunked bodies are served as any other.
    body = _infer_body([3.0])
    stream, closed = exchange(edge.slow, head.replace(b"Host: x", b"Host: x\r\nConnection: close")
                              + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (5, body[:5], len(body) - 5, body[5:]))
    (a,) = answers(stream)
    assert closed and a.status == 200 and a.json()["outputs"][0]["data"] == [6.0], a
    edge.up()


def test_the_body_bytes_a_gateway_holds_are_bounded(edge: Edge) -> None:
    """FLEET_MAX_IN_FLIGHT_BYTES (300 kB here): a request whose announced body would take the process past
    it is 503 with Retry-After at once, before its body is read; a chunked one once it passes it; the
    bytes count until the request holding them is answered; a body that could never fit is 413."""
    def over_budget(a: Answer) -> bool:
        return a.status == 503 and a.headers.get("retry-after") == "1" and "FLEET_MAX_IN_FLIGHT_BYTES" in a.error()

    def head(length: int) -> bytes:
        return b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" \
            % length

    with socket.create_connection(("127.0.0.1", edge.budget), timeout=10) as holder:
        holder.sendall(head(200_000) + b"x" * 100_000)  # holds 200 kB until it is answered
        time.sleep(1.0)  # for the gateway to read the holder's head (0.3 s is short on a loaded host)
        t0 = time.monotonic()
        assert over_budget(_one(edge.budget, head(150_000), timeout_s=3))
        assert time.monotonic() - t0 < 1.5
        chunked = b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"%x\r\n%s\r\n" % (60_000, b"x" * 60_000)
        assert over_budget(_one(edge.budget, [chunked, piece, piece]))
        # What fits beside it passes the edge (and the app then finds it is not JSON).
        for _ in range(2):  # the second: the first one's bytes were given back when it was answered
            small = _one(edge.budget, head(50_000) + b"x" * 50_000)
            assert small.status == 400 and "malformed" not in small.error(), small
        holder.sendall(b"x" * 100_000)
        holder.settimeout(10)
        (answered,) = answers(_read_to_close(holder))
        assert answered.status == 400, answered
    a = _one(edge.budget, head(150_000) + b"x" * 150_000)
    assert a.status == 400 and "malformed" not in a.error(), a  # the holder's bytes are back in the budget
    a = _one(edge.budget, head(BUDGET + 1), timeout_s=3)
    assert a.status == 413 and f"exceeds the limit of {BUDGET} bytes" in a.error(), a
    edge.up()


def _read_to_close(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


# --- fuzzing the raw protocol ------------------------------------------------------------------------------

# 408: a request the fuzzer left unfinished; 413: a chunked body over the limit; 404/405: wrong routes.
ALLOWED = {200, 400, 404, 405, 408, 413, 431}
CLOSE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
exact_floats = st.integers(-1000, 1000).map(lambda i: i / 4)  # exact in FP32 and in JSON
FAULTS = ["method", "target", "version", "header", "body", "framing", "framing", "framing"]
BAD_HEADERS = [b"Expect: 100-continue", b"X-Bad\x01: y", b"X: \x7f", b"X: a\rb", b"Accept-Encoding: gzip",
               b"Content-Encoding: gzip", b"Content-Encoding: br", b": empty", b" Leading: space",
               b"X-Long: " + b"b" * 70_000, b"Connection: close", b"Transfer-Encoding: chunked", b"Host: y",
               b"Inference-Header-Content-Length: 5", b"Inference-Header-Content-Length: -5"]


@st.composite
def _framed(draw: st.DrawFn, head: bytes, body: bytes, well_formed: bool) -> bytes:
    """`head` (its request line and headers, without the blank line) with `body` framed by a
    Content-Length or chunked, correctly if `well_formed`, else perhaps not."""
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
        sizes = [b"%x" % len(p) for p in pieces]
        terminator = b"0\r\n\r\n"
        if not well_formed:
            bad = st.sampled_from([b"zz", b"-1", b"ffffffffffffffffffff", b"", b"1 ;x", b"0x10",
                                   b"%x" % (len(body) + 7)])
            sizes = [draw(bad) if draw(st.booleans()) else s for s in sizes]
            terminator = draw(st.sampled_from([terminator, b"0\r\n", b"", b"0\r\nX: y\r\n\r\n"]))
        chunks = b"".join(b"%s\r\n%s\r\n" % (s, p) for s, p in zip(sizes, pieces, strict=True))
        return head + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + terminator
    lengths = [b"%d" % len(body)]
    if not well_formed:
        lengths = draw(st.sampled_from([
            lengths, [], [b"-1"], [b"99999999999999999999999"], [b"%d" % (MAX_INPUT + 1)], lengths * 2,
            [lengths[0], b"%d" % (len(body) + 1)], [b"%d" % max(0, len(body) - 3)], [b"%d" % (len(body) + 2)],
            [b"abc"], [b" %d " % len(body)], [b"0x10"]]))
    return head + b"".join(b"\r\nContent-Length: " + n for n in lengths) + b"\r\n\r\n" + body


@st.composite
def _request(draw: st.DrawFn, sent: dict[str, list[float]]) -> tuple[bytes, bool]:
    """(one request's bytes, whether it is well-formed). Valid infer requests carry an id and are recorded
    in `sent`, so whatever answers them can be checked value by value."""
    kind = draw(st.sampled_from(["infer", "infer", "health", "mangled"]))
    if kind == "health":
        return b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n", True
    if kind == "infer":
        values = draw(st.lists(exact_floats, min_size=1, max_size=6))
        request_id = f"r{len(sent)}"
        sent[request_id] = values
        target = draw(st.sampled_from([INFER, b"/v2/models/doubler/versions/1/infer"]))
        return draw(_framed(b"POST " + target + b" HTTP/1.1\r\nHost: x", _infer_body(values, request_id), True)), True
    # A plausible request with one to three things wrong (a wrong body alone is still well-framed).
    request_id = f"m{len(sent)}"
    sent[request_id] = [1.0]
    method, target, version, headers, body = b"POST", INFER, b"HTTP/1.1", [b"Host: x"], _infer_body([1.0], request_id)
    framed_well = True
    for fault in draw(st.lists(st.sampled_from(FAULTS), min_size=1, max_size=3)):
        if fault == "method":
            method = draw(st.sampled_from([b"GET", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"G T", b"", b"\x00POST"]))
        elif fault == "target":
            target = draw(st.sampled_from([
                b"/v2/health/live", b"/v2/models/doubler", b"/nope", b"*", b"", b"http://x/v2/health/live",
                INFER + b"?x=%zz", b"/a b", b"/" + b"a" * 70_000, b"/v2/models/doubler/versions/x/infer"]))
        elif fault == "version":
            version = draw(st.sampled_from([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.x", b"http/1.1", b""]))
        elif fault == "header":
            headers.append(draw(st.sampled_from(BAD_HEADERS)))
        elif fault == "body":
            ragged = b'{"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1]}]}'
            body = draw(st.sampled_from([_infer_body([1.0])[:-3], b"", b"\xff\xfe{}", b"[]", ragged])
                        | st.binary(max_size=64))
        else:
            framed_well = False
    head = b"%s %s %s" % (method, target, version) + b"".join(b"\r\n" + h for h in headers)
    return draw(_framed(head, body, framed_well)), False


@st.composite
def _conversation(draw: st.DrawFn) -> tuple[list[bytes], dict[str, list[float]], int]:
    """(pieces to send on one connection, the infer requests among them, how many requests they hold if
    all are well-formed, else 0)."""
    sent: dict[str, list[float]] = {}
    requests = draw(st.lists(_request(sent), min_size=1, max_size=3))
    stream = b"".join(r for r, _ in requests) + CLOSE
    cuts = sorted(set(draw(st.lists(st.integers(1, len(stream) - 1), max_size=2))))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return pieces, sent, len(requests) + 1 if all(ok for _, ok in requests) else 0


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                  HealthCheck.data_too_large])
@given(conversation=_conversation())
def test_fuzzing_the_raw_protocol(edge: Edge, conversation: tuple[list[bytes], dict[str, list[float]], int]
                                  ) -> None:
    """Generated HTTP/1.1 on one connection (mangled request lines, headers, Content-Length values, chunked
    framing; pipelined, sent in pieces): the gateway stays up, answers with well-formed responses only,
    each error a JSON `{"error": ...}`, and closes the connection in bounded time; every infer it
    answers 200 carries its own request's values doubled; well-formed requests are all answered 200."""
    pieces, sent, well_formed = conversation  # well_formed: the number of requests, or 0
    stream, closed = exchange(edge.fuzz, pieces, timeout_s=10, gap_s=0.01)
    assert closed, f"still open after 10 s: {stream[:300]!r}"
    got = answers(stream)
    answered: set[str] = set()
    for a in got:
        event(f"answered {a.status}")
        assert a.status in ALLOWED, a
        if a.status != 200:
            a.error()
            continue
        doc = a.json()
        if "outputs" in doc and "model_name" in doc:  # an infer response (metadata has "outputs" too)
            request_id = doc.get("id")
            assert request_id in sent and request_id not in answered, doc
            answered.add(request_id)
            assert doc["outputs"][0]["data"] == [2 * v for v in sent[request_id]], (doc, sent[request_id])
    if well_formed:
        assert [a.status for a in got] == [200] * well_formed and answered == set(sent), got
    edge.up()
