"""What the gateway knows about models: the repository it serves (parsed once at start) and which
(model, version) pairs some live worker reports ready, refreshed from the workers' heartbeats."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fleet.errors import ModelNotFound, ModelNotReady, VersionNotFound
from fleet.repository import ModelEntry, Repository


@dataclass(slots=True)
class ModelView:
    """One model with everything the HTTP layer renders, computed once."""

    entry: ModelEntry
    config_json: dict[str, Any]
    metadata_inputs: list[dict[str, Any]]
    metadata_outputs: list[dict[str, Any]]

    @classmethod
    def build(cls, entry: ModelEntry) -> ModelView:
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
        )


@dataclass(slots=True)
class Catalog:
    repository: Repository
    views: dict[str, ModelView] = field(default_factory=dict)
    # (model, version) pairs that at least one live worker has loaded.
    ready: set[tuple[str, int]] = field(default_factory=set)
    # model -> reason reported by a worker that failed to load it.
    failures: dict[str, str] = field(default_factory=dict)
    # (model, version) -> requests the workers hold queued, not yet executing (summed over workers).
    queued: dict[tuple[str, int], int] = field(default_factory=dict)
    workers: int = 0

    @classmethod
    def from_repository(cls, repository: Repository) -> Catalog:
        views = {name: ModelView.build(entry) for name, entry in repository.models.items()}
        return cls(repository=repository, views=views)

    def view(self, name: str) -> ModelView:
        view = self.views.get(name)
        if view is None:
            raise ModelNotFound(name)
        return view

    def ready_versions(self, name: str) -> list[int]:
        return [v for v in self.view(name).entry.versions if (name, v) in self.ready]

    def resolve(self, name: str, version: str | None) -> tuple[ModelView, int]:
        """The model and the version a request goes to; raises the Triton-shaped lookup errors."""
        view = self.view(name)
        if version:
            v = int(version)
            if v not in view.entry.versions:
                raise VersionNotFound(name, version)
            if (name, v) not in self.ready:
                raise ModelNotReady(f"Request for unknown model: '{name}' version {v} is not at ready state")
            return view, v
        ready = self.ready_versions(name)
        if not ready:
            reason = self.failures.get(name)
            detail = f": {reason}" if reason else " (no ready worker serves it)"
            raise ModelNotReady(f"Request for unknown model: '{name}' has no available versions{detail}")
        return view, ready[-1]

    def all_ready(self) -> bool:
        return all(self.ready_versions(name) for name in self.views)

    def update_from_heartbeats(self, beats: list[dict[bytes, bytes]]) -> None:
        ready: set[tuple[str, int]] = set()
        failures: dict[str, str] = {}
        queued: dict[tuple[str, int], int] = {}
        for beat in beats:
            for item in json.loads(beat.get(b"models", b"[]")):
                ready.add((item[0], int(item[1])))
            failures.update(json.loads(beat.get(b"failed", b"{}")))
            for model, per in json.loads(beat.get(b"queued", b"{}")).items():
                for version, n in per.items():
                    queued[(model, int(version))] = queued.get((model, int(version)), 0) + int(n)
        self.ready = ready
        self.failures = failures
        self.queued = queued
        self.workers = len(beats)
