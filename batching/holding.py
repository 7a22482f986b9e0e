"""What one worker holds of one model, in rows per lane: the bound on its read-ahead.

Rows, not messages: a bulk job's message packs a whole batch, or several (then the bulk lane's bound
scales with them, and what it holds past its bound in rows takes no room from the lanes above it). Each
lane above the bulk lane has one batch more room than the lane below it, so a lower lane may never fill
the room a higher one needs, and every lower lane keeps at least one batch queued so that bulk-lane aging
(batching.policy) can promote it and a lower level's queue timeouts are seen. Claimed orphans may take the
holding one batch past its bound (`claim_room`): they are older than anything new, so they must not wait
behind new traffic.
Pure policy: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

MessageId = tuple[int, bytes]  # (lane, stream entry id): entry ids are unique only within one stream


class Holding:
    def __init__(self, lanes: int, per_batch: int, capacity: int) -> None:
        self.bulk_lane = lanes - 1
        self.per_batch = per_batch
        self.capacity = capacity  # rows the bulk lane may fill (queued + executing)
        self._rows_of: dict[MessageId, int] = {}
        self._answered: set[MessageId] = set()  # held, their replies written: waiting to be acknowledged
        self._rows = [0] * lanes
        self._hint = [1] * lanes  # per lane: rows of its last message

    def __contains__(self, message: object) -> bool:
        return message in self._rows_of

    def hold(self, message: MessageId, rows: int) -> None:
        if message in self._rows_of:
            return  # held already (delivered twice): counted once
        self._rows_of[message] = rows
        self._rows[message[0]] += rows
        self._hint[message[0]] = rows

    def release(self, messages: Iterable[MessageId]) -> None:
        for message in messages:
            rows = self._rows_of.pop(message, None)
            if rows is not None:
                self._rows[message[0]] -= rows
                self._answered.discard(message)

    def answered(self, messages: Iterable[MessageId]) -> None:
        """Their replies are written: their rows stop counting against the read-ahead, though they stay
        held (kept alive, recognised if delivered again) until released once acknowledged. The
        acknowledgement rides on the next reply write, one batch later: rows counted until then would
        keep the next batch from being read while this one computes (measured: a bulk job's instance
        idle a third of the time, 0.58x direct, with two batches of room)."""
        for message in messages:
            rows = self._rows_of.get(message)
            if rows is None:
                continue
            self._answered.add(message)
            if rows:
                self._rows[message[0]] -= rows
                self._rows_of[message] = 0

    def unanswered(self, messages: Iterable[MessageId]) -> list[MessageId]:
        """Those of `messages` still held whose replies are not written yet."""
        return [m for m in messages if m in self._rows_of and m not in self._answered]

    def rows(self) -> int:
        return sum(self._rows)

    def held(self) -> int:
        """Messages held, answered ones waiting for their acknowledgement included (`rows` counts neither)."""
        return len(self._rows_of)

    def online_rows(self) -> int:
        """Rows held on the lanes above the bulk lane, until their replies are written (read from an instance's
        thread too: a sum of a list of ints, at worst a moment old)."""
        return sum(self._rows[:self.bulk_lane])

    def room(self, lane: int) -> int:
        """How many more rows `lane` may read now: up to its limit (one batch more per lane above the
        bulk lane), and at least enough to keep one batch of its own queued."""
        if lane < self.bulk_lane:
            # The bulk lane's rows past `capacity` (packed messages, `_bulk_capacity`) take no room from these.
            held = self.rows() - max(0, self._rows[self.bulk_lane] - self.capacity)
            room = self.capacity + self.per_batch * (self.bulk_lane - lane) - held
        else:
            room = self._bulk_capacity() - self.rows()
        if lane > 0:
            room = max(room, self.per_batch - self._rows[lane])
        return room

    def _bulk_capacity(self) -> int:
        """What the bulk lane may fill: `capacity`, scaled to its messages where those are larger than a batch
        (a bulk job's packed requests, run in parts: workers/request_parts.py), so that as many of them are held
        as batches would be; one would otherwise fill it alone, with none waiting behind it. Higher lanes keep
        the bound in rows (a worker does not hoard online requests other workers could serve while a job
        runs), and so do models without dynamic batching (`per_batch` 1: one message held at a time, as ever)."""
        hint = self._hint[self.bulk_lane]
        if hint <= self.per_batch or self.per_batch == 1:
            return self.capacity
        return self.capacity * -(-hint // self.per_batch)

    def claim_room(self) -> int:
        """How many rows of orphans (messages a dead worker left) may be taken now: one batch more than
        the highest lane may read (its bound counted as the bulk lane's, which packed messages scale), so a
        saturated worker still takes them (and, being over its bound, reads nothing new until they are
        served)."""
        return self._bulk_capacity() + self.per_batch * (self.bulk_lane + 1) - self.rows()

    def messages_to_read(self, lane: int, room: int) -> int:
        """Messages to ask for to fill `room` rows: each as large as the lane's last one."""
        return max(1, room // self._hint[lane])

    def by_lane(self) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {}
        for lane, entry_id in self._rows_of:
            out.setdefault(lane, []).append(entry_id)
        return out
