"""What the health, metadata and repository endpoints answer, protocol-neutral: the HTTP routes
(gateway/routes.py) render it as JSON, the gRPC service (gateway/grpc/service.py) as Triton's messages,
so both protocols always say the same thing."""

from __future__ import annotations

from typing import Any

from fleet.broker import Broker
from fleet.errors import VersionNotFound
from gateway.catalog import Catalog, ModelView


async def not_ready_reason(catalog: Catalog, broker: Broker) -> str | None:
    """Why the server is not ready (Redis unreachable, a model without a ready worker), or None."""
    try:
        await broker.ping()
    except Exception:
        return "Redis is not reachable"
    if not catalog.all_ready():
        return "not every model has a ready worker"
    return None


def model_view(catalog: Catalog, name: str, version: str | None) -> ModelView:
    """The model, checking that `version` (None: the default) is one of its versions; raises the
    Triton-shaped lookup errors (unknown model, unknown version)."""
    view = catalog.view(name)
    if version is not None and int(version) not in view.entry.versions:
        raise VersionNotFound(name, version)
    return view


def model_metadata(catalog: Catalog, name: str, version: str | None) -> dict[str, Any]:
    """Triton's model metadata: `versions` is the version asked for, else the ready ones (all of the
    model's when none is ready, so a client can still read the tensors)."""
    view = model_view(catalog, name, version)
    if version is not None:
        versions = [version]
    else:
        ready = catalog.ready_versions(name) or list(view.entry.versions)
        versions = [str(v) for v in ready]
    return {
        "name": name,
        "versions": versions,
        "platform": view.entry.spec.metadata_platform,
        "inputs": view.metadata_inputs,
        "outputs": view.metadata_outputs,
    }


def repository_index(catalog: Catalog, only_ready: bool) -> list[dict[str, Any]]:
    """Triton's repository index: every model in the repositories (and any loaded from overrides), one
    entry per version with its state (READY, LOADING, UNLOADING, UNAVAILABLE with the reason); a model
    never loaded is its name alone, as in Triton."""
    items: list[dict[str, Any]] = []
    names = set(catalog.repository.dirs) | set(catalog.targets) | set(catalog.repository.errors)
    for name in sorted(names):
        units = [u for u in catalog.units if u.model == name]
        target = catalog.targets.get(name)
        view = catalog.views.get(name)
        versions = set(view.entry.versions if view else ()) | {u.version for u in units}
        versions |= {v for m, v in catalog.ready if m == name}
        reason = (catalog.failures.get(name) or catalog.ensemble_problems.get(name)
                  or catalog.repository.errors.get(name))
        if target is None:
            if name not in catalog.repository.dirs:  # in two repositories: never served
                items.append({"name": name, "state": "UNAVAILABLE", "reason": reason or "not servable"})
            elif units:
                items.extend({"name": name, "version": str(v), "state": "UNLOADING"} for v in sorted(versions))
            elif name in catalog.unloaded:
                # One entry per version, as Triton lists an unloaded model (its name alone if none is known).
                entry = catalog.repository.models.get(name)
                if entry is not None and entry.versions:
                    items.extend({"name": name, "version": str(v), "state": "UNAVAILABLE", "reason": "unloaded"}
                                 for v in entry.versions)
                else:
                    items.append({"name": name, "state": "UNAVAILABLE", "reason": "unloaded"})
            else:
                items.append({"name": name})
            continue
        if not versions:
            loading = any(u.gen == target.gen for u in units)
            items.append({"name": name, "state": "LOADING" if loading else "UNAVAILABLE",
                          **({} if loading else {"reason": reason or "no ready worker serves it"})})
            continue
        for v in sorted(versions):
            states = {u.state for u in units if u.version == v}
            if (name, v) in catalog.ready:
                item: dict[str, Any] = {"name": name, "version": str(v), "state": "READY"}
            elif "LOADING" in states or "UNLOADING" in states:
                item = {"name": name, "version": str(v), "state": "LOADING" if "LOADING" in states else "UNLOADING"}
            else:
                item = {"name": name, "version": str(v), "state": "UNAVAILABLE",
                        "reason": reason or "no ready worker serves it"}
            items.append(item)
    if only_ready:
        items = [i for i in items if i.get("state") == "READY"]
    return items
