"""The generative backend (`backend: "llm"`): a Llama-family model served by fleet's continuous-batching
engine (workers/generation/engine.py).

How it meets the worker: a version gets `max_sequences` instances ("slots", fleet/llm_spec.py), all
sharing one engine. The worker's scheduler hands each slot one request at a time, as for any model
(lanes, deadlines, cancellation of queued requests and custody of the message apply unchanged); a
slot's execute() submits its request to the engine and waits for it to end, so the engine always holds
up to `max_sequences` requests, runs up to `max_running` of them per iteration, and a finished one's
slot takes the next request at once.

Requests (Triton's vLLM backend's interface, plus the guide's):
- `text_input` (BYTES [1]), or `INPUT_IDS` (INT32 [1, -1]) with optional `ATTENTION_MASK` (the positions
  whose mask is 0 are not part of the prompt); a `chat_messages` parameter (JSON, OpenAI's messages) is
  rendered with the model's chat template instead;
- sampling from request parameters, the `sampling_parameters` JSON input and the `stream`,
  `exclude_input_in_output` and `max_tokens` inputs (workers/generation/sampling.py).
Responses: `text_output` (BYTES) and `OUTPUT_IDS` (INT64 [1, n]); with `stream`, one response per piece
of text as it is generated (the model is decoupled), the final one with what remains; without, one
response with the whole generation (the prompt first unless exclude_input_in_output). Each final response
carries `finish_reason`, `prompt_tokens` and `completion_tokens` parameters.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from fleet import tensors
from fleet.errors import ConfigError, InvalidInput, ServingError
from fleet.llm_spec import LlmSettings, llm_settings
from fleet.model_spec import ModelSpec
from workers.backends.base import InferenceItem, InProcessBackend, ItemResult, LoadContext
from workers.generation.engine import Engine, Generation
from workers.generation.metrics import GenerationMetrics
from workers.generation.outbox import Outbox
from workers.generation.paged_llama import PagedLlama
from workers.generation.sampling import parse_sampling, sampling_json

log = logging.getLogger(__name__)

_SAMPLING_INPUTS = ("stream", "exclude_input_in_output", "max_tokens", "temperature", "top_p", "top_k", "seed")


def load_llm(model_dir: Path, version: int, settings: LlmSettings | None = None) -> tuple[Any, Any]:
    """(LlamaForCausalLM in float32, tokenizer) from the version directory's checkpoint, else the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = model_dir / str(version)
    if (local / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(local)
    if settings is None or not settings.gguf_package:
        raise ConfigError(f"{local} holds no checkpoint (config.json) and the config names no gguf_package")
    spec = importlib.util.find_spec(settings.gguf_package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {settings.gguf_package!r} (the model's GGUF file) is not installed")
    where = Path(next(iter(spec.submodule_search_locations)))
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=settings.gguf_file, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(where, gguf_file=settings.gguf_file)


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


class SharedEngine:
    """The engine of one load of a version, shared by its slots (LoadContext.siblings); closed with the last."""

    def __init__(self, ctx: LoadContext) -> None:
        settings = llm_settings(ctx.spec)
        model, tokenizer = load_llm(ctx.model_dir, ctx.version, settings)
        cfg = settings.continuous
        paged = PagedLlama(model, cfg.kv_blocks, cfg.block_tokens)
        log.info("%s v%d: generation engine with %d KV blocks of %d tokens (%.1f MiB), %d running at most",
                 ctx.spec.name, ctx.version, cfg.kv_blocks, cfg.block_tokens, paged.kv.bytes / 2**20, cfg.max_running)
        writes = ctx.writes
        metrics = GenerationMetrics(ctx.spec.name, ctx.version, ctx.worker_id,
                                    None if writes is None else writes.record_stats)
        outbox = None if writes is None else Outbox(writes, ctx.spec.name)
        self.engine = Engine(paged, tokenizer, cfg, eos_ids(model, tokenizer), metrics, name=ctx.spec.name,
                             outbox=outbox)
        self._users = 0
        self._lock = threading.Lock()

    @classmethod
    def acquire(cls, ctx: LoadContext) -> SharedEngine:
        shared = ctx.siblings.get("engine")
        if not isinstance(shared, SharedEngine):  # the load's first slot (slots load one after another)
            shared = ctx.siblings["engine"] = cls(ctx)
        with shared._lock:
            shared._users += 1
        return shared

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
        engine = self.engine
        engine.close()
        engine.metrics.flush(force=True)
        if engine.outbox is not None:
            engine.outbox.close()


class LlmSlot(InProcessBackend):
    def __init__(self, ctx: LoadContext) -> None:
        self.spec: ModelSpec = ctx.spec
        self._shared = SharedEngine.acquire(ctx)
        self.engine = self._shared.engine
        self._outbox = self.engine.outbox
        self._tok = self.engine.tokenizer
        self._outputs = {t.name for t in self.spec.outputs}

    @property
    def progress_at(self) -> float:
        """The watchdog's view: a slot waiting on a busy engine is not hung while the engine iterates."""
        return self.engine.last_iteration

    def execute(self, items: list[InferenceItem]) -> list[ItemResult]:
        done = threading.Semaphore(0)
        gens: list[Generation | ServingError] = []
        for item in items:
            try:
                gen = self._generation(item, done)
                self.engine.submit(gen)
                gens.append(gen)
            except ServingError as exc:
                gens.append(exc)
        for g in gens:
            if isinstance(g, Generation):
                done.acquire()
        return [ItemResult(error=g) if isinstance(g, ServingError) else self._result(g, item)
                for g, item in zip(gens, items, strict=True)]

    def cancel_requests(self, keys: list[str]) -> None:
        """Their callers went away (workers/main.py): each leaves the running batch at the next iteration (the
        engine ignores keys that are not its own)."""
        self.engine.cancel(keys)

    def close(self) -> None:
        self._shared.release()

    # ------------------------------------------------------------------ requests and responses

    def _generation(self, item: InferenceItem, done: threading.Semaphore) -> Generation:
        inputs = item.inputs
        sources: list[dict[str, Any]] = [dict(item.parameters)]
        if "sampling_parameters" in inputs:
            sources.append(sampling_json(_text(inputs["sampling_parameters"])))
        own = {k: _scalar(inputs[k]) for k in _SAMPLING_INPUTS if k in inputs}
        sources.append(own)
        params = parse_sampling(sources)
        prompt = self._prompt(item)
        if not prompt:
            raise InvalidInput("the prompt is empty")
        outbox = self._outbox
        if not params.stream or outbox is None:
            return Generation(key=item.key, prompt=prompt, params=params, lane=item.lane,
                              on_done=lambda _: done.release())

        def on_text(gen: Generation, text: str, ids: list[int]) -> None:
            outbox.send(item, {"o": self._wire(text, ids), "p": {}})

        # The slot answers (the final reply) only once the streamed responses before it are written.
        return Generation(key=item.key, prompt=prompt, params=params, on_text=on_text, lane=item.lane,
                          on_done=lambda _: outbox.after(done.release))

    def _prompt(self, item: InferenceItem) -> list[int]:
        inputs = item.inputs
        chat = item.parameters.get("chat_messages")
        if isinstance(chat, str):
            try:
                messages = json.loads(chat)
            except ValueError:
                raise InvalidInput("chat_messages must be JSON") from None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise InvalidInput("chat_messages must be a list of messages")
            if getattr(self._tok, "chat_template", None) is None:
                raise InvalidInput(f"model '{self.spec.name}' has no chat template")
            try:
                text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # the template's own checks (roles, order)
                raise InvalidInput(f"the messages do not fit the model's chat template: {exc}") from None
            return list(self._tok.encode(text, add_special_tokens=False))
        if "INPUT_IDS" in inputs:
            ids = inputs["INPUT_IDS"].reshape(-1).astype(np.int64)
            if "ATTENTION_MASK" in inputs:
                mask = inputs["ATTENTION_MASK"].reshape(-1)
                if mask.size != ids.size:
                    raise InvalidInput("ATTENTION_MASK must have INPUT_IDS's shape")
                ids = ids[mask != 0]
            vocab = int(self.engine.model.config.vocab_size)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise InvalidInput(f"INPUT_IDS must be token ids in [0, {vocab})")
            return [int(i) for i in ids]
        if "text_input" in inputs:
            return list(self._tok.encode(_text(inputs["text_input"])))
        raise InvalidInput(f"model '{self.spec.name}' needs text_input or INPUT_IDS")

    def _wire(self, text: str, ids: list[int]) -> list[tuple[str, str, list[int], bytes]]:
        out = []
        if "text_output" in self._outputs:
            out.append(("text_output", "BYTES", [1],
                        tensors.to_bytes(np.array([text.encode()], dtype=object), tensors.lookup("BYTES"))))
        if "OUTPUT_IDS" in self._outputs:
            out.append(("OUTPUT_IDS", "INT64", [1, len(ids)],
                        np.asarray(ids, dtype=np.int64).reshape(1, -1).tobytes()))
        return out

    def _result(self, gen: Generation, item: InferenceItem) -> ItemResult:
        if gen.error is not None:
            return ItemResult(error=gen.error)
        assert gen.text is not None or gen.finish == "cancelled"
        params = {"finish_reason": gen.finish or "", "prompt_tokens": len(gen.prompt),
                  "completion_tokens": len(gen.generated)}
        if gen.params.stream:
            rest = gen.text.flush() if gen.text is not None else ""
            text, ids = rest, gen.unsent
        else:
            text = gen.text.text if gen.text is not None else ""
            ids = list(gen.generated)
            if not gen.params.exclude_input_in_output:
                prompt_text = _text(item.inputs["text_input"]) if "text_input" in item.inputs else \
                    self._tok.decode(gen.prompt, skip_special_tokens=True)
                text, ids = prompt_text + text, gen.prompt + ids
        outputs: dict[str, np.ndarray] = {}
        if "text_output" in self._outputs:
            outputs["text_output"] = np.array([text.encode()], dtype=object)
        if "OUTPUT_IDS" in self._outputs:
            outputs["OUTPUT_IDS"] = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        return ItemResult(outputs=outputs, parameters=params)


def _text(array: np.ndarray) -> str:
    flat = array.reshape(-1)
    if flat.size != 1:
        raise InvalidInput("a text input holds exactly one string")
    value = flat[0]
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise InvalidInput("text input is not UTF-8") from None


def _scalar(array: np.ndarray) -> Any:
    flat = array.reshape(-1)
    if flat.size != 1:
        raise InvalidInput("sampling inputs hold one value each")
    value = flat[0]
    return value.decode() if isinstance(value, bytes) else value.item()
