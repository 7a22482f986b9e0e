"""A job worker's stop is prompt: RQ's teardown stops its pub/sub thread, and since redis-py 8.2 that stop
waits for the thread's current read. RQ reads for up to 60 s; fleet's JobsWorker reads for 1 s."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from fleet.jobs.rq_setup import PUBSUB_POLL_S, jobs_worker
from fleet.keys import Keys
from fleet.redis_server import LocalServer


def test_a_stop_waits_at_most_one_short_read_for_the_pubsub_thread(redis_server: LocalServer, key_prefix: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    try:
        worker = jobs_worker(client, Keys(key_prefix), name=f"{key_prefix}-stop")
        worker.subscribe()
        time.sleep(0.2)  # the thread is in its read
        sent = worker.pubsub.unsubscribe

        def unsubscribe_then_lose_the_cpu(*args: Any) -> Any:
            # The race CI lost: the thread reads UNSUBSCRIBE's reply and starts its next read before the
            # teardown asks it to stop, so the stop waits for that whole read.
            result = sent(*args)
            time.sleep(0.3)
            return result

        monkeypatch.setattr(worker.pubsub, "unsubscribe", unsubscribe_then_lose_the_cpu)
        started = time.monotonic()
        worker.unsubscribe()
        took = time.monotonic() - started
        assert worker.pubsub_thread is not None and not worker.pubsub_thread.is_alive()
        assert took < 0.3 + PUBSUB_POLL_S + 2.0, took  # RQ's own worker: 60 s
    finally:
        client.close()
