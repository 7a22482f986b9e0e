"""The worker's part in "no request is lost": custody of what it holds, recovery of what others dropped.

- Keepalive: every message a worker holds (queued, staged or executing) is refreshed each keepalive_s
  (XCLAIM JUSTID to itself: its idle time restarts, no delivery is counted), so only a dead or frozen
  worker's messages ever reach the claim timeout, however long they wait in a queue.
- Claim: what a dead worker left pending is taken over after the claim timeout (fleet/claims.py: from
  the model's observed execution time) and served here; past max_deliveries it is a poison message,
  dead-lettered with an error reply to its caller.
- Watchdog: an instance executing one batch longer than watchdog_s is hung. The model stops being
  advertised (readiness turns false if nothing else serves it) and the instance is restarted: killed,
  where its backend runs in a process of its own (Python backend); otherwise `on_hung` decides (the
  worker exits for its supervisor).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from fleet.backoff import Backoff
from fleet.envelope import ReplyEnvelope, decode_request
from fleet.errors import InvalidInput
from workers.consumer import MessageId
from workers.instance import Instance

if TYPE_CHECKING:
    from workers.loop import ModelLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    claim_idle_ms: int = 0  # 0: derived from observed execution time
    claim_min_ms: int = 3000
    keepalive_s: float = 1.0
    claim_interval_s: float = 1.0
    max_deliveries: int = 3
    watchdog_s: float = 120.0


HungHandler = Callable[["ModelLoop", Instance], None]


class Recovery:
    def __init__(self, loop: ModelLoop, config: RecoveryConfig, on_hung: HungHandler | None = None) -> None:
        self.loop = loop
        self.config = config
        self.on_hung = on_hung
        # By instance, not name: the versions of a model name their instances alike.
        self.hung: set[Instance] = set()  # past the watchdog limit
        self.down: set[Instance] = set()  # their backend could not be restarted
        self._reviving: set[asyncio.Future[bool]] = set()

    def tasks(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._keep_alive()), asyncio.create_task(self._claim_abandoned()),
                asyncio.create_task(self._watch())]

    async def _keep_alive(self) -> None:
        backoff = Backoff()
        while not self.loop.stopping:
            await asyncio.sleep(self.config.keepalive_s)
            held = self.loop.holding.by_lane()
            if not held:
                continue
            try:
                await self.loop.consumer.keep(held)
                backoff.reset()
            except (RedisError, OSError) as exc:
                _reraise_if_cancelled()
                log.warning("%s: refreshing held messages failed: %s", self.loop.spec.name, exc)
                await asyncio.sleep(backoff.next_delay())

    async def _claim_abandoned(self) -> None:
        loop = self.loop
        backoff = Backoff()
        while not loop.stopping:
            await asyncio.sleep(self.config.claim_interval_s)
            room = loop.holding.room(0)
            if room <= 0 or loop.stopping:
                continue
            try:
                claimed = await loop.consumer.claim(loop.claim_timeout.idle_ms, room)
                for message, payload, deliveries in claimed:
                    if message in loop.holding:
                        continue  # ours all along (a refresh came late): already queued here
                    if deliveries > self.config.max_deliveries:
                        await self.give_up(message, payload, f"the request was delivered {deliveries} times "
                                                             "without completing; moved to the dead letters")
                    else:
                        log.warning("%s: claimed %r after another worker left it (delivery %d)",
                                    loop.spec.name, message, deliveries)
                        await loop.admit(message, payload)
                if claimed:
                    loop.wake()
                backoff.reset()
            except (RedisError, OSError) as exc:
                _reraise_if_cancelled()
                log.warning("%s: claiming abandoned messages failed: %s", loop.spec.name, exc)
                await asyncio.sleep(backoff.next_delay())

    async def give_up(self, message: MessageId, payload: bytes | None, reason: str) -> None:
        """A message that keeps killing its workers or instances: dead-letter it and tell its caller."""
        log.error("%s: %r: %s", self.loop.spec.name, message, reason)
        try:
            env = decode_request(payload) if payload else None
        except InvalidInput:
            env = None
        if env is not None:
            reply = ReplyEnvelope(id=env.id, model_version=env.version, error_code="INTERNAL", error_message=reason)
            await self.loop.consumer.finish([(env.reply_to, reply)], [], [])
        await self.loop.consumer.dead_letter(message, reason, payload)

    async def _watch(self) -> None:
        limit_s = self.config.watchdog_s  # <= 0: no limit (instances are still revived)
        killed_at: dict[Instance, float] = {}
        while not self.loop.stopping:
            await asyncio.sleep(min(1.0, limit_s / 4) if limit_s > 0 else 1.0)
            now = time.monotonic()
            for instance in (i for insts in self.loop.instances.values() for i in insts):
                self._check_alive(instance)
                since = instance.running_since
                if limit_s <= 0:
                    continue
                if since is None:
                    killed_at.pop(instance, None)
                    if instance in self.hung:
                        self.hung.discard(instance)
                        log.warning("%s: instance %s finished its batch; the model is advertised again",
                                    self.loop.spec.name, instance.name)
                        self.loop.health_changed()
                    continue
                # A killed instance retries its batch alone (in the same run): it gets the same limit again.
                if now - max(since, killed_at.get(instance, 0.0)) > limit_s:
                    killed_at[instance] = now
                    self._hung(instance, now - since)

    def _check_alive(self, instance: Instance) -> None:
        """A backend whose restart failed (a Python stub whose initialize() now raises) is not advertised;
        it is tried again each round, on the instance's own thread, until it starts."""
        if getattr(instance.backend, "alive", True):
            if instance in self.down:
                self.down.discard(instance)
                log.warning("%s: instance %s runs again; the model is advertised again", self.loop.spec.name,
                            instance.name)
                self.loop.health_changed()
            return
        if instance not in self.down:
            self.down.add(instance)
            log.error("%s: instance %s could not be restarted; the model is no longer advertised by this worker",
                      self.loop.spec.name, instance.name)
            self.loop.health_changed()
        revive = getattr(instance.backend, "revive", None)
        if revive is not None and not self._reviving and not instance.busy:
            future = asyncio.get_running_loop().run_in_executor(instance.executor, revive)
            self._reviving.add(future)
            future.add_done_callback(self._reviving.discard)

    def _hung(self, instance: Instance, running_s: float) -> None:
        first = instance not in self.hung
        if first:
            self.hung.add(instance)
            log.error("%s: instance %s has executed one batch for %.0f s (watchdog limit %g s): it is hung; "
                      "the model is no longer advertised by this worker", self.loop.spec.name, instance.name,
                      running_s, self.config.watchdog_s)
            self.loop.health_changed()
        kill = getattr(instance.backend, "kill", None)
        if kill is not None:
            kill()  # the call in flight fails as a crash: retried alone up to max_deliveries, then poison
        elif self.on_hung is not None and first:
            self.on_hung(self.loop, instance)


def _reraise_if_cancelled() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError  # redis-py turned our cancellation into a connection error
