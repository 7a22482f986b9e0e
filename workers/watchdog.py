"""The watchdog of one model's instances on one worker.

- Hung: an instance executing one batch longer than `watchdog_s` is hung. The model stops being
  advertised (readiness turns false if nothing else serves it) and the instance is restarted: killed,
  where its backend can be interrupted (a Python backend's stub process: the call in flight then fails
  as a crash and is retried alone, up to max_deliveries); otherwise `on_hung` decides (the worker exits
  for its supervisor, and other workers claim what it held).
- Computed by the loop: a batch the event loop computes itself (workers/inline.py) holds the loop, and
  this watchdog with it, so a thread of its own watches those (`guard_inline`); a hung one is never
  interruptible, and `on_hung` is called from that thread.
- Down: a backend whose restart failed (a Python stub whose initialize() now raises) is not advertised;
  it is tried again each round, on the instance's own thread, until it starts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable

from workers.instance import Instance

log = logging.getLogger(__name__)

HungHandler = Callable[[Instance], None]


class Watchdog:
    def __init__(self, model: str, instances: Iterable[Instance], watchdog_s: float, *,
                 on_hung: HungHandler | None = None, on_health: Callable[[], None] | None = None) -> None:
        self.model = model
        self.instances = list(instances)
        self.watchdog_s = watchdog_s  # <= 0: no limit (instances are still revived)
        self.on_hung = on_hung
        self.on_health = on_health or (lambda: None)
        # By instance, not name: the versions of a model name their instances alike.
        self.hung: set[Instance] = set()
        self.down: set[Instance] = set()
        self._reviving: set[asyncio.Future[bool]] = set()
        self._killed_at: dict[Instance, float] = {}
        self._guard: threading.Event | None = None  # set: the inline guard's thread stops

    @property
    def healthy(self) -> bool:
        return not self.hung and not self.down

    @property
    def _period_s(self) -> float:
        """How often the instances are looked at: a quarter of the limit, at least once a second."""
        return min(1.0, self.watchdog_s / 4) if self.watchdog_s > 0 else 1.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            self.check(time.monotonic())

    def guard_inline(self) -> bool:
        """Watch the batches the loop computes itself, from a thread; whether it does. Not where nothing
        could be done about a hung one (no limit or no `on_hung`), nor where no instance computes so."""
        if self.watchdog_s <= 0 or self.on_hung is None or not any(i.inline_capable for i in self.instances):
            return False
        if self._guard is None:
            self._guard = threading.Event()
            threading.Thread(target=self._watch_inline, args=(self._guard, self.on_hung), daemon=True,
                             name=f"{self.model}-inline-watchdog").start()
        return True

    def unguard(self) -> None:
        if self._guard is not None:
            self._guard.set()
            self._guard = None

    def _watch_inline(self, stop: threading.Event, on_hung: HungHandler) -> None:
        while not stop.wait(self._period_s):
            now = time.monotonic()
            for instance in self.instances:
                since = instance.running_since
                if instance.running_inline and since is not None and now - since > self.watchdog_s:
                    log.error("%s: instance %s has executed one batch on the event loop for %.0f s (watchdog "
                              "limit %g s): it is hung", self.model, instance.name, now - since, self.watchdog_s)
                    on_hung(instance)  # the loop is held by the forward: only the process can go
                    return

    def check(self, now: float) -> None:
        for instance in self.instances:
            self._check_alive(instance)
            if self.watchdog_s > 0:
                self._check_running(instance, now)

    def _check_running(self, instance: Instance, now: float) -> None:
        since = instance.running_since
        if since is None:
            self._killed_at.pop(instance, None)
            if instance in self.hung:
                self.hung.discard(instance)
                log.warning("%s: instance %s finished its batch; the model is advertised again", self.model,
                            instance.name)
                self.on_health()
            return
        # A killed instance retries its batch alone (in the same run): it gets the same limit again. A
        # backend that says when it last made progress (a generation engine's last iteration: a long
        # generation is not a hung one) is hung only once that stops.
        progress = getattr(instance.backend, "progress_at", None) or 0.0
        if now - max(since, progress, self._killed_at.get(instance, 0.0)) > self.watchdog_s:
            self._killed_at[instance] = now
            self._hung(instance, now - since)

    def _check_alive(self, instance: Instance) -> None:
        backend = instance.backend
        if backend.alive:
            if instance in self.down:
                self.down.discard(instance)
                log.warning("%s: instance %s runs again; the model is advertised again", self.model, instance.name)
                self.on_health()
            return
        if instance not in self.down:
            self.down.add(instance)
            log.error("%s: instance %s could not be restarted; the model is no longer advertised by this worker",
                      self.model, instance.name)
            self.on_health()
        if not self._reviving and not instance.busy:
            future = asyncio.get_running_loop().run_in_executor(instance.executor, backend.revive)
            self._reviving.add(future)
            future.add_done_callback(self._reviving.discard)

    def _hung(self, instance: Instance, running_s: float) -> None:
        first = instance not in self.hung
        if first:
            self.hung.add(instance)
            log.error("%s: instance %s has executed one batch for %.0f s (watchdog limit %g s): it is hung; "
                      "the model is no longer advertised by this worker", self.model, instance.name,
                      running_s, self.watchdog_s)
            self.on_health()
        if instance.backend.interruptible:
            instance.backend.kill()  # the call in flight fails as a crash: retried alone, then poison
        elif self.on_hung is not None and first:
            self.on_hung(instance)
