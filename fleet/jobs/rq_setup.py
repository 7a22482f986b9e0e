"""The one place RQ objects are built: every Queue, Worker and Job.fetch uses RQ's JSON serializer, so
nothing a job carries is ever pickled or unpickled (the job function takes only JSON arguments)."""

from __future__ import annotations

from types import FrameType
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from fleet.jobs.feed import STOP
from fleet.keys import Keys

RUN_JOB = "fleet.jobs.runner.run_job"  # by name: RQ imports it in the job worker
# RQ retries a lost connection while it waits for a job, doubling from 1 s up to this (RQ's own default
# is 60 s: a worker could sit a minute idle after Redis is back). fleet's Backoff caps at 2 s too.
MAX_CONNECTION_WAIT_S = 2.0
# How long RQ's pub/sub thread blocks in one read. RQ uses 60 s; since redis-py 8.2 stopping that thread
# waits for its read to end, so RQ's teardown (and a stop signal) could take up to a minute.
PUBSUB_POLL_S = 1.0


def jobs_queue(client: redis.Redis, keys: Keys) -> Queue:
    return Queue(keys.rq_queue(), connection=client, serializer=JSONSerializer)


class JobsWorker(SimpleWorker):
    """SimpleWorker runs the job in this process: a kill of the job worker is a kill of the job (no
    orphaned work horse still writing), and the runner's lease makes the resume exact. A stop request
    (SIGTERM/SIGINT) also tells a running bulk job to save its progress and return, instead of RQ's warm
    shutdown waiting for a job that may run for hours; the job is resumed by the next job worker."""

    max_connection_wait_time = MAX_CONNECTION_WAIT_S

    def subscribe(self) -> None:
        """RQ's own, with a short read: the commands channel (e.g. `rq` stop-job) is heard as before."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_POLL_S, daemon=True,
            exception_handler=self._pubsub_exception_handler)  # type: ignore[assignment]  # RQ types it None

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        STOP.set()
        try:
            super().request_stop(signum, frame)  # type: ignore[no-untyped-call]
        except redis.RedisError:
            # RQ records the stop request in Redis, which is away: stop without recording it (a busy
            # worker after its job, which STOP ends; an idle one now).
            self._stop_requested = True
            if self.get_state() != WorkerStatus.BUSY:
                raise StopRequested() from None


def jobs_worker(client: redis.Redis, keys: Keys, name: str | None = None) -> JobsWorker:
    return JobsWorker([jobs_queue(client, keys)], connection=client, serializer=JSONSerializer, name=name)


def enqueue_run(client: redis.Redis, keys: Keys, job_id: str, attempt: int, options: dict[str, Any]) -> str:
    """Queue one run of bulk job `job_id`; returns the RQ job id (one per attempt)."""
    rq_id = f"{job_id}-run{attempt}"
    # timeout=-1: a bulk job may run for hours; cancellation is the runner's own (records.py state).
    jobs_queue(client, keys).enqueue_call(RUN_JOB, args=(job_id, options), job_id=rq_id, timeout=-1,
                                          result_ttl=86_400, failure_ttl=7 * 86_400)
    return rq_id


def fetch(client: redis.Redis, rq_id: str) -> Job | None:
    try:
        return Job.fetch(rq_id, connection=client, serializer=JSONSerializer)
    except Exception:  # rq raises NoSuchJobError, or an error for a corrupt hash: either way, no job
        return None
