"""What the gateway knows about models: which ones it serves (model control's targets: the repository in
none and poll mode, the control records in explicit mode), each with the config it validates against,
and which versions some live worker reports ready, refreshed from the workers' heartbeats.

A model's config is the one a worker published when it loaded the current generation (after a load
call's override and auto-complete, workers/control.py); until then, the repository's own
config.pbtxt when the target has no override; until then the model is known but not servable (its
infer requests get 503, its metadata 400 as an unknown model). While a new generation loads, the
config of the one still serving stays.

Requests go to the versions workers report ready, whatever their generation: during a roll the old
version serves until the new one is ready (unversioned requests then switch to the highest ready
version), and a version being unloaded is no longer reported, so nothing new is routed to it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from fleet.config_proto import model_config_pb2 as pb
from fleet.ensemble import EnsemblePlan, plan
from fleet.errors import ConfigError, ModelNotFound, ModelNotReady, ModelUnloaded, VersionNotFound
from fleet.gpu_metrics import GpuReading, decode_readings
from fleet.model_config import spec_from_proto
from fleet.model_control import Target
from fleet.repository import ModelEntry, Repository, version_dirs

MAX_ENSEMBLE_DEPTH = 8  # ensembles of ensembles, this deep at most

STEP_NOT_READY = "has no ready version"  # an ensemble waiting for a step (not a config problem)


@dataclass(slots=True)
class ModelView:
    """One model with everything the HTTP layer renders, computed once."""

    entry: ModelEntry
    config_json: dict[str, Any]
    metadata_inputs: list[dict[str, Any]]
    metadata_outputs: list[dict[str, Any]]
    gen: str = ""  # the generation whose config this is ("" = the repository's own)

    @classmethod
    def build(cls, entry: ModelEntry, gen: str = "") -> ModelView:
        spec = entry.spec
        return cls(
            entry=entry,
            config_json=spec.to_json(),
            metadata_inputs=[
                {"name": t.name, "datatype": t.datatype.name, "shape": spec.metadata_shape(t)} for t in spec.inputs
            ],
            metadata_outputs=[
                {"name": t.name, "datatype": t.datatype.name, "shape": spec.metadata_shape(t)} for t in spec.outputs
            ],
            gen=gen,
        )


_NONE_READY: list[int] = []  # (never changed: ready_versions's callers only read it)


@dataclass(frozen=True, slots=True)
class UnitReport:
    """One model version at one generation on one worker, as its heartbeat says."""

    worker: int  # index of its heartbeat in the last read
    model: str
    version: int
    gen: str
    state: str  # LOADING, READY (and healthy), UNLOADING


@dataclass(slots=True)
class Catalog:
    repository: Repository
    targets: dict[str, Target] = field(default_factory=dict)
    views: dict[str, ModelView] = field(default_factory=dict)
    # (model, version) pairs that at least one live worker serves. Replaced, never changed in place: the
    # versions of each model are indexed once per replacement (`ready_versions`, on every request).
    ready: frozenset[tuple[str, int]] = frozenset()
    # model -> reason reported by a worker that does not serve it (failed load, device, ...).
    failures: dict[str, str] = field(default_factory=dict)
    failure_gens: dict[str, str] = field(default_factory=dict)
    # (model, version) -> requests the workers hold queued, not yet executing (summed over workers).
    queued: dict[tuple[str, int], int] = field(default_factory=dict)
    # (model, version, lane) -> the same per lane (gateway/metrics.py's fleet_pending_requests).
    queued_lanes: dict[tuple[str, int, int], int] = field(default_factory=dict)
    workers: int = 0
    gpus: list[GpuReading] = field(default_factory=list)  # the live workers' GPUs, one reading per UUID
    # (model, version) -> ids of the live workers advertising it ready (where a sequence may start).
    serving: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    unloaded: frozenset[str] = frozenset()  # explicit mode: models whose record says unloaded
    units: list[UnitReport] = field(default_factory=list)
    # per live worker: model -> the generation it last reconciled
    seen: list[dict[str, str]] = field(default_factory=list)
    # (model, generation) -> the config a worker published for it (pbtxt text)
    configs: dict[tuple[str, str], str] = field(default_factory=dict)
    # (model, generation, source) -> the view built from it, so a refresh rebuilds nothing unchanged
    _built: dict[tuple[str, str, str], ModelView] = field(default_factory=dict)
    # Ensembles (fleet/ensemble.py): the plan of each whose steps all have a ready version; why not, else.
    ensemble_plans: dict[str, EnsemblePlan] = field(default_factory=dict)
    ensemble_problems: dict[str, str] = field(default_factory=dict)
    _ready_gens: set[tuple[str, str]] = field(default_factory=set)
    _stale: set[tuple[str, str]] = field(default_factory=set)  # configs to read again
    _ready_index: dict[str, list[int]] = field(default_factory=dict)  # model -> its ready versions, ascending
    _ready_indexed: frozenset[tuple[str, int]] | None = None  # the `ready` that _ready_index was built from

    @classmethod
    def from_repository(cls, repository: Repository, targets: dict[str, Target] | None = None) -> Catalog:
        catalog = cls(repository=repository)
        catalog.set_targets(repository, targets if targets is not None else {})
        return catalog

    # ------------------------------------------------------------------ lookups

    def view(self, name: str) -> ModelView:
        view = self.views.get(name)
        if view is None:
            raise ModelUnloaded(name) if name in self.unloaded else ModelNotFound(name)
        return view

    def ready_versions(self, name: str) -> list[int]:
        """The ready versions of `name`, ascending (the caller must not change the list: it is the index's)."""
        if name not in self.views:
            return []
        if self._ready_indexed is not self.ready:
            index: dict[str, list[int]] = {}
            for model, version in self.ready:
                index.setdefault(model, []).append(version)
            self._ready_index = {model: sorted(versions) for model, versions in index.items()}
            self._ready_indexed = self.ready
        return self._ready_index.get(name, _NONE_READY)

    def resolve(self, name: str, version: str | None) -> tuple[ModelView, int]:
        """The model and the version a request goes to; raises the Triton-shaped lookup errors."""
        view = self.views.get(name)
        if view is None:
            if name in self.targets:
                raise ModelNotReady(f"Request for unknown model: '{name}' has no available versions"
                                    f"{self._why_not(name)}")
            # tritonserver 2.51: "has no available versions" once loaded and unloaded; a repository model never
            # loaded "is not found", as one that is not there.
            raise ModelUnloaded(name) if name in self.unloaded else ModelNotFound(name)
        if version:
            v = int(version)
            if (name, v) in self.ready:
                return view, v
            if v not in view.entry.versions:
                raise VersionNotFound(name, version)
            raise ModelNotReady(f"Request for unknown model: '{name}' version {v} is not at ready state")
        ready = self.ready_versions(name)
        if not ready:
            raise ModelNotReady(f"Request for unknown model: '{name}' has no available versions{self._why_not(name)}")
        return view, ready[-1]

    def is_ready(self, name: str, version: str | None) -> bool:
        """Whether `resolve` would find a ready version: as Triton's ModelIsReady, any failed lookup (unknown
        model or version, unloaded, not ready) is "not ready", never an error."""
        try:
            self.resolve(name, version)
        except (ModelNotFound, ModelUnloaded, VersionNotFound, ModelNotReady):
            return False
        return True

    def _why_not(self, name: str) -> str:
        reason = self.failures.get(name) or self.ensemble_problems.get(name)
        return f": {reason}" if reason else " (no ready worker serves it)"

    def all_ready(self) -> bool:
        return all(self.ready_versions(name) for name in self.targets)

    def wanted_gens(self) -> list[tuple[str, str]]:
        """(model, generation) pairs whose published config this catalog would use and lacks."""
        pairs = {(t.name, t.gen) for t in self.targets.values()}
        pairs |= {(u.model, u.gen) for u in self.units if u.model in self.targets and u.state == "READY"}
        return sorted(p for p in pairs if p not in self.configs or p in self._stale)

    # ------------------------------------------------------------------ updates

    def set_targets(self, repository: Repository, targets: dict[str, Target]) -> None:
        self.repository = repository
        self.targets = targets
        self._rebuild()

    def add_configs(self, configs: dict[tuple[str, str], str]) -> None:
        for pair, text in configs.items():
            self._stale.discard(pair)
            if self.configs.get(pair) != text:
                self._built.pop((pair[0], pair[1], "c"), None)
            self.configs[pair] = text
        if configs:
            self._rebuild()

    def update_from_heartbeats(self, beats: list[dict[bytes, bytes]]) -> None:
        ready: set[tuple[str, int]] = set()
        failures: dict[str, str] = {}
        failure_gens: dict[str, str] = {}
        queued: dict[tuple[str, int], int] = {}
        queued_lanes: dict[tuple[str, int, int], int] = {}
        units: list[UnitReport] = []
        seen: list[dict[str, str]] = []
        serving: dict[tuple[str, int], list[str]] = {}
        gpus: dict[str, GpuReading] = {}
        for i, beat in enumerate(beats):
            gpus |= {r.uuid: r for r in decode_readings(beat.get(b"gpus"))}
            advertised = set()
            worker_id = beat.get(b"id", b"").decode()
            for item in json.loads(beat.get(b"models", b"[]")):
                ready.add((item[0], int(item[1])))
                if worker_id:
                    serving.setdefault((item[0], int(item[1])), []).append(worker_id)
                advertised.add((item[0], int(item[1]), item[2] if len(item) > 2 else ""))
            for model, version, gen, state in json.loads(beat.get(b"units", b"[]")):
                if state == "READY" and (model, int(version), gen) not in advertised:
                    state = "UNAVAILABLE"  # loaded, but its loop is not healthy (hung, cannot read)
                units.append(UnitReport(i, model, int(version), gen, state))
            failures.update(json.loads(beat.get(b"failed", b"{}")))
            failure_gens.update(json.loads(beat.get(b"failed_gens", b"{}")))
            seen.append(json.loads(beat.get(b"seen", b"{}")))
            for model, per in json.loads(beat.get(b"queued", b"{}")).items():
                for version, n in per.items():
                    queued[(model, int(version))] = queued.get((model, int(version)), 0) + int(n)
            for model, per_version in json.loads(beat.get(b"queued_lanes", b"{}")).items():
                for version, per_lane in per_version.items():
                    for lane, n in per_lane.items():
                        key = (model, int(version), int(lane))
                        queued_lanes[key] = queued_lanes.get(key, 0) + int(n)
        self.ready = frozenset(ready)
        self.serving = serving
        self.failures = failures
        self.failure_gens = failure_gens
        self.queued = queued
        self.queued_lanes = queued_lanes
        self.gpus = [gpus[u] for u in sorted(gpus)]
        self.units = units
        self.seen = seen
        self.workers = len(beats)
        # A generation that has just become ready was just published (again, perhaps: a worker restarted
        # with a changed config under the same generation): read its config anew.
        # Until it arrives, the config read before keeps serving.
        ready_gens = {(u.model, u.gen) for u in units if u.state == "READY"}
        self._stale |= (ready_gens - self._ready_gens) & set(self.configs)
        self._ready_gens = ready_gens
        self._rebuild()
        # Configs of generations nobody wants or serves any more are dropped (they are fetched again if
        # a generation comes back).
        keep = {(t.name, t.gen) for t in self.targets.values()} | {(u.model, u.gen) for u in self.units}
        self.configs = {k: v for k, v in self.configs.items() if k in keep}
        self._stale &= set(self.configs)

    def _rebuild(self) -> None:
        views: dict[str, ModelView] = {}
        for name, target in self.targets.items():
            view = self._view_of(target)
            if view is not None:
                views[name] = view
        self.views = views
        self._plan_ensembles()
        live = {(n, v.gen, "c" if v.gen else "r") for n, v in views.items()}
        self._built = {k: v for k, v in self._built.items() if k in live}

    def _plan_ensembles(self) -> None:
        """Plan each ensemble against its steps' configs; it is ready (every version of it) when each
        step's model has the version the step names ready. Nested ensembles settle level by level."""
        names = [n for n, v in self.views.items() if v.entry.spec.ensemble]
        self.ready = frozenset(p for p in self.ready if p[0] not in names)
        plans: dict[str, EnsemblePlan] = {}
        problems: dict[str, str] = {}
        for _ in range(MAX_ENSEMBLE_DEPTH):
            settled = len(plans)
            for name in names:
                if name in plans:
                    continue
                spec = self.views[name].entry.spec
                wanted = {s.model_name for s in spec.proto.ensemble_scheduling.step}
                try:
                    planned = plan(spec, {m: self.views[m].entry.spec for m in wanted if m in self.views})
                except ConfigError as exc:
                    problems[name] = exc.message
                    continue
                waiting = [s.model for s in planned.steps if not self._step_ready(s.model, s.version)]
                if waiting:
                    problems[name] = f"step model '{waiting[0]}' {STEP_NOT_READY}"
                    continue
                plans[name] = planned
                self.ready = self.ready | {(name, v) for v in self.views[name].entry.versions}
            if len(plans) == settled:
                break
        self.ensemble_plans = plans
        self.ensemble_problems = {n: why for n, why in problems.items() if n not in plans}

    def _step_ready(self, model: str, version: int) -> bool:
        return bool(self.ready_versions(model)) if version < 0 else (model, version) in self.ready

    def _view_of(self, target: Target) -> ModelView | None:
        """The config of the target's generation once it serves, else of a generation that serves (the
        one requests still reach while the new one loads), else of the target's, else (no override) the
        repository's own."""
        ready = sorted({u.gen for u in self.units if u.model == target.name and u.state == "READY"})
        gens = ([target.gen] if target.gen in ready else []) + [g for g in ready if g != target.gen]
        if target.gen not in ready:
            gens.append(target.gen)
        for gen in gens:
            text = self.configs.get((target.name, gen))
            if text is not None:
                view = self._from_config(target, gen, text)
                if view is not None:
                    return view
        local = self.repository.models.get(target.name)
        if local is not None and target.config_override is None and not target.files:
            key = (target.name, "", "r")
            if key not in self._built:
                self._built[key] = ModelView.build(local)
            return self._built[key]
        return None

    def _from_config(self, target: Target, gen: str, text: str) -> ModelView | None:
        key = (target.name, gen, "c")
        if key in self._built:
            return self._built[key]
        try:
            cfg = pb.ModelConfig()
            text_format.Parse(text, cfg)
            spec = spec_from_proto(cfg, source=f"config of '{target.name}' generation {gen}", model_name=target.name)
        except (ConfigError, text_format.ParseError):
            return None  # a worker of another fleet version: fall back as if not published
        versions = self._versions(target, spec)
        path = target.model_dir if target.model_dir is not None else self.repository.dirs.get(target.name)
        # A model loaded only from `file:` overrides has no directory here; gateways never read model files.
        entry = ModelEntry(name=target.name, path=path or Path(), spec=spec, versions=versions)
        self._built[key] = ModelView.build(entry, gen)
        return self._built[key]

    def _versions(self, target: Target, spec: Any) -> tuple[int, ...]:
        if target.files:
            present = sorted({int(f.split("/", 1)[0]) for f in target.files if f.split("/", 1)[0].isdigit()})
        elif target.model_dir is not None:
            try:
                present = list(version_dirs(target.model_dir))
            except OSError:
                present = []
        else:
            present = []
        return tuple(spec.version_policy.select(present)) if present else ()

