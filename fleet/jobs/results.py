"""A job run's reading of its results stream (fleet/jobs/feed.py's replies), where the workers write them.

The runner reads by id, from the last reply it read, and deletes exactly the entries it has read (XDEL of
their ids), not everything below that cursor: replies that landed below it stay there to be read.

They land below it when the stream went back: Redis lost it (a restart, a failover) and, on a clock behind,
gives new replies ids below the cursor, which would hide them until the clock caught up. fleet/unlogged.py
logs each stream's last id, so a replayed or replicated stream does not go back; for one that does anyway (a
replica that missed the last of them, a Redis without persistence), the runner looks when a request is
overdue (`reread_if_rewound`) and reads the stream from its start again. Replies match by request id, so one
read before is dropped again. A stream that expired (nothing sent for RESULTS_TTL_S) is read from its start
too: nothing is in it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import redis

from fleet.redis_link import entry_order

log = logging.getLogger(__name__)

READ_BLOCK_MS = 50
RESULTS_TTL_S = 3600  # refreshed while the job runs; a dead job's results stream disappears
_START = b"0-0"


class ResultsReader:
    def __init__(self, client: redis.Redis, key: str, job_id: str) -> None:
        self.client = client
        self.key = key
        self.job_id = job_id
        self.last_id = _START
        self._read: list[bytes] = []  # entries read since the last `queue_read`, deleted by it

    def queue_read(self, pipe: Any, block: bool) -> None:
        """Add to `pipe` the deletion of what was read and a read of what came since (up to 512; waiting up
        to READ_BLOCK_MS if `block`); `payloads` takes its result."""
        if self._read:
            pipe.xdel(self.key, *self._read)
            self._read = []
        pipe.xread({self.key: self.last_id}, count=512, block=READ_BLOCK_MS if block else None)

    def queue_read_all(self, pipe: Any) -> None:
        """Add to `pipe` a read of everything since the last reply read (nothing deleted)."""
        pipe.xread({self.key: self.last_id})

    def payloads(self, result: Any) -> Iterator[bytes]:
        """The reply payloads of an XREAD's `result`, each entry's in order, the cursor moved past each."""
        for _, entries in result or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                self._read.append(entry_id)
                for name, payload in fields.items():
                    if name[:1] == b"d":
                        yield payload

    def reread_if_rewound(self) -> None:
        """Read from the start again if the stream is gone or its last id is below the last reply read."""
        if self.last_id == _START:
            return
        try:
            last: bytes | None = self.client.xinfo_stream(self.key)["last-generated-id"]
        except redis.ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            last = None
        if last is None or entry_order(last) < entry_order(self.last_id):
            log.warning("job %s: its results stream is gone or went back (to %s from %s: Redis lost it, or it "
                        "expired); reading it from the start", self.job_id, last, self.last_id)
            self.last_id = _START
