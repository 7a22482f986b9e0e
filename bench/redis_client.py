"""What one Redis round trip costs the client process: redis-py (as fleet builds its clients) against a
bare exchange on the same event loop, CPU time per command.

    .venv/bin/python bench/redis_client.py [--n 3000] [--passes 3]

It starts its own Valkey (the embedded server, no AOF, a free port on 127.0.0.1) and, on uvloop as the
gateway and the workers run, times one small XADD (a 5-byte field) answered before the next is sent:
  redis-py pipeline    `client.pipeline(transaction=False)`, one XADD, `execute()` (the gateway's enqueue)
  redis-py command     `await client.xadd(...)`
  ... socket_timeout=None   the same with no socket timeout: redis-py 8 defaults it to 5 s, and then wraps
                       every send in `asyncio.wait_for` (a task and a timer on Python 3.11) and every read in
                       `asyncio.timeout`
  fleet RedisLink      fleet/redis_link.py, what the request path uses: the commands written and the replies
                       parsed (hiredis) on the streams of a redis-py connection of its own, one deadline
                       timer per link
  bare                 the RESP bytes written on an asyncio stream, the reply parsed by hiredis: the floor
Printed: CPU µs per command (process time, median of the passes; the server's time is not in it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import hiredis
import redis.asyncio as aioredis
import uvloop
from summary import print_table  # bench/summary.py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fleet.redis_clients import async_client  # noqa: E402
from fleet.redis_link import RedisLink  # noqa: E402
from fleet.redis_server import start_server  # noqa: E402

KEY = "bench:redis-client"
XADD = b"*5\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n$1\r\nd\r\n$5\r\nhello\r\n" % (len(KEY), KEY.encode())


async def cpu_per_call(call: Callable[[], Awaitable[object]], n: int) -> float:
    await call()  # connect, warm up
    started = time.process_time()
    for _ in range(n):
        await call()
    return (time.process_time() - started) / n * 1e6


async def measure(url: str, host: str, port: int, n: int) -> dict[str, float]:
    client = async_client(url)
    bare_client = aioredis.Redis.from_url(url, protocol=2, decode_responses=False, socket_timeout=None)

    def round_trips(c: aioredis.Redis) -> tuple[Callable[[], Awaitable[object]], Callable[[], Awaitable[object]]]:
        async def pipeline() -> object:
            pipe = c.pipeline(transaction=False)
            pipe.xadd(KEY, {b"d": b"hello"})
            return await pipe.execute()

        async def command() -> object:
            return await c.xadd(KEY, {b"d": b"hello"})

        return pipeline, command

    pipeline, command = round_trips(client)
    pipeline_no_timeout, command_no_timeout = round_trips(bare_client)
    link = RedisLink(client)

    async def linked() -> object:
        return await link.execute([("XADD", KEY, "*", "d", b"hello")])

    reader, writer = await asyncio.open_connection(host, port)
    parser = hiredis.Reader()

    async def bare() -> object:
        writer.write(XADD)
        while (reply := parser.gets()) is False:
            parser.feed(await reader.read(65536))
        return reply

    out = {}
    for name, call in (("redis-py pipeline", pipeline), ("redis-py command", command),
                       ("redis-py pipeline, socket_timeout=None", pipeline_no_timeout),
                       ("redis-py command, socket_timeout=None", command_no_timeout),
                       ("fleet RedisLink (fleet/redis_link.py)", linked), ("bare (hiredis)", bare)):
        out[name] = await cpu_per_call(call, n)
        await client.delete(KEY)
    writer.close()
    await link.aclose()
    await client.aclose()
    await bare_client.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="CPU per Redis round trip: redis-py against a bare exchange")
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--passes", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), appendonly=False)
        try:
            runs = [uvloop.run(measure(server.url, "127.0.0.1", server.port, a.n)) for _ in range(a.passes)]
        finally:
            server.stop()
    rows = [[name, f"{statistics.median(r[name] for r in runs):.1f}", " ".join(f"{r[name]:.1f}" for r in runs)]
            for name in runs[0]]
    print_table(f"Client CPU per XADD round trip, {a.n} per pass, uvloop", ["client", "median µs", "passes µs"], rows)


if __name__ == "__main__":
    main()
