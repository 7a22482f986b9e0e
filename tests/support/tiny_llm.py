"""A tiny deterministic generative model for tests: a 2-layer random Llama (seed 0) with SmolLM2's
tokenizer (from model_repository/smollm2/1, written by `make models`), served by the llm backend with
smollm2's interface and a small KV budget."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "model_repository" / "smollm2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_config(name: str, *, kv_tokens: int = 1024, block: int = 16, max_running: int = 4,
                prefill_chunk: int = 64, max_sequences: int = 8) -> str:
    """smollm2's config.pbtxt with this model's name and limits (no GGUF: the checkpoint is in 1/)."""
    lines = [line for line in (SMOLLM2 / "config.pbtxt").read_text().splitlines()
             if not line.startswith(("#", "name:", "parameters"))]
    params = {"max_kv_cache_length": kv_tokens, "kv_block_tokens": block, "max_running": max_running,
              "prefill_chunk": prefill_chunk, "max_sequences": max_sequences}
    return "\n".join([f'name: "{name}"', *lines, *(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())]) + "\n"


def build_tiny_llm(model_dir: Path, **limits: int) -> Path:
    """Writes the model (config.pbtxt and version 1) into `model_dir`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    version = model_dir / "1"
    version.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wider logits than the default init: fewer near-ties between the top tokens
        model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(version)
    for name in TOKENIZER_FILES:
        if (SMOLLM2 / "1" / name).exists():
            shutil.copy(SMOLLM2 / "1" / name, version / name)
    (model_dir / "config.pbtxt").write_text(tiny_config(model_dir.name, **limits))
    return model_dir
