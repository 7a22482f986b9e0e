"""model_repository/mlp's config with another instance group, for the bench scripts that vary it
(bench/bulk.py --instances, bench/gpu_check.py --instances and --kind)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUP = "instance_group [ { count: 1, kind: KIND_CPU } ]"


def write_mlp_config(model_dir: Path, count: int = 1, kind: str = "KIND_CPU") -> None:
    """model_dir/config.pbtxt: mlp's config with `count` instances of `kind`."""
    config = (ROOT / "model_repository" / "mlp" / "config.pbtxt").read_text()
    if GROUP not in config:
        raise SystemExit(f"model_repository/mlp's instance group is no longer {GROUP!r}: update bench/mlp_config.py")
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(
        config.replace(GROUP, f"instance_group [ {{ count: {count}, kind: {kind} }} ]"))
