"""The HTTP protocol's own infer path (gateway/infer_protocol.py) against the app's (gateway/fastpath.py),
through a real uvicorn server on a socket, the real app and worker, and the session's Redis: every request
here is sent twice, once as the protocol answers it (POST .../infer) and once through the app (the same
URL with an empty query, which the protocol leaves to the app), and both answers must be the same
bytes. A counting subclass of the protocol shows which path answered."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from bench.rawhttp import Connection
from fleet.redis_server import LocalServer, free_port
from gateway.http_protocol import protocol_class
from gateway.infer_protocol import LONG_BODY, serving_infer
from tests.integration.test_pipeline import MODELS, fp32_request
from tests.support.raw_http import answers, exchange
from tests.support.system import in_process_system

KEY = "k-7f3a"
SLOW_S = 2.0  # the `slow` model's execute()
LONG = 40_000  # floats in the long binary case
BRIEF_KEEP_ALIVE_S = 2  # T: `slow`, sent 0.6 T after an answer, is in flight when T has passed (0.6 T + SLOW_S > T)


@dataclass
class Gateway:
    port: int
    counts: dict[str, int]  # requests begun, by the path that runs them
    live: dict[str, Any]  # the server thread's state and protocol class, once up

    def both(self, target: bytes, body: bytes = b"", headers: bytes = b"", method: bytes = b"POST"
             ) -> tuple[bytes, bytes]:
        """`target`'s whole answer (status line, headers in order, body) from the protocol's path and from the
        app's (`target?`), each on a connection of its own; checks which path answered."""
        out = []
        for query, path in ((b"", "protocol"), (b"?", "app")):
            before = dict(self.counts)
            raw, closed = exchange(self.port, _request(method, target + query, body, headers), timeout_s=20)
            assert closed and len(answers(raw)) == 1, raw
            taken = [k for k in self.counts if self.counts[k] > before[k]]
            assert taken == [path], (target, taken)
            out.append(raw)
        return out[0], out[1]

    def idle(self) -> None:
        """Nothing in flight: no request held, no body bytes counted (polled: a closed connection is
        cleaned up by the server thread)."""
        state, protocol = self.live["state"], self.live["protocol"]
        deadline = time.monotonic() + 5
        while (state.dataplane.in_flight or protocol.budget.held) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (state.dataplane.in_flight, protocol.budget.held) == (0, 0)


def _request(method: bytes, target: bytes, body: bytes, headers: bytes, close: bool = True) -> bytes:
    return (method + b" " + target + b" HTTP/1.1\r\nhost: x\r\n" + headers
            + (b"connection: close\r\n" if close else b"") + b"content-length: %d\r\n\r\n" % len(body) + body)


def _repository(root: Path) -> Path:
    """The `doubler` test model, and `slow`: an identity that takes SLOW_S per execute."""
    shutil.copytree(MODELS / "doubler", root / "doubler")
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "config.pbtxt").write_text("""
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
""")
    (root / "slow" / "1" / "model.py").write_text(f"""
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({SLOW_S})
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                             .as_numpy())]) for r in requests]
""")
    return root


def _serve(redis_url: str, prefix: str, repository: Path, port: int, ready: threading.Event,
           stop: threading.Event, gateway: Gateway, failure: list[BaseException], overrides: dict[str, Any],
           keep_alive_s: int) -> None:
    counts = gateway.counts

    async def main() -> None:
        async with in_process_system(redis_url, prefix, [repository], **overrides) as s:
            base = serving_infer(protocol_class(s.settings), s.app.infer_handler, s.state, s.app.access)

            class Counting(base):  # type: ignore[valid-type,misc]
                def connection_made(self, transport: Any) -> None:
                    super().connection_made(transport)
                    # Under pytest, its capture handlers sit on uvicorn's access logger, so uvicorn would
                    # write access lines (which only the app's path does): off, as the gateway runs.
                    self.access_log = False

                async def _answer(self, *args: Any) -> None:
                    counts["protocol"] += 1
                    await super()._answer(*args)

                def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
                    counts["app"] += 1
                    super()._start_asgi_task(cycle, app)

            gateway.live.update(state=s.state, protocol=Counting)
            # As gateway/server.py configures it (no Date header: two answers a second apart stay equal).
            server = uvicorn.Server(uvicorn.Config(s.app, host="127.0.0.1", port=port, http=Counting, ws="none",
                                                   lifespan="off", log_config=None, log_level="warning",
                                                   access_log=False, server_header=False, date_header=False,
                                                   timeout_keep_alive=keep_alive_s))
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.02)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            server.should_exit = True
            await task

    try:
        asyncio.run(main())
    except BaseException as exc:  # the test thread reports it
        failure.append(exc)
        ready.set()


@pytest.fixture(scope="module")
def gateway(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from _gateway(redis_server, "inferproto", tmp_path_factory, {})


@pytest.fixture(scope="module")
def keyed(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from _gateway(redis_server, "inferkeyed", tmp_path_factory, {"api_keys": KEY})


@pytest.fixture(scope="module")
def brief(redis_server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A keep-alive timeout of BRIEF_KEEP_ALIVE_S (uvicorn's, which the gateway keeps: 5 s)."""
    yield from _gateway(redis_server, "inferbrief", tmp_path_factory, {}, BRIEF_KEEP_ALIVE_S)


def _gateway(redis_server: LocalServer, prefix: str, tmp_path_factory: pytest.TempPathFactory,
             overrides: dict[str, Any], keep_alive_s: int = 5) -> Iterator[Gateway]:
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    gateway = Gateway(port, {"protocol": 0, "app": 0}, {})
    failure: list[BaseException] = []
    repository = _repository(tmp_path_factory.mktemp("models"))
    thread = threading.Thread(target=_serve, args=(redis_server.url, prefix, repository, port, ready, stop, gateway,
                                                   failure, overrides, keep_alive_s), daemon=True)
    thread.start()
    assert ready.wait(120), "the gateway did not start"
    if failure:
        raise failure[0]
    yield gateway
    stop.set()
    thread.join(60)
    assert not failure, failure


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _binary(values: list[float]) -> tuple[bytes, bytes]:
    header = _json({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, len(values)],
                                "parameters": {"binary_data_size": 4 * len(values)}}],
                    "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}]})
    return header + struct.pack(f"<{len(values)}f", *values), b"inference-header-content-length: %d\r\n" % len(header)


CASES: dict[str, tuple[bytes, bytes, bytes]] = {  # name: (target, body, extra headers)
    "json": (b"/v2/models/doubler/infer", _json({"id": "a1", **fp32_request([[1, 2, 3]])}), b""),
    "version": (b"/v2/models/doubler/versions/1/infer", _json(fp32_request([[4.5]])), b""),
    "binary": (b"/v2/models/doubler/infer", *_binary([1.0, -2.0, 3.25])),
    # 160 KB each way: past the redis link's long arguments and the protocol's long bodies (own buffers)
    "binary, long": (b"/v2/models/doubler/infer", *_binary([float(i % 1000) - 500.5 for i in range(LONG)])),
    "gzip response": (b"/v2/models/doubler/infer", _json(fp32_request([[1, 2]])), b"accept-encoding: gzip\r\n"),
    "gzip request": (b"/v2/models/doubler/infer", gzip.compress(_json(fp32_request([[7, 8]]))),
                     b"content-encoding: gzip\r\n"),
    "wrong shape": (b"/v2/models/doubler/infer", _json({"inputs": [{"name": "IN", "datatype": "FP32",
                                                                      "shape": [1, 3], "data": [1, 2]}]}), b""),
    "unknown model": (b"/v2/models/nobody/infer", _json(fp32_request([[1]])), b""),
    "bad version": (b"/v2/models/doubler/versions/x/infer", _json(fp32_request([[1]])), b""),
    "empty version": (b"/v2/models/doubler/versions//infer", _json(fp32_request([[1]])), b""),
    "unknown version": (b"/v2/models/doubler/versions/9/infer", _json(fp32_request([[1]])), b""),
    "not json": (b"/v2/models/doubler/infer", b"{nope", b""),
    "empty body": (b"/v2/models/doubler/infer", b"", b""),
    "bad header length": (b"/v2/models/doubler/infer", b"{}", b"inference-header-content-length: 99\r\n"),
    "unknown encoding": (b"/v2/models/doubler/infer", b"{}", b"content-encoding: br2\r\n"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_protocol_answers_as_the_app_does(gateway: Gateway, case: str) -> None:
    target, body, headers = CASES[case]
    raw, from_app = gateway.both(target, body, headers)
    assert raw == from_app, case  # status line, every header in order, body
    (fast,) = answers(raw)
    assert fast.headers.get("connection") == "close"  # the client asked
    if case == "binary":
        length = int(fast.headers["inference-header-content-length"])
        assert struct.unpack("<3f", fast.body[length:]) == (2.0, -4.0, 6.5)
    elif case == "binary, long":
        length = int(fast.headers["inference-header-content-length"])
        assert len(fast.body) - length == 4 * LONG > LONG_BODY
        doubled = tuple(2 * (float(i % 1000) - 500.5) for i in range(LONG))
        assert struct.unpack(f"<{LONG}f", fast.body[length:]) == doubled
    elif case == "gzip response":
        assert fast.headers["content-encoding"] == "gzip" and fast.json()["outputs"][0]["data"] == [2, 4]
    elif fast.status == 200:
        sent = json.loads(gzip.decompress(body) if case == "gzip request" else body)
        assert fast.json()["outputs"][0]["data"] == [2 * v for row in sent["inputs"][0]["data"] for v in row]
    else:
        assert fast.status in (400, 404) and fast.error()
    gateway.idle()


def test_keep_alive_pipelining_and_bodies_that_arrive_later(gateway: Gateway) -> None:
    one = _json(fp32_request([[1]]))
    two = _json(fp32_request([[2]]))
    # Three requests in one write: the first answered by the protocol, the two pipelined behind it by
    # uvicorn's queue (the app), in order; then the connection closes as the last one asks.
    before = dict(gateway.counts)
    raw, closed = exchange(gateway.port, _request(b"POST", b"/v2/models/doubler/infer", one, b"", close=False)
                           + _request(b"POST", b"/v2/models/doubler/infer", two, b"", close=False)
                           + _request(b"POST", b"/v2/models/doubler/infer", one, b""))
    assert closed and [a.json()["outputs"][0]["data"] for a in answers(raw)] == [[2], [4], [2]]
    assert (gateway.counts["protocol"] - before["protocol"], gateway.counts["app"] - before["app"]) == (1, 2)
    # Sequential requests on one keep-alive connection, each sent once the answer before is read: all the
    # protocol's.
    before = dict(gateway.counts)

    async def sequential() -> list[Any]:
        connection = Connection("127.0.0.1", gateway.port)
        out = []
        for i in range(4):
            status, headers, payload = await connection.post("/v2/models/doubler/infer", fp32_request([[i]]))
            assert status == 200 and "connection" not in headers and connection.writer is not None
            out.append(json.loads(payload)["outputs"][0]["data"])
        connection.close()
        return out

    assert asyncio.run(sequential()) == [[0], [2], [4], [6]]
    assert (gateway.counts["protocol"] - before["protocol"], gateway.counts["app"] - before["app"]) == (4, 0)
    # Bodies the protocol's path reads as they come: chunked, in pieces; after a 100 Continue.
    body = _json(fp32_request([[3, 4]]))
    before = dict(gateway.counts)
    head = (b"POST /v2/models/doubler/infer HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    raw, _ = exchange(gateway.port, [head, b"%x\r\n%s\r\n" % (10, body[:10]),
                                     b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 10, body[10:])])
    assert answers(raw)[0].json()["outputs"][0]["data"] == [6, 8]
    head = (b"POST /v2/models/doubler/infer HTTP/1.1\r\nhost: x\r\nconnection: close\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    raw, _ = exchange(gateway.port, [head, body], gap_s=0.3)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert answers(raw)[0].json()["outputs"][0]["data"] == [6, 8]
    assert (gateway.counts["protocol"] - before["protocol"], gateway.counts["app"] - before["app"]) == (2, 0)
    # HTTP/1.0 is the app's, with the same answer.
    raw, closed = exchange(gateway.port, b"POST /v2/models/doubler/infer HTTP/1.0\r\ncontent-length: %d\r\n\r\n%s"
                           % (len(body), body))
    assert closed and answers(raw)[0].json()["outputs"][0]["data"] == [6, 8]
    gateway.idle()


def test_an_idle_connection_is_closed_the_keep_alive_timeout_after_its_last_answer(brief: Gateway) -> None:
    """The keep-alive timeout counts from the last answer (gateway/http_protocol.py keeps one timer per idle
    stretch, not one per request): a connection kept busy past the timeout of its first idle stretch, by a
    request in flight when that stretch's timer comes (`slow`, SLOW_S) and one after it, stays open, and once
    it idles it is closed that timeout after its last answer."""
    fast = _request(b"POST", b"/v2/models/doubler/infer", _json(fp32_request([[1]])), b"", close=False)
    slow = _request(b"POST", b"/v2/models/slow/infer",
                    _json({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [5]}]}), b"",
                    close=False)
    gap_s = 0.6 * BRIEF_KEEP_ALIVE_S

    async def main() -> tuple[list[float], float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", brief.port)
        answered: list[float] = []
        try:
            for request in (fast, slow, fast):
                if answered:
                    await asyncio.sleep(gap_s)
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
                assert head.startswith(b"HTTP/1.1 200 "), head
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                await asyncio.wait_for(reader.readexactly(length), 20)
                answered.append(time.monotonic())
            rest = await asyncio.wait_for(reader.read(), 10 * BRIEF_KEEP_ALIVE_S)  # until the server closes
            assert rest == b""
            return answered, time.monotonic()
        finally:
            writer.close()

    answered, closed = asyncio.run(main())
    assert answered[1] - answered[0] > BRIEF_KEEP_ALIVE_S  # the first stretch's timer came during `slow`
    assert BRIEF_KEEP_ALIVE_S - 0.3 <= closed - answered[2] <= BRIEF_KEEP_ALIVE_S + 1.5, closed - answered[2]
    brief.idle()


def test_a_target_that_is_not_ascii_is_a_400_that_gives_back_its_body_bytes(gateway: Gateway) -> None:
    """Refused by the parser, or by uvicorn in the parser's callback after the body's bytes were reserved:
    either way a 400, and nothing stays counted (left, they would add up to 503s for every body)."""
    body = _json(fp32_request([[1]]))
    for target in ("/v2/models/dé/infer", "/v2/models/doubler/versions/¹/infer", "/v2/models/d\u00e9/infer?q"):
        raw, closed = exchange(gateway.port, _request(b"POST", target.encode(), body, b""))
        (answer,) = answers(raw)
        assert closed and answer.status == 400 and answer.error().startswith("malformed HTTP request")
    gateway.idle()


def test_a_client_that_leaves_cancels_its_request(gateway: Gateway) -> None:
    """The protocol's path keeps the app's disconnect watch: a client that leaves while its request waits
    (past the watch's 50 ms) frees it at once, long before the model would have answered, and the
    gateway serves the next ones."""
    body = _json({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1], "data": [5]}]})
    before = dict(gateway.counts)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as s:
        s.sendall(_request(b"POST", b"/v2/models/slow/infer", body, b"", close=False))
        state = gateway.live["state"]
        deadline = time.monotonic() + 5
        while not state.dataplane.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state.dataplane.in_flight == 1
        time.sleep(0.3)  # past the disconnect watch's start
        left = time.monotonic()
    gateway.idle()
    assert time.monotonic() - left < SLOW_S / 2  # cancelled, not answered
    assert gateway.counts["protocol"] - before["protocol"] == 1
    raw, from_app = gateway.both(b"/v2/models/doubler/infer", _json(fp32_request([[5]])))
    assert raw == from_app and answers(raw)[0].json()["outputs"][0]["data"] == [10]


def test_with_keys_only_a_keyed_request_takes_the_protocol_path(keyed: Gateway) -> None:
    body = _json(fp32_request([[1.5]]))
    good = b"authorization: Bearer " + KEY.encode() + b"\r\n"
    raw, from_app = keyed.both(b"/v2/models/doubler/infer", body, good)
    assert raw == from_app and answers(raw)[0].json()["outputs"][0]["data"] == [3.0]
    for headers in (b"", b"authorization: Bearer nope\r\n", b"authorization: " + base64.b64encode(b"x") + b"\r\n"):
        before = dict(keyed.counts)
        raw, _ = exchange(keyed.port, _request(b"POST", b"/v2/models/doubler/infer", body, headers))
        (answer,) = answers(raw)
        assert answer.status == 401 and answer.headers["www-authenticate"] == 'Bearer realm="fleet"'
        assert (keyed.counts["protocol"] - before["protocol"], keyed.counts["app"] - before["app"]) == (0, 1)
    keyed.idle()
