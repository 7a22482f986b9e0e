"""instance_group `count: 2` runs two instances at once (README, "Batching"): two requests sent together
run in two different stub processes, with overlapping executions. Real Redis, the gateway app and a real
worker; the timed model reports each execution's PID and interval."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fleet.redis_server import LocalServer
from tests.support.system import in_process_system
from tests.support.timed_repo import Execution, timed_repository, timed_request

SLEEP_MS = 400


def parent_pid(pid: int) -> int:
    # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its ")".
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_two_instances_run_two_requests_at_once(redis_server: LocalServer, key_prefix: str,
                                                tmp_path: Path) -> None:
    # No dynamic batcher: one request per execution, so only a second instance can run the second one.
    repo = timed_repository(tmp_path, "pair", max_batch_size=0, dynamic_batching=None, instances=2)

    async def main() -> None:
        async with in_process_system(redis_server.url, key_prefix, [repo]) as s:
            responses = await asyncio.gather(*(s.client.post("/v2/models/pair/infer",
                                                             json=timed_request(SLEEP_MS + i, batched=False))
                                               for i in range(2)))
            assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
            first, second = (Execution.of(r.json()) for r in responses)
            assert (first.value, second.value) == (SLEEP_MS, SLEEP_MS + 1)
            # Two stub processes, both children of this (the worker's) process, neither the worker itself.
            assert first.pid != second.pid
            assert {parent_pid(first.pid), parent_pid(second.pid)} == {os.getpid()}
            # Running at the same time: each started before the other ended.
            assert max(first.start_ns, second.start_ns) < min(first.end_ns, second.end_ns), (first, second)
            assert min(first.end_ns - first.start_ns, second.end_ns - second.start_ns) >= SLEEP_MS * 1_000_000

    asyncio.run(main())
