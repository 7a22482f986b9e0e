"""The real small LLM of model_repository (SmolLM2-135M-Instruct) in the system `make up` starts: it answers
sensibly, and under continuous batching each request's greedy tokens are the tokens it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from tests.e2e.conftest import RunningSystem

PROMPTS = ["The capital of France is", "Water boils at", "def fibonacci(n):", "Once upon a time"]


def generate(system: RunningSystem, prompt: str, tokens: int = 8) -> dict[str, Any]:
    r = httpx.post(f"http://{system.url}/v2/models/smollm2/generate", timeout=120,
                   json={"text_input": prompt, "max_tokens": tokens, "ignore_eos": True,
                         "exclude_input_in_output": True})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_smollm2_batched_tokens_equal_alone(system: RunningSystem) -> None:
    alone = [generate(system, p)["OUTPUT_IDS"] for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: generate(system, p)["OUTPUT_IDS"], PROMPTS))
    assert together == alone
    assert generate(system, PROMPTS[0])["text_output"].strip().startswith("Paris")


def test_smollm2_chat_through_the_openai_client(system: RunningSystem) -> None:
    with openai.OpenAI(base_url=f"http://{system.url}/v1", api_key="unused", max_retries=0) as client:
        answer = client.chat.completions.create(model="smollm2", max_tokens=24,
                                                messages=[{"role": "user", "content": "What is 2+2?"}])
    assert "4" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"  # it ended with its end-of-turn token
