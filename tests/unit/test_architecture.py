"""The import arrows of design.md/style.md, checked on module-level imports of every source file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "batching": {"redis", "asyncio", "fastapi", "starlette", "torch", "time", "random", "fleet.clock",
                 "gateway", "workers"},
    "fleet": {"fastapi", "starlette", "torch", "gateway", "workers"},
    "gateway": {"torch", "workers", "onnxruntime"},
    "workers": {"gateway", "fastapi", "starlette"},
}


def module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:  # top level only: lazy imports inside functions are the sanctioned escape hatch
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_arrows(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in module_level_imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_redis_keys_are_built_only_in_keys_module() -> None:
    offenders = []
    for package in ("fleet", "gateway", "workers"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "keys.py":
                continue
            text = path.read_text()
            if '"fleet:' in text or "f\"{self.prefix}:" in text:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_nothing_is_unpickled() -> None:
    for package in ("fleet", "gateway", "workers", "batching"):
        for path in (ROOT / package).rglob("*.py"):
            assert not {"pickle", "dill", "cloudpickle"} & module_level_imports(path), path
