"""constraints.txt (the versions the suite last passed with) agrees with pyproject.toml's ranges, leaves
torch to the Makefile and the Dockerfile, and is what both install with."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, Version]:
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            found[canonicalize_name(name)] = Version(version)
    return found


def test_every_pin_is_inside_pyproject_ranges() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    versions = pins()
    for requirement in declared:
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in versions, f"{name} is declared but has no pin"
        assert requirement.specifier.contains(versions[name], prereleases=True), (requirement, versions[name])


def test_torch_is_left_to_the_makefile_and_the_dockerfile() -> None:
    assert "torch" not in pins()  # its CPU or CUDA build is chosen per install, with its own index


def test_make_and_the_image_install_with_it() -> None:
    assert "-c constraints.txt -e '.[dev]'" in (ROOT / "Makefile").read_text()
    assert "-c constraints.txt ." in (ROOT / "Dockerfile").read_text()
