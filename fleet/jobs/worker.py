"""`fleet jobs-worker`: an RQ worker on the bulk-jobs queue, plus the janitor that resumes jobs whose
runner died (every job worker runs one; a recovery key makes sure only one re-queues a given job).

The process outlives a Redis outage of any length, at start too. RQ's `Worker.work()` retries a lost
connection only while it waits for a job; anywhere else (registering itself at start, a job failing
because Redis went away, recording that failure, its teardown) it logs "unhandled exception, quitting"
and returns, or raises. Either way `serve` waits with capped backoff and starts a new RQ worker, until
a stop signal. A job that was running when Redis went away is resumed from its progress record: the
janitor queues its next run once its lease has lapsed, as for a job worker that died.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

import redis

from fleet.backoff import Backoff
from fleet.jobs.feed import STOP
from fleet.jobs.recovery import recover_orphans
from fleet.jobs.rq_setup import JobsWorker, jobs_worker
from fleet.jobs.runner import JobOptions
from fleet.keys import Keys
from fleet.logs import configure_logging
from fleet.settings import Settings

log = logging.getLogger(__name__)

JANITOR_INTERVAL_S = 2.0
# An RQ worker that ran this long before it stopped was healthy: the next restart starts the backoff over.
HEALTHY_RUN_S = 30.0


def _janitor(settings: Settings, stop: threading.Event) -> None:
    client = redis.Redis.from_url(settings.redis_url_or_default, protocol=2)
    keys, options = Keys(settings.key_prefix), JobOptions.from_settings(settings)
    while not stop.wait(JANITOR_INTERVAL_S):
        try:
            recover_orphans(client, keys, options)
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis away: try again next round
            log.warning("job janitor: Redis unreachable (%s)", exc)
        except Exception:
            log.exception("job janitor: recovery round failed")


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    STOP.set()


def _run_worker(settings: Settings, keys: Keys) -> None:
    """One RQ worker, from registration to teardown; returns when it stops, for whatever reason."""
    client = redis.Redis.from_url(settings.redis_url_or_default, protocol=2)
    worker: JobsWorker | None = None
    try:
        worker = jobs_worker(client, keys)  # registers its connection name: needs Redis already
        log.info("job worker %s on queue %s", worker.name, keys.rq_queue())
        if not STOP.is_set():
            worker.work(logging_level="INFO" if settings.log_verbose == 0 else "DEBUG", with_scheduler=False)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        log.warning("job worker: Redis unreachable (%s)", exc)
    finally:
        # Between RQ workers a stop signal only sets STOP (RQ's handlers would call into a worker that is gone).
        signal.signal(signal.SIGTERM, _stop_on_signal)
        signal.signal(signal.SIGINT, _stop_on_signal)
        thread = worker.pubsub_thread if worker is not None else None
        if thread is not None and thread.is_alive():
            thread.stop()  # a teardown that failed left RQ's pub/sub thread reconnecting for ever
        client.close()


def serve(settings: Settings) -> int:
    """Run RQ workers one after the other until SIGTERM/SIGINT; never exits because Redis is away."""
    configure_logging(settings, "jobs")
    os.nice(10)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)
    keys = Keys(settings.key_prefix)
    stop = threading.Event()
    janitor = threading.Thread(target=_janitor, args=(settings, stop), name="job-janitor", daemon=True)
    janitor.start()
    backoff = Backoff()
    try:
        while not STOP.is_set():
            started = time.monotonic()
            _run_worker(settings, keys)
            if STOP.is_set():
                break
            if time.monotonic() - started >= HEALTHY_RUN_S:
                backoff.reset()
            delay = backoff.next_delay()
            log.warning("job worker: the RQ worker stopped without a stop request (Redis away?); "
                        "starting another in %.2f s", delay)
            STOP.wait(delay)
    finally:
        stop.set()
    return 0
