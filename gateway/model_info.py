"""What the health, metadata and repository endpoints answer, protocol-neutral: the HTTP routes
(gateway/routes.py) render it as JSON, the gRPC service (gateway/grpc/service.py) as Triton's messages,
so both protocols always say the same thing."""

from __future__ import annotations

from typing import Any

from fleet.errors import VersionNotFound
from gateway.broker import Broker
from gateway.catalog import Catalog, ModelView

# What RepositoryModelLoad/Unload answer (HTTP 501, gRPC UNIMPLEMENTED) until model control lands.
MODEL_CONTROL_OFF = "explicit model control (load/unload) is not enabled on this server yet"


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
    """Triton's repository index: each version of each model with its state (and why it is not ready,
    when a worker said), then the models that could not be read at all."""
    items: list[dict[str, Any]] = []
    for name in sorted(catalog.views):
        for v in catalog.view(name).entry.versions:
            is_ready = (name, v) in catalog.ready
            if only_ready and not is_ready:
                continue
            item: dict[str, Any] = {"name": name, "version": str(v), "state": "READY" if is_ready else "UNAVAILABLE"}
            reason = catalog.failures.get(name)
            if not is_ready and reason:
                item["reason"] = reason
            items.append(item)
    if not only_ready:
        items.extend({"name": n, "state": "UNAVAILABLE", "reason": why}
                     for n, why in sorted(catalog.repository.errors.items()))
    return items
