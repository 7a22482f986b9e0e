"""bench/floor.py, the yardstick bench/compare.sh measures fleet against (`SYSTEMS="... floor ..."`): it
answers what perf_analyzer sends (binary tensors) with the right numbers for both of its models, in
request order on a connection, a malformed body with a 400, and SIGTERM stops it and everything it
started."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import tritonclient.http as httpclient

from bench.procs import children, running, stop
from fleet.redis_server import free_port
from tests.e2e.conftest import ROOT
from tests.support.mlp_direct import mlp_direct


def test_floor_answers_both_models_and_stops() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "floor.py"), "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        rng = np.random.default_rng(0)
        deadline = time.monotonic() + 120
        while True:  # until the gateway listens and the worker (which imports torch) answers
            assert proc.poll() is None, f"floor.py exited with {proc.returncode}"
            try:
                x = rng.standard_normal((1, 16)).astype(np.float32)
                inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
                inp.set_data_from_numpy(x)
                result = client.infer("double", [inp], timeout=5)
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert result.as_numpy("OUTPUT0").tolist() == (x * 2).tolist()
        assert client.get_model_metadata("mlp")["inputs"][0]["shape"] == [-1, 256]
        for rows in (1, 3):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            inp = httpclient.InferInput("INPUT0", [rows, 256], "FP32")
            inp.set_data_from_numpy(x)
            np.testing.assert_allclose(client.infer("mlp", [inp]).as_numpy("OUTPUT0"), mlp_direct(x), rtol=1e-5,
                                       atol=1e-6)
        _pipelined_replies_keep_their_order(port)
        started = [pid for pid, _ in children(proc.pid)]
        assert len(started) == 3  # Valkey, the gateway, the worker
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in started):
            assert time.monotonic() < deadline, started
            time.sleep(0.1)
    finally:
        client.close()
        stop(proc)


def _request(model: str, data: bytes) -> bytes:
    width = 256 if model == "mlp" else 16
    head = json.dumps({"id": model, "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, width],
                                                "parameters": {"binary_data_size": len(data)}}]}).encode()
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
            f"inference-header-content-length: {len(head)}\r\ncontent-length: {len(head) + len(data)}\r\n\r\n"
            ).encode() + head + data


def _responses(conn: socket.socket, n: int) -> list[tuple[bytes, bytes]]:
    """(status line, body) of the next n HTTP responses on `conn`."""
    buffer, out = b"", list[tuple[bytes, bytes]]()
    while len(out) < n:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            head = buffer[:end].split(b"\r\n")
            length = next(int(h.split(b":")[1]) for h in head if h.lower().startswith(b"content-length:"))
            if len(buffer) >= end + 4 + length:
                out.append((head[0], buffer[end + 4:end + 4 + length]))
                buffer = buffer[end + 4 + length:]
                continue
        chunk = conn.recv(65536)
        assert chunk, (out, buffer)
        buffer += chunk
    return out


def _pipelined_replies_keep_their_order(port: int) -> None:
    """mlp, then double, then a body of the wrong size, in one write: the worker answers double's batch
    first (and mlp's forward takes longer), but the responses come back in request order."""
    x = np.ones(256, np.float32).tobytes()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(_request("mlp", x) + _request("double", x[:64]) + _request("double", x[:10]))
        (mlp_status, mlp_body), (double_status, double_body), (bad_status, bad_body) = _responses(conn, 3)
    assert (mlp_status, double_status, bad_status) == (b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK",
                                                       b"HTTP/1.1 400 Bad Request"), bad_body
    assert b'"model_name":"mlp"' in mlp_body and b'"model_name":"double"' in double_body
    assert np.frombuffer(double_body[-64:], np.float32).tolist() == [2.0] * 16
