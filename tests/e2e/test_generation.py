"""Generative models through real processes (Redis, a gateway, a worker, a jobs worker) and the clients LLM
users have: Triton's generate extension (one JSON, and server-sent events read by httpx-sse), the official
`openai` package (completions and chat, with and without streaming), Triton's own clients with the guide's
INPUT_IDS interface (HTTP and gRPC), cancellation by a client that goes away, a bulk job of prompts, and
the generation metrics. The model is the tiny random Llama (tests/support/tiny_llm.py): fast and
deterministic; its text is gibberish, so the checks compare routes with each other and with the engine's
greedy tokens."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from httpx_sse import connect_sse

from tests.support.processes import Cluster
from tests.support.tiny_llm import build_tiny_llm

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("generation")
    repo = tmp / "models"
    build_tiny_llm(repo / "tiny", max_running=2, max_sequences=4)
    c = Cluster(tmp, repo, {"FLEET_KEY_PREFIX": "generation"})
    c.start_redis()
    try:
        c.start_gateway()
        c.start_worker()
        c.start_jobs_worker()
        c.wait_ready(120)
        yield c
    finally:
        c.stop()


def generate(c: Cluster, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{c.base_url}/v2/models/tiny/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def stats(c: Cluster) -> dict[str, Any]:
    return httpx.get(f"{c.base_url}/v2/models/tiny/stats").json()["model_stats"][0]["generation"]  # type: ignore[no-any-return]


def test_generate_and_generate_stream_agree(cluster: Cluster) -> None:
    whole = generate(cluster, {"text_input": PROMPT, "max_tokens": 12})
    assert whole["text_output"].startswith(PROMPT) and whole["finish_reason"] == "length"
    assert (whole["prompt_tokens"], whole["completion_tokens"]) == (5, 12)
    body = {"text_input": PROMPT, "max_tokens": 12, "stream": True, "exclude_input_in_output": True}
    with httpx.Client(timeout=60) as client, \
            connect_sse(client, "POST", f"{cluster.base_url}/v2/models/tiny/generate_stream", json=body) as source:
        events = [json.loads(e.data) for e in source.iter_sse()]
    assert len(events) > 2 and all(e["model_name"] == "tiny" for e in events)
    assert "".join(e["text_output"] for e in events) == whole["text_output"][len(PROMPT):]
    assert events[-1]["finish_reason"] == "length" and "finish_reason" not in events[0]
    # Bad sampling is the request's 400, before any event.
    r = httpx.post(f"{cluster.base_url}/v2/models/tiny/generate_stream",
                   json={"text_input": PROMPT, "temperature": -2}, timeout=30)
    assert r.status_code == 400 and "temperature" in r.json()["error"], r.text


def test_openai_client_completions_and_chat(cluster: Cluster) -> None:
    # Closed at the end: its connection pool would otherwise leave a socket for a later test's collection.
    with openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == ["tiny"]
        ref = generate(cluster, {"text_input": PROMPT, "max_tokens": 10, "exclude_input_in_output": True})
        done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10)
        assert done.choices[0].text == ref["text_output"] and done.choices[0].finish_reason == "length"
        assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 10)
        streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == ref["text_output"]
        ids = client.completions.create(model="tiny", prompt=[504, 3575, 282, 4649, 314], max_tokens=10)
        assert ids.choices[0].text == ref["text_output"]  # the same prompt as token ids

        messages = [{"role": "user", "content": "Hello there"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)  # type: ignore[arg-type]
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 10
        parts: list[str] = []
        usage = None
        for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert "".join(parts) == chat.choices[0].message.content
        assert usage is not None and usage.total_tokens == chat.usage.total_tokens

        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")
        with pytest.raises(openai.BadRequestError, match="only n = 1"):
            client.completions.create(model="tiny", prompt="x", n=2)


def test_guide_interface_input_ids_over_http_and_grpc(cluster: Cluster) -> None:
    ref = generate(cluster, {"text_input": PROMPT, "max_tokens": 6})
    ids = np.array([ref["OUTPUT_IDS"][:5]], dtype=np.int32)
    for module, url in ((httpclient, f"127.0.0.1:{cluster.http_port}"), (grpcclient, f"127.0.0.1:{cluster.grpc_port}")):
        client: Any = module.InferenceServerClient(url)
        tensors = []
        for name, value in (("INPUT_IDS", ids), ("ATTENTION_MASK", np.ones_like(ids)),
                            ("max_tokens", np.array([6], dtype=np.int32))):
            t = module.InferInput(name, list(value.shape), "INT32")
            t.set_data_from_numpy(value)
            tensors.append(t)
        result = client.infer("tiny", tensors, outputs=[module.InferRequestedOutput("OUTPUT_IDS")])
        assert result.as_numpy("OUTPUT_IDS").tolist() == [ref["OUTPUT_IDS"]], module.__name__


def test_grpc_stream_of_a_generation(cluster: Cluster) -> None:
    ref = generate(cluster, {"text_input": PROMPT, "max_tokens": 8, "exclude_input_in_output": True})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        inputs = []
        for name, value, dtype in (("text_input", np.array([PROMPT.encode()], dtype=object), "BYTES"),
                                   ("stream", np.array([True]), "BOOL"),
                                   ("max_tokens", np.array([8], dtype=np.int32), "INT32")):
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(value)
            inputs.append(t)
        client.async_stream_infer("tiny", inputs, request_id="g1", enable_empty_final_response=True)
        pieces: list[str] = []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            text = result.as_numpy("text_output")
            if text is not None:
                pieces.extend(v.decode() for v in text.reshape(-1))
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    assert len(pieces) > 2 and "".join(pieces) == ref["text_output"]


def test_client_going_away_frees_the_slot(cluster: Cluster) -> None:
    generate(cluster, {"text_input": PROMPT, "max_tokens": 1})
    before = stats(cluster)
    body = {"text_input": PROMPT, "max_tokens": 1000, "stream": True, "exclude_input_in_output": True}
    with httpx.Client(timeout=60) as client, \
            connect_sse(client, "POST", f"{cluster.base_url}/v2/models/tiny/generate_stream", json=body) as source:
        events = source.iter_sse()
        for _ in range(3):
            next(events)
    deadline = time.monotonic() + 15
    while True:  # the engine ended it (cancelled) and holds nothing
        now = stats(cluster)
        if now["finished"]["cancelled"] > before["finished"]["cancelled"] and now["running"] == 0 \
                and now["kv_used"] == 0:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    assert now["generation_tokens"] - before["generation_tokens"] < 1000
    generate(cluster, {"text_input": PROMPT, "max_tokens": 2})  # the slot serves the next request


def test_bulk_job_of_prompts(cluster: Cluster, tmp_path: Path) -> None:
    prompts = [PROMPT, "Once upon a time", "Water boils at"]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 5, "exclude_input_in_output": True}) + "\n"
                           for p in prompts))
    out = tmp_path / "completions.jsonl"
    run = subprocess.run([sys.executable, "-m", "fleet", "submit", "--url", cluster.base_url, "--model", "tiny",
                          str(src), "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr + cluster.logs()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["line"] for line in lines] == [1, 2, 3]
    for line, prompt in zip(lines, prompts, strict=True):
        text = next(o["data"][0] for o in line["outputs"] if o["name"] == "text_output")
        assert text == generate(cluster, {"text_input": prompt, "max_tokens": 5,
                                          "exclude_input_in_output": True})["text_output"]


def test_generation_metrics(cluster: Cluster) -> None:
    generate(cluster, {"text_input": PROMPT, "max_tokens": 4})
    deadline = time.monotonic() + 10
    while stats(cluster)["running"] != 0 or stats(cluster)["ttft"]["count"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    g = stats(cluster)
    assert g["ttft"]["count"] >= 1 and g["itl"]["count"] >= 3 and g["kv_total"] == 1024 // 16
    assert g["ttft"]["buckets"][-1] == {"le": "+Inf", "count": g["ttft"]["count"]}
    text = httpx.get(f"{cluster.base_url}/metrics").text
    assert f'vllm:time_to_first_token_seconds_count{{model="tiny",version="1"}} {float(g["ttft"]["count"])}' in text
    assert 'vllm:time_per_output_token_seconds_bucket{le="+Inf",model="tiny",version="1"}' in text
    assert 'vllm:num_requests_running{model="tiny",version="1"} 0.0' in text
    assert 'vllm:generation_tokens_total{model="tiny",version="1"}' in text
    # Over gRPC, the same statistics as Triton's message holds them: the generation's own (HTTP's
    # "generation") are not fields of it, and must not fail the call (perf_analyzer -i grpc asks for them).
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.grpc_port}")
    try:
        (one,) = client.get_inference_statistics("tiny").model_stats
        every = client.get_inference_statistics().model_stats
    finally:
        client.close()
    assert one.name == "tiny" and one.inference_count >= 1 and "tiny" in [m.name for m in every]
