"""The generation engine (workers/generation/) on the tiny random Llama, in process: its paged forward
against transformers' own greedy generate, exactness under continuous batching with staggered arrivals,
chunked prefill and preemption, cancellation that frees the slot within an iteration, EOS and stop
strings, seeded sampling that does not depend on batch-mates."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from batching.continuous import ContinuousConfig
from tests.support.tiny_llm import build_tiny_llm
from workers.backends.llm import load_llm
from workers.generation.engine import Engine, Generation
from workers.generation.metrics import GenerationMetrics
from workers.generation.paged_llama import PagedLlama, Segment
from workers.generation.sampling import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "In 1969 the first", "A B C D E F G H I J K L M N O P"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model_dir = build_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny")
    model, tokenizer = load_llm(model_dir, 1)
    return model, tokenizer


def reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generation of the prompt alone, never stopped by EOS (min_new_tokens would not
    do: it suppresses EOS, changing the argmax where EOS is the top token)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


class Harness:
    def __init__(self, model: Any, tokenizer: Any, config: ContinuousConfig, eos: set[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.paged = PagedLlama(model, config.kv_blocks, config.block_tokens)
        self.metrics = GenerationMetrics("tiny", 1, "w", None)
        self.engine = Engine(self.paged, tokenizer, config, set() if eos is None else eos, self.metrics)
        self._n = 0

    def submit(self, prompt: str | list[int], params: SamplingParams, on_text: Any = None) -> tuple[Generation,
                                                                                                    threading.Event]:
        done = threading.Event()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        self._n += 1
        gen = Generation(key=f"r{self._n}", prompt=ids, params=params, on_done=lambda _: done.set(), on_text=on_text)
        self.engine.submit(gen)
        return gen, done

    def run(self, prompt: str | list[int], params: SamplingParams) -> Generation:
        gen, done = self.submit(prompt, params)
        assert done.wait(60)
        return gen


@pytest.fixture
def harness(tiny: tuple[Any, Any]) -> Iterator[Any]:
    made: list[Harness] = []

    def make(config: ContinuousConfig, eos: set[int] | None = None) -> Harness:
        h = Harness(*tiny, config, eos)
        made.append(h)
        return h

    yield make
    for h in made:
        h.engine.close()


@pytest.mark.parametrize("chunks", [[100], [1, 1, 2, 100], [3, 100]])
def test_paged_forward_matches_transformers_generate(tiny: tuple[Any, Any], chunks: list[int]) -> None:
    model, tok = tiny
    prompt = tok.encode(PROMPTS[0])
    paged = PagedLlama(model, 16, 4)
    paged.kv.ensure("a", len(prompt) + 12)
    start = 0
    logits: dict[str, torch.Tensor] = {}
    for size in chunks:  # chunked prefill: the context arrives in pieces, as the scheduler hands them out
        end = min(len(prompt), start + size)
        logits = paged.forward([Segment("a", prompt[start:end], start, end == len(prompt))])
        start = end
        if start == len(prompt):
            break
    tokens = list(prompt)
    out = [int(torch.argmax(logits["a"]))]
    while len(out) < 12:
        tokens.append(out[-1])
        out.append(int(torch.argmax(paged.forward([Segment("a", [tokens[-1]], len(tokens) - 1, True)])["a"])))
    assert out == reference(model, prompt, 12)


def test_staggered_arrivals_give_each_request_its_tokens_alone(harness: Any, tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    h = harness(ContinuousConfig(kv_blocks=64, block_tokens=8, max_running=3, prefill_chunk=6))
    lengths = [20, 7, 15, 3, 11, 9]
    started = []
    for prompt, n in zip(PROMPTS, lengths, strict=True):  # each arrives while others are mid-generation
        started.append(h.submit(prompt, SamplingParams(max_tokens=n)))
        time.sleep(0.01)
    for _, done in started:
        assert done.wait(60)
    for (gen, _), n in zip(started, lengths, strict=True):
        assert gen.finish == "length" and len(gen.generated) == n
        assert gen.generated == reference(model, gen.prompt, n), gen.key
    counts = h.metrics.snapshot()
    # Batched: fewer iterations than tokens produced (several sequences per forward pass).
    assert counts["1:llm:iterations"] < counts["1:llm:generation_tokens"]


def test_preemption_when_the_kv_budget_runs_out_keeps_tokens_exact(harness: Any, tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    # 8 blocks of 4 tokens: three sequences of ~6 prompt + 14 new tokens cannot all stay resident.
    h = harness(ContinuousConfig(kv_blocks=8, block_tokens=4, max_running=3, prefill_chunk=32))
    started = [h.submit(p, SamplingParams(max_tokens=14)) for p in PROMPTS[:3]]
    for _, done in started:
        assert done.wait(60)
    assert h.metrics.snapshot().get("1:llm:preemptions", 0) > 0
    for gen, _ in started:
        assert gen.generated == reference(model, gen.prompt, 14)
    assert h.paged.kv.used_blocks == 0


def test_cancel_frees_the_slot_within_an_iteration(harness: Any) -> None:
    h = harness(ContinuousConfig(kv_blocks=64, block_tokens=8, max_running=1, prefill_chunk=64))
    first_token = threading.Event()
    long, long_done = h.submit(PROMPTS[0], SamplingParams(max_tokens=400, stream=True),
                               on_text=lambda *_: first_token.set())
    waiting, waiting_done = h.submit(PROMPTS[1], SamplingParams(max_tokens=3))
    assert first_token.wait(30)
    assert not waiting_done.is_set()  # one slot: it waits behind the long one
    h.engine.cancel([long.key])
    assert long_done.wait(10) and long.finish == "cancelled" and len(long.generated) < 400
    assert waiting_done.wait(30) and waiting.finish == "length"
    assert h.paged.kv.used_blocks == 0


def test_eos_and_stop_strings_end_a_generation(harness: Any, tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    prompt = tok.encode(PROMPTS[2])
    free = reference(model, prompt, 12)
    h = harness(ContinuousConfig(kv_blocks=64, block_tokens=8, max_running=2, prefill_chunk=64), eos={free[4]})
    gen = h.run(prompt, SamplingParams(max_tokens=12))
    first = free.index(free[4])
    assert gen.finish == "stop" and gen.generated == free[:first + 1]
    ignored = h.run(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert ignored.finish == "length" and ignored.generated == free

    text = tok.decode(free, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = h.run(prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))
    assert cut.finish == "stop" and cut.text is not None and cut.text.text == text[:text.index(stop)]


def test_seeded_sampling_does_not_depend_on_batch_mates(harness: Any) -> None:
    h = harness(ContinuousConfig(kv_blocks=64, block_tokens=8, max_running=4, prefill_chunk=64))
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = h.run(PROMPTS[0], params).generated
    together = [h.submit(p, params if i == 0 else SamplingParams(max_tokens=12, temperature=1.0, seed=i))
                for i, p in enumerate(PROMPTS[:4])]
    for _, done in together:
        assert done.wait(60)
    assert together[0][0].generated == alone
    other_seed = h.run(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert other_seed.generated != alone


def test_a_prompt_past_the_kv_budget_is_refused(harness: Any) -> None:
    h = harness(ContinuousConfig(kv_blocks=4, block_tokens=4, max_running=2, prefill_chunk=64))
    gen = h.run(list(range(10, 30)), SamplingParams(max_tokens=4))
    assert gen.error is not None and "KV" in gen.error.message
