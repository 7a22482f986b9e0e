"""The acknowledgements of one worker's model waiting for a ride (workers/custody.py): messages whose
replies are written, to be acknowledged and deleted, then released.

Under load they ride along with the next batch's reply write (one round trip fewer per batch); those
that waited ACK_DELAY_S for a ride go out on their own, retried with backoff while Redis is away (held
meanwhile, so kept alive). Past `finish_retry_s` unacknowledged they are left pending: their replies are
out, so whoever claims them computes a duplicate the gateway drops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from batching.holding import MessageId
from fleet.backoff import Backoff
from fleet.cancellation import raise_if_cancelled
from workers.consumer import StreamConsumer

log = logging.getLogger(__name__)

# Acknowledgements wait this long for the next batch's reply write to carry them: under load a batch
# costs one round trip (replies + the previous batch's acks), not two.
ACK_DELAY_S = 0.005
ACK_RESOLUTION_S = 0.001  # the event loop's timers are whole milliseconds (workers/wakeup.py)

# Messages to acknowledge together, with when they joined (monotonic s).
Carried = list[tuple[list[MessageId], float]]


class Acks:
    def __init__(self, consumer: StreamConsumer, finish_retry_s: float,
                 release: Callable[[Sequence[MessageId]], None]) -> None:
        self._consumer = consumer
        self._finish_retry_s = finish_retry_s
        self._release = release  # no longer held: acknowledged, or left pending for good
        self._waiting: Carried = []
        self._flush: asyncio.Future[None] | None = None

    def add(self, messages: list[MessageId]) -> None:
        """Acknowledge and delete `messages` (their replies are written), then release them."""
        if messages:
            self._waiting.append((messages, time.monotonic()))
            self._arm(ACK_DELAY_S)

    def take(self) -> Carried:
        """All waiting, for a reply write to carry; `settle` says how that went."""
        taken, self._waiting = self._waiting, []
        return taken

    def settle(self, carried: Carried, acked: bool) -> None:
        if acked:
            for messages, _ in carried:
                self._release(messages)
            return
        # Not acknowledged: tried again later, unless for finish_retry_s already. Then they are left
        # pending (their replies are out: whoever claims them computes a duplicate the gateway drops).
        cutoff = time.monotonic() - self._finish_retry_s
        for messages, since in carried:
            if since < cutoff:
                log.error("%s: %d messages answered but not acknowledged for %.0f s; left pending",
                          self._consumer.model, len(messages), self._finish_retry_s)
                self._release(messages)
        self._waiting = [c for c in carried if c[1] >= cutoff] + self._waiting
        if self._waiting:
            self._arm(ACK_DELAY_S)

    def _arm(self, delay_s: float) -> None:
        if self._flush is None or self._flush.done():
            self._flush = asyncio.ensure_future(self._flush_later(delay_s))

    async def _flush_later(self, delay_s: float) -> None:
        backoff = Backoff()
        await asyncio.sleep(delay_s)  # also spaces the retry of a ride that failed (its acks are older)
        while self._waiting:
            # Each waits ACK_DELAY_S for a ride from when it joined, not from when this flush was armed:
            # at one request at a time, a flush armed by an earlier one would otherwise send the latest
            # acknowledgements on their own, a round trip for a quarter of the requests at ~1 ms each.
            # (The oldest need not be first: a failed ride puts its own back in front. Under a
            # millisecond counts as due: uvloop's timers fire a shorter sleep at once, a spin.)
            wait_s = min(since for _, since in self._waiting) + ACK_DELAY_S - time.monotonic()
            if wait_s >= ACK_RESOLUTION_S:
                await asyncio.sleep(wait_s)
                continue
            carried = self.take()
            try:
                await self._consumer.ack([m for ms, _ in carried for m in ms])
            except BaseException as exc:
                if not isinstance(exc, (RedisError, OSError)):  # cancelled, or a bug: kept, for the next flush
                    self.settle(carried, False)
                    raise
                raise_if_cancelled()
                self.settle(carried, False)
                delay = backoff.next_delay()
                log.warning("%s: acknowledging failed (%s); retrying in %.2f s", self._consumer.model, exc, delay)
                await asyncio.sleep(delay)
                continue
            self.settle(carried, True)
