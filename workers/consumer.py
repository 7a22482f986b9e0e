"""A worker's Redis I/O on one model's lane streams: join the consumer group, read, write replies, ack,
refresh and claim pending messages, dead-letter. No policy: workers/custody.py decides what to call.

A message is named by (lane, entry id): entry ids are unique only within one stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from batching.holding import MessageId
from fleet.backoff import Backoff
from fleet.envelope import ReplyEnvelope, reply_payload
from fleet.keys import GROUP, Keys
from fleet.link_pool import LinkPool
from fleet.parts import Parts
from fleet.redis_clients import unrecoverable
from fleet.redis_link import Command, RedisLink, entry_field, raise_first
from fleet.redis_time import RedisClock
from fleet.stats import (
    COPY_FIELD,
    DEAD_LETTERED,
    FOLD_CHUNK,
    FOLD_STATS,
    LOG_FIELD,
    TOKEN_FIELD,
    LoggedBatch,
    fold_argv,
    fold_keys,
)
from fleet.trace_points import REPLY_WRITE
from fleet.unlogged import MAX_UNLOGGED_REPLIES, UNLOGGED_XADD
from workers.pending_scripts import CLAIM, KEEP

log = logging.getLogger(__name__)

REPLY_MAXLEN = 100_000  # bounds a reply stream whose gateway died; far above any in-flight count
# A reply stream nobody reads any more (its gateway or job is gone) disappears after this. NX: the
# reader's own, shorter refresh cycle is never disturbed; this only covers a key the XADD recreated.
ORPHAN_REPLY_TTL_S = 3600
TTL_REFRESH_S = 60.0

DEAD_LETTERS_MAXLEN = 10_000
# Reply writes in flight at once: a finished batch's replies go out while the previous batch's write is
# still on its way, instead of waiting for it (bench/RESULTS.md, stop 51). Ordered finishes
# (preserve_ordering, sequences) wait for the write before theirs themselves (workers/custody.py).
WRITE_LINKS = 2

__all__ = ["Claimed", "Letter", "MessageId", "StreamConsumer", "Written"]

@dataclass(frozen=True, slots=True)
class Claimed:
    message: MessageId
    payload: bytes | None
    deliveries: int  # including this claim


@dataclass(frozen=True, slots=True)
class Letter:
    """A message to park in the model's dead letters: why, and its payload (for `fleet dead-letters
    --replay`)."""

    message: MessageId
    reason: str
    payload: bytes | None


@dataclass(frozen=True, slots=True)
class Written:
    """What one `write` got through: replies and dead letters by index into the lists given, the
    batches' statistics Redis refused (to be written again: only those), and whether the
    acknowledgements it carried were made."""

    replies: frozenset[int]
    uncounted: tuple[LoggedBatch, ...]
    acked: bool
    error: BaseException | None  # the first failure, if any
    letters: frozenset[int] = frozenset()


class StreamConsumer:
    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, version: int, consumer: str, lanes: int = 1,
                 redis_clock: RedisClock | None = None, streams: list[str] | None = None) -> None:
        """`streams`: the lanes' stream keys when not the model's own (a sequence model's online lane is
        this worker's sequence stream, fleet/keys.py)."""
        self._client = client
        # The request path's round trips on connections of their own (fleet/redis_link.py): each lane's
        # blocking read, and the writes (replies, statistics, acknowledgements), WRITE_LINKS at once.
        self._readers = [RedisLink(client) for _ in range(lanes)]
        self._writer = LinkPool(client, WRITE_LINKS)
        self._redis_clock = redis_clock or RedisClock()  # stamps traced replies (REPLY_WRITE)
        self._keys = keys
        self.model = model
        self.version = version
        self.streams = streams or [keys.queue(model, lane, version=version) for lane in range(lanes)]
        assert len(self.streams) == lanes, "one stream per lane"
        self.consumer = consumer
        self._cursors = [b"0-0"] * lanes  # XAUTOCLAIM resumes where the last claim stopped
        self._ttl_set: dict[str, float] = {}  # reply stream -> when its EXPIRE NX was last sent (monotonic)
        # By its SHA (a fold many times a second: not its ~3 KB body each time); loaded again after a restart.
        self._fold = client.register_script(FOLD_STATS)

    async def join(self) -> None:
        for stream in self.streams:
            try:
                # From "0": requests accepted before any worker existed are served too.
                await self._client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def join_when_reachable(self) -> None:
        """join(), retried with backoff while Redis is away, starting or loading its AOF."""
        backoff = Backoff()
        while True:
            try:
                await self.join()
                return
            except (RedisConnectionError, TimeoutError, OSError) as exc:
                if unrecoverable(exc):
                    raise  # a refused password or certificate: waiting does not fix it
                delay = backoff.next_delay()
                log.warning("%s: cannot join the streams (%s); retrying in %.2f s", self.model, exc, delay)
                await asyncio.sleep(delay)

    async def read(self, lane: int, count: int, block_ms: int | None) -> list[tuple[MessageId, bytes | None]]:
        """Up to `count` new messages of `lane` as ((lane, entry id), payload); waiting up to `block_ms` for
        the first, or (None) answered at once with what there is."""
        blocking: tuple[str | int, ...] = () if block_ms is None else ("BLOCK", block_ms)
        try:
            (result,) = raise_first(await self._readers[lane].execute(
                [("XREADGROUP", "GROUP", GROUP, self.consumer, "COUNT", count, *blocking,
                  "STREAMS", self.streams[lane], ">")], block_ms=block_ms or 0))
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.join()  # the streams were lost (Redis restarted without persistence)
            return []
        out: list[tuple[MessageId, bytes | None]] = []
        for _, entries in result or []:
            for entry_id, fields in entries:
                out.append(((lane, entry_id), entry_field(fields, b"d")))
        return out

    async def write(self, replies: list[tuple[str, ReplyEnvelope]], counts: Sequence[LoggedBatch],
                    acks: Sequence[MessageId] = (), letters: Sequence[Letter] = (), *,
                    copies: bool = False) -> Written:
        """Write replies (one stream entry per reply stream, one field per reply), count the batches'
        statistics, park `letters` and acknowledge `acks` (messages whose replies an earlier write got
        through), in one round trip; each command's own result is checked, so a reply Redis refused (out
        of memory, a wrong-type key) is reported as not written while the others are. `copies`: `counts`
        may have been written already (an earlier write's outcome is unknown), marked so that the fold
        counts each once (fleet/stats.py)."""
        # The batches' statistics first: a reply's reader may read the statistics as soon as it has the
        # reply, and must find its request counted (the log is folded into the hash on every read).
        commands = self._count_commands(counts, copies)
        # Then the dead letters, ahead of the replies that tell their callers: whoever got the error
        # finds the message parked (two commands each: the entry, then the count).
        for letter in letters:
            commands += self._letter_commands(letter)
        by_stream: dict[str, list[int]] = {}
        for index, (reply_to, _) in enumerate(replies):
            by_stream.setdefault(reply_to, []).append(index)
        now = time.monotonic()
        xadds: list[int] = []  # positions of the XADDs among the commands
        for reply_to, indices in by_stream.items():
            xadd: list[bytes | Parts | str | int] = ["XADD", reply_to, "MAXLEN", "~", REPLY_MAXLEN, "*"]
            job = self._keys.is_job_results(reply_to)
            if job and len(indices) <= MAX_UNLOGGED_REPLIES:
                xadd[:2] = ["EVAL", UNLOGGED_XADD, 1, reply_to]  # not logged (AOF, replicas): fleet/unlogged.py
            for n, i in enumerate(indices):
                reply = replies[i][1]
                if reply.trace is not None:
                    reply.trace[REPLY_WRITE] = self._redis_clock.now_ns()
                xadd += [b"d%d" % n, reply_payload(reply)]
            xadds.append(len(commands))
            commands.append(xadd)
            if job or now - self._ttl_set.get(reply_to, -TTL_REFRESH_S) >= TTL_REFRESH_S:
                # Only a stream this XADD recreated (its reader gone) lacks a TTL: once a minute is plenty for
                # a gateway's. A job's is deleted when its run ends, so a late reply recreates it any time (and
                # logged: fleet/unlogged.py): each write sees to it.
                commands.append(("EXPIRE", reply_to, ORPHAN_REPLY_TTL_S, "NX"))
                self._ttl_set[reply_to] = now
        if len(self._ttl_set) > 1000:
            self._ttl_set = {k: t for k, t in self._ttl_set.items() if now - t < TTL_REFRESH_S}
        first_ack = len(commands)
        commands += self._ack_commands(acks)
        resend: Callable[[], list[Command]] | None = None
        if counts and not copies:
            def resend() -> list[Command]:  # the link sends the round trip again: the counts as copies
                return self._count_commands(counts, True) + commands[len(counts):]
        results = await self._writer.execute(commands, resend=resend)
        written: set[int] = set()
        errors: list[BaseException] = []
        lettered: set[int] = set()
        first_letter = len(counts)
        for i in range(len(letters)):
            entry, count = results[first_letter + 2 * i:first_letter + 2 * i + 2]
            errors += [r for r in (entry, count) if isinstance(r, BaseException)]
            if not isinstance(entry, BaseException):
                lettered.add(i)  # parked (a count Redis refused is only a count)
        for position, indices in zip(xadds, by_stream.values(), strict=True):
            result = results[position]
            if isinstance(result, BaseException):
                errors.append(result)
            else:
                written.update(indices)
        uncounted = tuple(c for c, r in zip(counts, results, strict=False) if isinstance(r, BaseException))
        acked = not any(isinstance(r, BaseException) for r in results[first_ack:])
        errors += [r for r in results[:first_letter] + results[first_ack:] if isinstance(r, BaseException)]
        return Written(frozenset(written), uncounted, acked, errors[0] if errors else None, frozenset(lettered))

    def _count_commands(self, counts: Sequence[LoggedBatch], copies: bool) -> list[Command]:
        """The batches' stats-log entries, each with its token, marked as copies if they may have been
        written already (fleet/stats.py)."""
        marked = COPY_FIELD if copies else TOKEN_FIELD
        log_key = self._keys.stats_log(self.model)
        return [("XADD", log_key, "*", LOG_FIELD, c.entry, marked, c.token) for c in counts]

    async def ack(self, messages: list[MessageId]) -> None:
        """Acknowledge and delete: only for messages whose reply is written (or that need none)."""
        if not messages:
            return
        raise_first(await self._writer.execute(self._ack_commands(messages)))

    def _ack_commands(self, messages: Sequence[MessageId]) -> list[Command]:
        by_lane: dict[int, list[bytes]] = {}
        for lane, entry_id in messages:
            by_lane.setdefault(lane, []).append(entry_id)
        commands: list[Command] = []
        for lane, ids in by_lane.items():
            commands.append(("XACK", self.streams[lane], GROUP, *ids))
            commands.append(("XDEL", self.streams[lane], *ids))
        return commands

    async def keep(self, held: dict[int, list[bytes]]) -> list[MessageId]:
        """Restart the idle time of the messages this consumer holds and still owns; returns the held
        messages that are not its own any more (claimed by another worker after this one stalled, or
        answered and deleted by one)."""
        pipe = self._client.pipeline(transaction=False)
        lanes = sorted(held)
        for lane in lanes:
            pipe.eval(KEEP, 1, self.streams[lane], GROUP, self.consumer, *held[lane])
        results = await pipe.execute()
        return [(lane, entry_id) for lane, lost in zip(lanes, results, strict=True) for entry_id in lost]

    async def claim(self, min_idle_ms: int, count: int) -> list[Claimed]:
        """Take over messages other consumers left pending for `min_idle_ms`, highest lane first, each lane
        from where its last claim stopped (so every orphan is reached, however many there are)."""
        out: list[Claimed] = []
        for lane, stream in enumerate(self.streams):
            if len(out) >= count:
                break
            cursor, entries, counts, _deleted = await self._client.eval(
                CLAIM, 1, stream, GROUP, self.consumer, min_idle_ms, self._cursors[lane], count - len(out))
            self._cursors[lane] = cursor
            for (entry_id, fields), deliveries in zip(entries, counts, strict=True):
                payload = entry_field(fields, b"d")  # (a script returns an entry as XREADGROUP does)
                out.append(Claimed((lane, entry_id), payload, int(deliveries)))
        return out

    async def prune_consumers(self, live: set[str], min_idle_ms: int) -> list[str]:
        """Remove consumers of dead workers (not in `live`) that hold nothing and have been idle long."""
        removed: list[str] = []
        for stream in self.streams:
            try:
                consumers: Any = await self._client.xinfo_consumers(stream, GROUP)
            except ResponseError:
                continue  # no group yet
            for c in consumers:
                name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
                worker = name.split("~", 1)[0]  # a unit loaded beside an older one has a suffix (workers/control.py)
                if name == self.consumer or worker in live or int(c["pending"]) or int(c["idle"]) < min_idle_ms:
                    continue
                await self._client.xgroup_delconsumer(stream, GROUP, name)
                removed.append(name)
        return removed

    async def undelivered(self) -> int:
        """Entries of this version's lanes that no consumer of the group has read yet: the group's lag
        (entries deleted while pending, as a gateway deletes an abandoned request, do not hide unread
        ones as XLEN - pending would); where Redis cannot say, XLEN - pending."""
        pipe = self._client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xinfo_groups(stream)
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)
        results = await pipe.execute(raise_on_error=False)
        total = 0
        for groups, length, pending in zip(results[::3], results[1::3], results[2::3], strict=True):
            ours = [g for g in groups if g.get("name") in (GROUP, GROUP.encode())] if isinstance(groups, list) else []
            lag = ours[0].get("lag") if ours else None
            if isinstance(lag, int):
                total += lag
                continue
            n = int(length) if isinstance(length, int) else 0
            if isinstance(pending, dict):
                n -= int(pending.get("pending", 0))
            total += max(0, n)
        return total

    async def dead_letter(self, letter: Letter) -> None:
        """Park a message nobody can answer (there is no caller to reply to), then ack and delete it: only
        once Redis has the letter (a pipeline runs each command on its own, so the ack waits for the next
        round trip)."""
        entry, _count = await self._writer.execute(self._letter_commands(letter))
        if isinstance(entry, BaseException):
            raise entry
        raise_first(await self._writer.execute(self._ack_commands([letter.message])))

    def _letter_commands(self, letter: Letter) -> list[Command]:
        """The message's entry in the dead letters (with the reason, and its payload so that `fleet
        dead-letters --replay` can queue it again), and the count. Logged, a bulk job's too (whose request
        and reply are not, fleet/unlogged.py): letters are rare, they are what an operator reads after a
        restart, and an unlogged XADD's MAXLEN would trim the logged letters before it in memory only."""
        lane, entry_id = letter.message
        entry: list[bytes | Parts | str | int] = [
            "XADD", self._keys.dead(self.model), "MAXLEN", "~", DEAD_LETTERS_MAXLEN, "*",
            b"id", entry_id, b"lane", lane, b"version", self.version, b"reason", letter.reason.encode()]
        if letter.payload is not None:
            entry += [b"d", letter.payload]
        return [entry, ("HINCRBY", self._keys.stats(self.model), DEAD_LETTERED, 1)]

    async def fold_stats(self, most: int = FOLD_CHUNK) -> int:
        """Fold the oldest `most` entries of the model's stats log into its hash (what readers do before
        reading); how many it folded (custody paces the folds: fleet/stats.py fold_delay)."""
        return int(await self._fold(keys=fold_keys(self._keys, self.model), args=fold_argv(most)))

    async def count(self, deltas: dict[str, int]) -> None:
        """Add to model-wide counters of the stats hash (fleet/stats.py CLAIMED, ...): off the request
        path (claims are rare), one round trip."""
        pipe = self._client.pipeline(transaction=False)
        for name, delta in deltas.items():
            if delta:
                pipe.hincrby(self._keys.stats(self.model), name, delta)
        await pipe.execute()

    async def close(self) -> None:
        for link in self._readers:
            await link.aclose()
        await self._writer.aclose()
        await self._client.aclose()
