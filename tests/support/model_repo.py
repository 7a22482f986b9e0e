"""Helpers to build throw-away model repositories in tests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

# Triton's example repository (shared with the project, not copied into it).
TRITON_EXAMPLES = (
    Path(__file__).resolve().parents[2] / "../shared/triton-examples/model_repository"
).resolve()


def python_config(name: str = "", *, max_batch_size: int = 8, extra: str = "") -> str:
    """A minimal valid Python-backend config with one FP32 [4] input and output."""
    name_line = f'name: "{name}"\n' if name else ""
    return (
        f'{name_line}backend: "python"\nmax_batch_size: {max_batch_size}\n'
        'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
        f"{extra}"
    )


def write_model(
    repo: Path,
    name: str,
    config: str | None,
    versions: Iterable[int | str] = (1,),
    model_file: str = "model.py",
) -> Path:
    """Create `repo/name/` with `config.pbtxt` (none if `config` is None) and one directory per
    version, each holding an empty `model_file`. Returns the model directory."""
    model_dir = repo / name
    model_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config, encoding="utf-8")
    for version in versions:
        version_dir = model_dir / str(version)
        version_dir.mkdir(exist_ok=True)
        (version_dir / model_file).write_text("", encoding="utf-8")
    return model_dir
