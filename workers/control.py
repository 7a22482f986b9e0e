"""What one worker serves, kept in line with model control's desired state (fleet/model_control.py).

`ModelHost.run` reconciles after every nudge (a load or unload call publishes on `fleet:control`), after
each of its own loads and unloads, and every few seconds anyway (every `repository_poll_secs` in poll
mode): it reads the targets and each target's entry, built once per generation (parsing, overrides,
auto-complete: workers/targets.py), and applies what workers/reconcile.py says.

* A unit (model version at a generation) loads in a thread, one at a time; its config (as completed)
  is published to `Keys.model_configs` before the unit is advertised, so a gateway that sees it ready
  can render and validate against it. A failed load is reported with its reason and not retried
  until the model's generation changes.
* An unload first stops advertising the unit (state UNLOADING in the heartbeat), keeps serving for
  `unload_grace_s` while gateways follow, then until its streams hold nothing undelivered (at most
  `request_timeout_s`), then stops reading, answers what it holds, and closes its instances.
* Each unit reads its version's streams under its own consumer name: the worker id, or while an older
  unit of the same version still drains here, the id with `~<generation>` (custody's keepalive and
  claims are per consumer).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import text_format
from redis.exceptions import RedisError

from fleet.admission import lane_count
from fleet.cancellation import raise_if_cancelled
from fleet.clock import SystemClock
from fleet.errors import ConfigError
from fleet.gc_tuning import freeze_after_startup
from fleet.model_control import (
    BOOT_GEN,
    ControlMode,
    ControlRecord,
    startup_names,
)
from fleet.placement import instance_device, placement_problem
from fleet.redis_clients import async_client
from fleet.repository import Completer, ModelEntry, with_composing
from fleet.settings import Settings
from workers.backends.base import LoadContext
from workers.consumer import StreamConsumer
from workers.host_context import HostContext
from workers.instance import Instance
from workers.loading import close_instances, load_version
from workers.loop import ModelLoop
from workers.reconcile import Load, Unit, UnitState, reconcile
from workers.sequence_tensors import SequenceTensors
from workers.targets import Targets

log = logging.getLogger("workers")


# Without a nudge, the desired state is read again this often (a missed pub/sub message only delays).
RECONCILE_EVERY_S = 5.0
# A stopping worker waits this long for loads in flight, so it can close what they load.
LOAD_AT_STOP_S = 60.0


@dataclass(slots=True)
class Served:
    unit: Unit
    state: UnitState
    entry: ModelEntry
    loop: ModelLoop | None = None
    task: asyncio.Task[None] | None = None
    instances: list[Instance] = field(default_factory=list)
    closed: bool = False


class ModelHost:
    def __init__(self, settings: Settings, ctx: HostContext, completer: Completer | None = None) -> None:
        self.settings = settings
        self.ctx = ctx
        self.mode = ControlMode(settings.model_control_mode)
        self.units: dict[Unit, Served] = {}
        self.failed: dict[Unit, str] = {}
        # model -> (generation, why this worker does not serve it): a config that cannot be built, a
        # device that does not fit, a name found in two repositories.
        self.problems: dict[str, tuple[str, str]] = {}
        self.seen: dict[str, str] = {}  # model -> the generation this worker last reconciled
        self.targets = Targets(settings, self.mode, ctx.keys, ctx.worker_id, ctx.client, completer)
        self._wake = asyncio.Event()
        self._jobs: set[asyncio.Task[None]] = set()  # unloads (cancelled at stop)
        self._loads: set[asyncio.Task[None]] = set()  # loads (finished at stop: a thread cannot be cancelled)
        self._load_lock = asyncio.Lock()
        self._stopping = False
        self._stop_event = asyncio.Event()

    # ------------------------------------------------------------------ what the worker asks

    def nudge(self) -> None:
        self._wake.set()

    def loops_of(self, model: str) -> list[ModelLoop]:
        return [s.loop for s in self.units.values() if s.unit.model == model and s.loop is not None]

    def sequence_units(self) -> list[tuple[str, int]]:
        """(model, version) of the sequence models served here (workers/sequence_reaper.py)."""
        return sorted({(s.unit.model, s.unit.version) for s in self.units.values()
                       if s.loop is not None and s.entry.spec.sequence is not None})

    def loops(self) -> list[ModelLoop]:
        return [s.loop for s in self.units.values() if s.loop is not None]

    def report(self) -> dict[str, str]:
        """The heartbeat's model fields (gateway/catalog.py reads them)."""
        ready: list[list[object]] = []
        units: list[list[object]] = []
        queued: dict[str, dict[str, int]] = {}
        lanes: dict[str, dict[str, dict[str, int]]] = {}  # model -> version -> lane -> queued
        for unit, served in sorted(self.units.items()):
            units.append([unit.model, unit.version, unit.gen, served.state.value])
            loop = served.loop
            if served.state is UnitState.READY and loop is not None and loop.healthy:
                ready.append([unit.model, unit.version, unit.gen])
            if loop is not None:
                for lane, n in loop.queued_by_lane().get(unit.version, {}).items():
                    per = queued.setdefault(unit.model, {})
                    per[str(unit.version)] = per.get(str(unit.version), 0) + n
                    by_lane = lanes.setdefault(unit.model, {}).setdefault(str(unit.version), {})
                    by_lane[str(lane)] = by_lane.get(str(lane), 0) + n
        failed = {m: why for m, (_, why) in self.problems.items()}
        failed_gens = {m: gen for m, (gen, _) in self.problems.items()}
        for unit, why in sorted(self.failed.items()):
            failed.setdefault(unit.model, f"version {unit.version}: {why}")
            failed_gens.setdefault(unit.model, unit.gen)
        return {"models": json.dumps(ready), "units": json.dumps(units), "failed": json.dumps(failed),
                "failed_gens": json.dumps(failed_gens), "seen": json.dumps(self.seen), "queued": json.dumps(queued),
                "queued_lanes": json.dumps(lanes)}

    # ------------------------------------------------------------------ lifecycle

    async def seed(self) -> None:
        """Explicit mode: `--load-model` names become control records unless one exists already (an
        operator's later unload is not undone by a worker restarting)."""
        if self.mode is not ControlMode.EXPLICIT or not self.settings.load_models:
            return
        repo = await asyncio.to_thread(self.targets.scan)
        for name in with_composing(repo, startup_names(self.settings.load_models, repo.dirs)):  # and their steps
            await self.ctx.client.hsetnx(self.ctx.keys.models(), name, ControlRecord(BOOT_GEN, True).encode())

    async def run(self) -> None:
        period = self.settings.repository_poll_secs if self.mode is ControlMode.POLL else RECONCILE_EVERY_S
        while True:
            self._wake.clear()
            try:
                await self.reconcile_once()
            except (RedisError, OSError, ConfigError) as exc:
                # Redis away, a repository briefly unmounted: what serves keeps serving meanwhile.
                raise_if_cancelled()
                log.warning("cannot work out the desired model state: %s", exc)
            try:
                async with asyncio.timeout(period):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def load_context(self, model: str, version: int) -> LoadContext | None:
        """How a serving Python-backend instance of (model, version) here was loaded (BLS starts nested
        instances from it); None if this worker serves no such instance."""
        for unit, served in self.units.items():
            if unit.model == model and unit.version == version and served.state == UnitState.READY:
                for instance in served.instances:
                    ctx = getattr(instance.backend, "context", None)
                    if isinstance(ctx, LoadContext):
                        return ctx
        return None

    async def stop(self) -> None:
        """Stop reconciling, then stop every unit: each answers what it holds. Unloads in progress skip
        the rest of their drain; loads in flight close what they load (a thread cannot be cancelled)."""
        self._stopping = True
        self._stop_event.set()
        units = list(self.units.values())
        await asyncio.gather(*(self._close(s) for s in units))
        pending = list(self._jobs | self._loads)
        if pending:
            await asyncio.wait(pending, timeout=LOAD_AT_STOP_S)
        self.units.clear()

    # ------------------------------------------------------------------ reconciling

    async def reconcile_once(self) -> None:
        targets, problems = await self.targets.read()
        problems = dict(problems)
        seen = {name: gen for name, (gen, _) in problems.items()}
        desired: dict[tuple[str, int], str] = {}
        entries: dict[str, ModelEntry] = {}
        for name, target in sorted(targets.items()):
            built = await self.targets.entry(target)
            seen[name] = target.gen
            if isinstance(built, str):
                problems[name] = (target.gen, built)
                # A generation that cannot even be built leaves what serves now serving (Triton keeps
                # the old model when a reload fails).
                desired.update({(u.model, u.version): u.gen for u, s in self.units.items()
                                if u.model == name and s.state is UnitState.READY})
                continue
            if built.spec.ensemble:
                continue  # gateways run ensembles (gateway/ensembles.py): no instances here
            problem = placement_problem(built.spec, self.ctx.device)
            if problem is not None:  # another worker's device fits it (fleet/placement.py)
                problems[name] = (target.gen, f"not served by a {self.ctx.device} worker: {problem}")
                continue
            entries[name] = built
            desired.update({(name, v): target.gen for v in built.versions})
        self.failed = {u: why for u, why in self.failed.items() if desired.get((u.model, u.version)) == u.gen}
        self.targets.keep_only(targets)
        actions = reconcile(desired, {u: s.state for u, s in self.units.items()}, set(self.failed))
        for action in actions:
            if self._stopping:
                return
            if isinstance(action, Load):
                self.units[action.unit] = Served(action.unit, UnitState.LOADING, entries[action.unit.model])
                self._spawn(self._load(action.unit), self._loads)
            else:
                self.units[action.unit].state = UnitState.UNLOADING
                self._spawn(self._unload(action.unit), self._jobs)
        # Only now: a heartbeat must never say "reconciled" before the loads it started are listed.
        self.problems = problems
        self.seen = seen
        if actions:
            self.ctx.beat_now()

    @staticmethod
    def _spawn(job: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
        task = asyncio.ensure_future(job)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _load(self, unit: Unit) -> None:
        served = self.units[unit]
        entry = served.entry
        try:
            async with self._load_lock:
                if self._stopping:
                    self.units.pop(unit, None)
                    return
                device = instance_device(entry.spec, self.ctx.device)
                seq = entry.spec.sequence
                # Its initial states' files are read (and checked) now: a missing one fails the load.
                sequence_tensors = None if seq is None else \
                    SequenceTensors(seq, entry.spec.max_batch_size > 0, entry.path, unit.version)
                served.instances = await asyncio.to_thread(load_version, entry, unit.version, device,
                                                           self.settings.max_deliveries, self.ctx.limiter,
                                                           self.ctx.bls, self.ctx.emit, self.ctx.writes,
                                                           self.ctx.worker_id)
            if self._stopping:
                self.units.pop(unit, None)
                await asyncio.to_thread(close_instances, {unit.version: served.instances})
                return
        except Exception as exc:
            log.error("model '%s' version %d failed to load: %s", unit.model, unit.version, exc)
            self.units.pop(unit, None)
            self.failed[unit] = str(exc)
            self.ctx.beat_now()
            self.nudge()
            return
        try:
            await self.ctx.client.hset(self.ctx.keys.model_configs(unit.model), unit.gen,
                                       text_format.MessageToString(entry.spec.proto))
        except (RedisError, OSError) as exc:
            raise_if_cancelled()
            log.warning("cannot publish the config of model '%s': %s", unit.model, exc)
        if self._stopping or served.closed:  # the worker stopped meanwhile (stop() closed the instances)
            self.units.pop(unit, None)
            return
        sibling = any(u.model == unit.model and u.version == unit.version and u != unit for u in self.units)
        name = f"{self.ctx.worker_id}~{unit.gen}" if sibling else self.ctx.worker_id
        client = async_client(self.settings.redis_url_or_default)  # its readers block in XREADGROUP
        lanes = lane_count(entry.spec)
        streams = None
        if entry.spec.sequence is not None:  # its online lane is this worker's own (gateway/sequences.py)
            streams = [self.ctx.keys.sequence_queue(unit.model, unit.version, self.ctx.worker_id),
                       *(self.ctx.keys.queue(unit.model, lane, version=unit.version) for lane in range(1, lanes))]
        consumer = StreamConsumer(client, self.ctx.keys, unit.model, unit.version, name, lanes=lanes,
                                  redis_clock=self.ctx.redis_clock, streams=streams)
        loop = ModelLoop(entry.spec, {unit.version: served.instances}, consumer, SystemClock(), self.ctx.redis_clock,
                         self.ctx.loop_config, on_hung=self.ctx.on_hung, on_health=self.ctx.beat_now,
                         on_give_up=self.ctx.on_give_up, live_workers=self.ctx.live_workers,
                         sequence_tensors=sequence_tensors, neighbours=self.ctx.neighbours)
        served.loop = loop
        served.task = asyncio.create_task(loop.run(), name=f"model '{unit.model}' version {unit.version}")
        served.task.add_done_callback(self.ctx.on_loop_done)
        served.state = UnitState.READY
        log.info("model '%s' version %d ready (generation %s, %d instance(s))", unit.model, unit.version, unit.gen,
                 len(served.instances))
        self.ctx.beat_now()
        self.nudge()  # an older unit it replaces can go now
        if len(self._loads) <= 1:  # the last load in flight: what it loaded lives as long as the worker
            freeze_after_startup()

    async def _unload(self, unit: Unit) -> None:
        served = self.units[unit]
        loop = served.loop
        assert loop is not None
        log.info("model '%s' version %d (generation %s) unloading: draining", unit.model, unit.version, unit.gen)
        await self._pause(self.settings.unload_grace_s)
        await self._drain(loop, self.settings.request_timeout_s)
        if not self._stop_event.is_set() and not await self._served_elsewhere(unit):
            # Nobody else reads this version's streams now: what still arrives (from a gateway a heartbeat
            # behind, or a bulk job's window) is answered UNAVAILABLE rather than left for nobody.
            loop.retire(f"model '{unit.model}' version {unit.version} is unloaded")
            await self._pause(max(1.0, self.settings.unload_grace_s))
            await self._drain(loop, 5.0)
        self.units.pop(unit, None)
        await self._close(served)
        log.info("model '%s' version %d (generation %s) unloaded", unit.model, unit.version, unit.gen)
        self.ctx.beat_now()
        self.nudge()

    async def _pause(self, seconds: float) -> None:
        """Sleep, cut short when the worker stops."""
        try:
            async with asyncio.timeout(seconds):
                await self._stop_event.wait()
        except TimeoutError:
            pass

    async def _drain(self, loop: ModelLoop, limit_s: float) -> None:
        """Until nothing is left unread in the unit's streams (at most `limit_s`, or the worker stops)."""
        clock = asyncio.get_running_loop()
        give_up = clock.time() + limit_s
        while clock.time() < give_up and not self._stop_event.is_set():
            try:
                if await loop.consumer.undelivered() == 0:
                    return
            except (RedisError, OSError) as exc:
                raise_if_cancelled()
                log.debug("cannot read the backlog of model '%s': %s", loop.spec.name, exc)
            await self._pause(0.2)

    async def _served_elsewhere(self, unit: Unit) -> bool:
        """Whether another unit here, or another live worker, serves this version (reads its streams)."""
        if any(u.model == unit.model and u.version == unit.version and s.state is UnitState.READY
               for u, s in self.units.items() if u != unit):
            return True
        try:
            return await self.ctx.serves_elsewhere(unit.model, unit.version)
        except (RedisError, OSError) as exc:
            raise_if_cancelled()
            log.warning("cannot read the other workers' heartbeats: %s", exc)
            return True  # not knowing, leave the streams to whoever may read them

    async def _close(self, served: Served) -> None:
        """Stop the unit's loop (it answers what it holds) and close its instances; once."""
        if served.closed:
            return
        served.closed = True
        if served.loop is not None:
            served.loop.stop()
        if served.task is not None:
            await asyncio.wait({served.task})  # never cancels the loop: it finishes what it holds
        try:
            await asyncio.to_thread(close_instances, {served.unit.version: served.instances})
        except Exception:
            log.exception("closing model '%s' version %d failed", served.unit.model, served.unit.version)
        if served.loop is not None:
            await served.loop.consumer.close()
