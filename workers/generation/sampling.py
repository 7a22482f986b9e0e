"""Per-request sampling: the parameters a generation request may carry, read from wherever Triton's and
OpenAI's clients put them, and the choice of the next token from one row of logits.

Greedy by default (temperature 0). With a `seed`, sampling is reproducible: each request draws from its
own generator, so the same request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fleet.errors import InvalidInput

DEFAULT_MAX_TOKENS = 16  # vLLM's and OpenAI's completions default


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stream: bool = False
    exclude_input_in_output: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # the rest, kept for the model's own use

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


_FLOATS = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "repetition_penalty": (0.01, 100.0)}
_INTS = {"max_tokens": (1, 1 << 20), "top_k": (-1, 1 << 20), "seed": (-(1 << 63), (1 << 63) - 1)}
_BOOLS = ("ignore_eos", "stream", "exclude_input_in_output")


def parse_sampling(sources: Sequence[Mapping[str, Any]]) -> SamplingParams:
    """Merged from `sources`, later ones winning (request parameters, then the `sampling_parameters` JSON
    input, then the model's own inputs such as `stream`). `max_new_tokens` (Hugging Face's name) is
    `max_tokens`. Raises InvalidInput naming the bad value."""
    merged: dict[str, Any] = {}
    for source in sources:
        merged.update(source)
    if "max_new_tokens" in merged and "max_tokens" not in merged:
        merged["max_tokens"] = merged.pop("max_new_tokens")
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in merged.items():
        if value is None:
            continue
        if key in _FLOATS:
            lo, hi = _FLOATS[key]
            values[key] = _number(key, value, float, lo, hi)
        elif key in _INTS:
            lo_i, hi_i = _INTS[key]
            values[key] = _number(key, value, int, lo_i, hi_i)
        elif key in _BOOLS:
            values[key] = _boolean(key, value)
        elif key == "stop":
            values["stop"] = _stops(value)
        else:
            extra[key] = value
    if values.get("top_p") == 0.0:
        raise InvalidInput("top_p must be in (0, 1]")
    if values.get("top_k", 0) < 0:
        values["top_k"] = 0
    return SamplingParams(**values, extra=extra)


def sampling_json(text: bytes | str) -> dict[str, Any]:
    """The `sampling_parameters` input (Triton's vLLM backend): a JSON object."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise InvalidInput("sampling_parameters must be a JSON object") from None
    if not isinstance(doc, dict):
        raise InvalidInput("sampling_parameters must be a JSON object")
    return doc


def _number(key: str, value: Any, kind: type[float] | type[int], lo: float, hi: float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInput(f"'{key}' must be a number, not {value!r:.40}")
    try:
        number = kind(value)
    except ValueError:
        raise InvalidInput(f"'{key}' must be a number, not {value!r:.40}") from None
    if kind is int and isinstance(value, float) and value != number:
        raise InvalidInput(f"'{key}' must be an integer, not {value!r}")
    if not lo <= number <= hi:
        raise InvalidInput(f"'{key}' must be in [{lo:g}, {hi:g}], not {value!r}")
    return number


def _boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidInput(f"'{key}' must be true or false, not {value!r:.40}")


def _stops(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise InvalidInput("'stop' must be a non-empty string or a list of at most 16 of them")
    return tuple(stops)


def generator_for(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed % (1 << 64))
    else:
        gen.seed()
    return gen


def next_token(logits: torch.Tensor, params: SamplingParams, history: list[int],
               generator: torch.Generator | None) -> int:
    """The next token from one row of float32 logits; `history`: prompt and generated ids (for the
    repetition penalty, applied as Hugging Face does: a seen token's logit divided by the penalty if
    positive, multiplied if negative)."""
    if params.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        scores = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(scores > 0, scores / params.repetition_penalty,
                                   scores * params.repetition_penalty)
    if params.greedy or generator is None:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, index = torch.sort(logits, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        # Keep the smallest head whose mass reaches top_p (the first token always stays).
        drop = cumulative - torch.softmax(ordered, dim=-1) >= params.top_p
        logits = logits.scatter(0, index[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
