"""`fleet jobs-worker`: an RQ worker on the bulk-jobs queue, plus the janitor that resumes jobs whose
runner died (every job worker runs one; a recovery key makes sure only one re-queues a given job)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import redis

from fleet.keys import Keys
from fleet.logs import configure_logging
from fleet.settings import Settings
from gateway.jobs.rq_setup import jobs_worker
from gateway.jobs.runner import JobOptions
from gateway.jobs.service import JobsContext, recover_orphans

log = logging.getLogger(__name__)

JANITOR_INTERVAL_S = 2.0


def job_options(settings: Settings) -> JobOptions:
    return JobOptions(key_prefix=settings.key_prefix,
                      model_repositories=[str(Path(r).resolve()) for r in settings.model_repositories],
                      window_rows=settings.job_window_rows, lease_ms=settings.job_lease_ms)


def jobs_context(client: redis.Redis, settings: Settings) -> JobsContext:
    return JobsContext(client, Keys(settings.key_prefix), Path(settings.jobs_dir).resolve(), job_options(settings),
                       tuple(Path(d).resolve() for d in settings.job_input_dirs))


def _janitor(settings: Settings, stop: threading.Event) -> None:
    client = redis.Redis.from_url(settings.redis_url_or_default, protocol=2)
    ctx = jobs_context(client, settings)
    while not stop.wait(JANITOR_INTERVAL_S):
        try:
            recover_orphans(ctx)
        except Exception:  # Redis away for a moment: try again next round
            log.exception("job janitor: recovery round failed")


def serve(settings: Settings) -> int:
    configure_logging(settings)
    os.nice(10)
    client = redis.Redis.from_url(settings.redis_url_or_default, protocol=2)
    stop = threading.Event()
    janitor = threading.Thread(target=_janitor, args=(settings, stop), name="job-janitor", daemon=True)
    janitor.start()
    worker = jobs_worker(client, Keys(settings.key_prefix))
    log.info("job worker %s on queue %s", worker.name, Keys(settings.key_prefix).rq_queue())
    try:
        worker.work(logging_level="INFO" if settings.log_verbose == 0 else "DEBUG", with_scheduler=False)
    finally:
        stop.set()
    return 0
