"""Raw HTTP/1.1 over a socket, for tests of the gateway's connection-level behaviour: bytes go out exactly
as given (in separate reads, if asked), everything is read until the server closes, and what came back
is parsed strictly, so a malformed or truncated response fails the test."""

from __future__ import annotations

import gzip
import json
import re
import socket
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_STATUS = re.compile(rb"HTTP/1\.1 ([1-5]\d\d) [\x20-\x7e]*")
_HEADER = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([\x20-\x7e]*?)[ \t]*")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def error(self) -> str:
        """The `{"error": "..."}` message of an error answer; fails unless it is exactly that, as JSON."""
        assert self.headers.get("content-type") == "application/json", self
        doc = json.loads(self.body)
        assert isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"], self
        return str(doc["error"])

    def json(self) -> Any:
        """The body as JSON, after its Content-Encoding (gzip or deflate) if it has one."""
        encoding = self.headers.get("content-encoding", "identity")
        body = gzip.decompress(self.body) if encoding == "gzip" else \
            zlib.decompress(self.body) if encoding == "deflate" else self.body
        return json.loads(body)


def exchange(port: int, pieces: bytes | Sequence[bytes], timeout_s: float = 10.0, gap_s: float = 0.05
             ) -> tuple[bytes, bool]:
    """Sends `pieces` (a pause of `gap_s` between them, so the server reads each on its own), then reads
    until the server closes the connection. (what came back, whether it closed within `timeout_s`)."""
    if isinstance(pieces, bytes):
        pieces = [pieces]
    received = bytearray()
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for i, piece in enumerate(pieces):
                if i:
                    time.sleep(gap_s)
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking everything: what it answered is read below
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(received), False
            s.settimeout(left)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return bytes(received), False
            except ConnectionResetError:
                return bytes(received), True
            if not chunk:
                return bytes(received), True
            received += chunk


def answers(stream: bytes) -> list[Answer]:
    """Every final response in `stream` in order (interim 1xx responses skipped). Fails unless the stream
    is whole, well-formed responses, each framed by one Content-Length or by chunked encoding."""
    out: list[Answer] = []
    at = 0
    while at < len(stream):
        end = stream.find(b"\r\n\r\n", at)
        assert end >= 0, f"a truncated response head: {stream[at:at + 200]!r}"
        status_line, *lines = stream[at:end].split(b"\r\n")
        match = _STATUS.fullmatch(status_line)
        assert match, f"not an HTTP/1.1 status line: {status_line[:200]!r}"
        headers: dict[str, str] = {}
        lengths = []
        for line in lines:
            header = _HEADER.fullmatch(line)
            assert header, f"a malformed header line: {line[:200]!r}"
            name, value = header.group(1).decode().lower(), header.group(2).decode()
            headers[name] = value
            if name == "content-length":
                lengths.append(value)
        at = end + 4
        status = int(match.group(1))
        if status < 200:
            assert not lengths, "an interim response with a body"
            continue
        if headers.get("transfer-encoding", "").lower() == "chunked":
            assert not lengths, "both Content-Length and chunked"
            body = bytearray()
            while True:
                line_end = stream.find(b"\r\n", at)
                assert line_end >= 0, "a truncated chunk size"
                size = int(stream[at:line_end], 16)
                chunk_start = line_end + 2
                assert stream[chunk_start + size:chunk_start + size + 2] == b"\r\n", "a truncated chunk"
                body += stream[chunk_start:chunk_start + size]
                at = chunk_start + size + 2
                if size == 0:
                    break
            out.append(Answer(status, headers, bytes(body)))
            continue
        assert len(lengths) == 1 and lengths[0].isdigit(), f"no single Content-Length: {headers}"
        length = int(lengths[0])
        assert at + length <= len(stream), f"a truncated body ({len(stream) - at} of {length} bytes)"
        out.append(Answer(status, headers, stream[at:at + length]))
        at += length
    return out
