"""A Redis connection of its own for the request path: a batch of commands written at once and their
replies read in order, straight on one redis-py connection.

A round trip through redis-py's pipeline cost the client ~125 µs of CPU here, against ~55 µs for the same
commands through a link, and ~25 µs for a bare exchange (bench/redis_client.py).
The difference is the pipeline object, the pool's get and release, the retry wrapper, the observability
hooks, the response callbacks, and the 5 s `socket_timeout` redis-py 8 sets by default, which puts every
send through `asyncio.wait_for` (a task and a timer on Python 3.11). The gateway's enqueue and reply read
and the worker's read and reply write are one round trip each per batch, so they go through links.

- Commands are packed by hiredis (C), their arguments bytes, str, int or float, as redis-py takes them.
- The connection is made with the client's pool settings (the URL's AUTH/ACL user, TLS, unix socket) but is
  not in the pool: it is the link's alone, opened on first use.
- One round trip at a time (callers that batch gather while one is in flight). A round trip has one
  deadline, `timeout_s` plus the BLOCK of a blocking read, in place of redis-py's per-send and per-read
  socket timeout. Past it, on a connection error, or when the caller is cancelled, the connection is closed
  (its unread replies would otherwise answer the next commands) and the next round trip opens another. A
  connection found closed (Redis restarted while it sat idle) is replaced and the round trip tried once
  more, as redis-py's retry does. The error raised is redis-py's (ConnectionError, TimeoutError: both
  RedisError), as every caller handles already.
- Replies are Redis's own (RESP2, bytes), without redis-py's response callbacks: an XREAD entry is
  `[id, [field, value, ...]]` (`entry_field` reads one field). An error reply is that command's result, a
  ResponseError, as redis-py's `execute(raise_on_error=False)` gives it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["DEFAULT_TIMEOUT_S", "Command", "RedisLink", "entry_field", "raise_first"]

# A Redis that has not answered a round trip in this long is taken for gone (redis-py's own default
# socket timeout, which the link's connection no longer has).
DEFAULT_TIMEOUT_S = 5.0

Command = Sequence[bytes | str | int | float]


class RedisLink:
    def __init__(self, client: aioredis.Redis, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._conn = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        self._conn.socket_timeout = None  # the round trip's one deadline instead
        self._lock = asyncio.Lock()
        self.timeout_s = timeout_s

    async def execute(self, commands: Sequence[Command], block_ms: int = 0) -> list[Any]:
        """Each command's reply in order (a ResponseError for an error reply). `block_ms`: the longest BLOCK
        among them, added to the deadline."""
        if not commands:
            return []
        deadline_s = self.timeout_s + block_ms / 1000
        # hiredis's packer (C): the same bytes as redis-py's, at a seventh of its cost.
        # (hiredis's stub types the argument as a 1-tuple; any length is taken.)
        packed = [hiredis.pack_command(c if isinstance(c, tuple) else tuple(c)) for c in commands]  # type: ignore[arg-type]
        async with self._lock:
            reused = self._conn.is_connected
            try:
                return await self._round_trip(packed, len(commands), deadline_s)
            except RedisConnectionError:
                # A connection Redis closed while it sat idle (Redis restarted): once more on a new one,
                # as redis-py's own retry does. Commands may then run twice if the first attempt reached
                # Redis before it went away, as with redis-py: a request enqueued twice is computed twice
                # and answered once (replies are by id), a batch's statistics may count twice.
                if not reused:
                    raise
                return await self._round_trip(packed, len(commands), deadline_s)

    async def _round_trip(self, packed: list[bytes], count: int, deadline_s: float) -> list[Any]:
        """Write, then read `count` replies; on any failure the connection is closed (what is unread on it
        would answer the next commands) and the error raised, a timeout as redis-py's TimeoutError."""
        conn = self._conn
        try:
            async with asyncio.timeout(deadline_s):
                await conn.send_packed_command(packed, check_health=False)
                replies: list[Any] = []
                for _ in range(count):
                    try:
                        replies.append(await conn.read_response(disconnect_on_error=False))
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
        except TimeoutError:
            await conn.disconnect(nowait=True)
            raise RedisTimeoutError(f"Redis did not answer within {deadline_s:g}s") from None
        except BaseException:
            await conn.disconnect(nowait=True)
            raise

    async def aclose(self) -> None:
        await self._conn.disconnect()


def raise_first(replies: list[Any]) -> list[Any]:
    """`replies`, once none is an error reply (the first one is raised): as redis-py's `execute()`."""
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


def entry_field(fields: list[bytes] | None, name: bytes) -> bytes | None:
    """Field `name` of a stream entry's raw field list (None for an entry deleted since it was delivered)."""
    if fields:
        for i in range(0, len(fields) - 1, 2):
            if fields[i] == name:
                return fields[i + 1]
    return None
