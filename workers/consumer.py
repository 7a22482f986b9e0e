"""A worker's Redis I/O on one model's lane streams: join the consumer group on each, read, and finish
a batch (replies + XACK + XDEL + statistics) in one pipelined round trip. Acknowledged only after the
replies are written, so a worker that dies leaves its messages pending for another to claim.

A message is named by (lane, entry id): entry ids are unique only within one stream."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from fleet.backoff import Backoff
from fleet.envelope import ReplyEnvelope, encode_reply
from fleet.keys import GROUP, Keys
from fleet.stats import BatchSample, field, increments

log = logging.getLogger(__name__)

REPLY_MAXLEN = 100_000  # bounds a reply stream whose gateway died; far above any in-flight count
# A reply stream nobody reads any more (its gateway or job is gone) disappears after this. NX: the
# reader's own, shorter refresh cycle is never disturbed; this only covers a key the XADD recreated.
ORPHAN_REPLY_TTL_S = 3600
FINISH_RETRY_S = 30.0

MessageId = tuple[int, bytes]  # (lane, stream entry id)

# KEYS[1] = stats hash; ARGV = last_inference field ("" = leave), its value, then field/delta pairs.
_COUNT_BATCH = """
if ARGV[1] ~= "" then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 0
"""


class StreamConsumer:
    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, consumer: str, lanes: int = 1) -> None:
        self._client = client
        self._keys = keys
        self.model = model
        self.streams = [keys.queue(model, lane) for lane in range(lanes)]
        self.consumer = consumer

    async def join(self) -> None:
        for stream in self.streams:
            try:
                # From "0": requests accepted before any worker existed are served too.
                await self._client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def join_when_reachable(self) -> None:
        """join(), retried while Redis is starting or loading its AOF; an error that retrying cannot fix
        (a refused ACL) is raised."""
        backoff = Backoff()
        while True:
            try:
                await self.join()
                return
            except (RedisConnectionError, TimeoutError, OSError) as exc:
                delay = backoff.next_delay()
                log.warning("%s: cannot join the streams (%s); retrying in %.2f s", self.model, exc, delay)
                await asyncio.sleep(delay)

    async def read(self, lane: int, count: int, block_ms: int) -> list[tuple[MessageId, bytes | None]]:
        """Up to `count` new messages of `lane` as ((lane, entry id), payload)."""
        try:
            result: Any = await self._client.xreadgroup(
                GROUP, self.consumer, {self.streams[lane]: ">"}, count=count, block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.join()  # the streams were lost (Redis restarted without persistence)
            return []
        out: list[tuple[MessageId, bytes | None]] = []
        for _, entries in result or []:
            for entry_id, fields in entries:
                out.append(((lane, entry_id), fields.get(b"d") if fields else None))
        return out

    async def finish(self, replies: list[tuple[str, ReplyEnvelope]], messages: list[MessageId],
                     samples: list[BatchSample]) -> None:
        """Write every reply, then ack and delete the messages, and count the batch: one round trip."""
        pipe = self._client.pipeline(transaction=False)
        # One stream entry per gateway per batch, one field per reply: a batch costs one XADD per
        # gateway, not one per request.
        by_stream: dict[str, dict[Any, Any]] = {}
        for reply_to, reply in replies:
            fields = by_stream.setdefault(reply_to, {})
            fields[b"d%d" % len(fields)] = encode_reply(reply)
        for reply_to, fields in by_stream.items():
            pipe.xadd(reply_to, fields, maxlen=REPLY_MAXLEN, approximate=True)
            pipe.expire(reply_to, ORPHAN_REPLY_TTL_S, nx=True)
        by_lane: dict[int, list[bytes]] = {}
        for lane, entry_id in messages:
            by_lane.setdefault(lane, []).append(entry_id)
        for lane, ids in by_lane.items():
            pipe.xack(self.streams[lane], GROUP, *ids)
            pipe.xdel(self.streams[lane], *ids)
        for sample in samples:
            # One server-side script call instead of ~17 HINCRBYs (all on the model's one hash key).
            args: list[bytes | str | int] = []
            for name, delta in increments(sample).items():
                args += [name, delta]
            last = field(sample.version, "last_inference") if sample.requests_ok else ""
            pipe.eval(_COUNT_BATCH, 1, self._keys.stats(self.model), last, sample.finished_ms, *args)
        await pipe.execute()

    async def finish_retrying(self, replies: list[tuple[str, ReplyEnvelope]], messages: list[MessageId],
                              samples: list[BatchSample]) -> None:
        """finish(), retried with capped backoff while Redis is away (a restart): computed replies are
        written once it is back, for up to FINISH_RETRY_S; after that the error is raised and the messages
        stay pending (another worker, or this one, claims and recomputes them)."""
        backoff = Backoff()
        give_up_at = time.monotonic() + FINISH_RETRY_S
        while True:
            try:
                await self.finish(replies, messages, samples)
                return
            except (RedisError, OSError) as exc:
                if time.monotonic() > give_up_at:
                    raise
                delay = backoff.next_delay()
                log.warning("%s: writing replies failed (%s); retrying in %.2f s", self.model, exc, delay)
                await asyncio.sleep(delay)

    async def claim(self, min_idle_ms: int, count: int) -> list[tuple[MessageId, bytes | None, int]]:
        """Take over messages other consumers left pending for min_idle_ms, highest lane first:
        (message, payload, deliveries)."""
        out: list[tuple[MessageId, bytes | None, int]] = []
        for lane, stream in enumerate(self.streams):
            if len(out) >= count:
                break
            result: Any = await self._client.xautoclaim(stream, GROUP, self.consumer, min_idle_ms,
                                                         start_id="0-0", count=count - len(out))
            entries = [(eid, fields.get(b"d") if fields else None) for eid, fields in result[1] if eid]
            if not entries:
                continue
            pending: Any = await self._client.xpending_range(stream, GROUP, min=entries[0][0],
                                                              max=entries[-1][0], count=len(entries) * 2,
                                                              consumername=self.consumer)
            deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
            out.extend(((lane, eid), payload, deliveries.get(eid, 1)) for eid, payload in entries)
        return out

    async def keep(self, held: dict[int, list[bytes]]) -> None:
        """Restart the idle time of messages this consumer holds (lane -> entry ids), so no other worker
        claims them while they wait here. JUSTID: no delivery is counted."""
        pipe = self._client.pipeline(transaction=False)
        for lane, ids in held.items():
            pipe.xclaim(self.streams[lane], GROUP, self.consumer, 0, list[Any](ids), justid=True)
        await pipe.execute()

    async def dead_letter(self, message: MessageId, reason: str, payload: bytes | None) -> None:
        """Park a message nobody could answer with the reason (and its payload, so `fleet dead-letters
        --replay` can queue it again), then ack and delete it."""
        lane, entry_id = message
        stream = self.streams[lane]
        fields: dict[bytes, bytes | int] = {b"id": entry_id, b"lane": lane, b"reason": reason.encode()}
        if payload is not None:
            fields[b"d"] = payload
        pipe = self._client.pipeline(transaction=False)
        pipe.xadd(self._keys.dead(self.model), fields, maxlen=10_000, approximate=True)  # type: ignore[arg-type]
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        await pipe.execute()

    async def close(self) -> None:
        await self._client.aclose()
