"""A decoupled model's responses before its last, written to the caller's reply stream as they come.

Called on the thread that reads a stub's pipe (workers/backends/decoupled.py), so a blocking client:
each XADD is done before the next response of that stub is read, which keeps the responses in the order
the model sent them, and before the final one (which the worker loop writes) can exist. A response
Redis refuses is logged and lost; the request's final reply still comes (the caller sees fewer
responses, never a request without an end).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import redis
from redis.exceptions import RedisError

from fleet.envelope import ReplyEnvelope, WireTensor, encode_reply
from fleet.keys import Keys
from fleet.unlogged import UNLOGGED_XADD
from workers.backends.base import InferenceItem
from workers.consumer import ORPHAN_REPLY_TTL_S, REPLY_MAXLEN
from workers.custom_metrics import CustomMetricsBook

log = logging.getLogger(__name__)


def reply_of(item: InferenceItem, frame: dict[str, Any], *, final: bool) -> ReplyEnvelope:
    """A stub's encoded response (`{"o": [...], "p": {...}}` or `{"e": [code, message]}`) as a reply."""
    if "e" in frame:
        code, message = frame["e"]
        return ReplyEnvelope(id=item.key, model_version=item.version, error_code=str(code),
                             error_message=str(message), final=final)
    wanted = None if item.requested_outputs is None else set(item.requested_outputs)
    outputs = [WireTensor(name, datatype, tuple(shape), data) for name, datatype, shape, data in frame.get("o") or []
               if wanted is None or name in wanted]
    return ReplyEnvelope(id=item.key, model_version=item.version, outputs=outputs,
                         parameters=frame.get("p") or {}, final=final, out_of_band=item.reads_out_of_band)


# KEYS: the model's custom-metrics hash, its fence (zset: folded part -> when); ARGV: this part's field, blob.
PUBLISH_PART = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class ReplyWriter:
    def __init__(self, url: str, keys: Keys, worker_id: str = "") -> None:
        self._client = redis.Redis.from_url(url, protocol=2)
        self._keys = keys
        self._worker_id = worker_id
        # This process's field in the models' custom-metrics hashes: the worker id and a token of this
        # start, so that a worker restarted under a fixed --worker-id is a new part, never a folded one.
        self.part = f"{worker_id}/{uuid.uuid4().hex[:8]}"
        self._fenced: set[str] = set()
        # Python models' custom metrics, this worker's part (workers/custom_metrics.py).
        self.custom_metrics = CustomMetricsBook(self._publish_custom_metrics)
        self._publish_part = self._client.register_script(PUBLISH_PART)

    def _publish_custom_metrics(self, model: str, part: bytes) -> None:
        # Refused once a gateway folded this worker's part as a dead one's (gateway/custom_metrics.py):
        # a worker back after its heartbeat expired is fenced, and its counts are in the fold already.
        keys = [self._keys.custom_metrics(model), self._keys.custom_metrics_folded(model)]
        if not self._publish_part(keys=keys, args=[self.part, part]) and model not in self._fenced:
            self._fenced.add(model)
            log.warning("%s: this worker was taken for dead (no heartbeat for over a minute) and its custom "
                        "metrics folded; what it counts from now on is not published", model)

    def record_stats(self, model: str, increments: dict[str, int], gauges: dict[str, int]) -> None:
        """A generation engine's metrics (workers/generation/metrics.py) into the model's stats hash.
        Raises on a Redis error (the caller keeps the deltas for the next try)."""
        key = self._keys.stats(model)
        pipe = self._client.pipeline(transaction=False)
        for field, value in increments.items():
            pipe.hincrby(key, field, value)
        if gauges:
            pipe.hset(key, mapping=gauges)  # type: ignore[arg-type]
        pipe.execute()

    def emit_many(self, frames: list[tuple[InferenceItem, dict[str, Any]]]) -> None:
        """Several responses in one pipeline (a generation engine's tokens of one iteration)."""
        if not frames:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for item, frame in frames:
                payload = encode_reply(reply_of(item, frame, final=False))
                if self._keys.is_job_results(item.reply_to):  # not logged (AOF, replicas): fleet/unlogged.py
                    pipe.eval(UNLOGGED_XADD, 1, item.reply_to, "MAXLEN", "~", REPLY_MAXLEN, "*", "d", payload)
                else:
                    pipe.xadd(item.reply_to, {b"d": payload}, maxlen=REPLY_MAXLEN, approximate=True)
            for reply_to in {item.reply_to for item, _ in frames}:
                pipe.expire(reply_to, ORPHAN_REPLY_TTL_S, nx=True)
            pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("%d responses could not be written: %s", len(frames), exc)

    def emit(self, item: InferenceItem, frame: dict[str, Any]) -> None:
        self.emit_many([(item, frame)])

    def close(self) -> None:
        self._client.close()
