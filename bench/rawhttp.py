"""A minimal HTTP/1.1 keep-alive client for load generation (bench/overload.py, tests/e2e/test_faults.py).

httpx's connection pool costs the generator more CPU than fleet spends answering (its scheduling of
hundreds of waiting requests over hundreds of connections is quadratic), and a slow generator lets
keep-alive connections idle out under it. One object here is one connection, one request at a time.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

# uvicorn closes a keep-alive connection idle for 5 s; a request sent on it just then is lost to the race
# every HTTP client has to handle. Reconnecting before that stays out of it.
MAX_IDLE_S = 4.0


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_used = 0.0

    async def post(self, path: str, doc: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body); raises OSError / IncompleteReadError if the server goes."""
        if self.writer is not None and time.monotonic() - self.last_used > MAX_IDLE_S:
            self.close()
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        body = json.dumps(doc).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        self.last_used = time.monotonic()
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
