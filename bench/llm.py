"""Generation under continuous batching against one request at a time and static batching (issue 14's bar).

    .venv/bin/python bench/llm.py [--url 127.0.0.1:8000] [--model smollm2] [--streams 1 4 8 16]
                                  [--tokens 32] [--rounds 4] [--think-s 0.3] [--out bench/out/llm.json]

Needs a running fleet serving model_repository/smollm2 (`make up`, or `fleet up --http-port P`); the two
baselines run in this process on the same checkpoint (model_repository/smollm2/1) while fleet is idle.

Workload, the same for every system: S client streams; each waits an exponential think time (mean
--think-s: staggered, Poisson-like arrivals), sends one greedy generation of a fixed number of tokens
(ignore_eos) for its next prompt, waits for the end, and repeats --rounds times.
- fleet: POST /v2/models/M/generate_stream (SSE, a response per token), timed at the client: TTFT from the
  request to the first token's event, ITL between tokens' events.
- sequential: transformers' greedy `generate` of each request alone, back to back (tokens/s only).
- static: requests are batched S at a time as they arrive (the batch waits until it is full), each batch one
  transformers `generate` with left padding; a request's first token is the batch's first step.
Every fleet generation is compared with the same prompt generated alone (sequential); a mismatch is listed
with the logit margin (top-1 minus top-2, alone) where the two first differ. Prints a table; writes JSON.
Only the given address is contacted; every loop is bounded (S * rounds requests per level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "Water boils at", "In 1969, the first humans", "My favourite food is", "The weather today is",
    "Python is a programming language that", "The best way to learn a language is", "Photosynthesis is",
    "The three primary colours are", "A haiku about the sea:", "To make a cup of tea, first",
    "The largest planet in the solar system is", "Machine learning models are trained by",
    "The history of the Roman Empire began",
]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def summary(name: str, streams: int, tokens: int, seconds: float, ttft: list[float], itl: list[float]
            ) -> dict[str, Any]:
    return {"system": name, "streams": streams, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1),
            "ttft_p99_ms": round(pct(ttft, 99) * 1000, 1), "itl_p50_ms": round(pct(itl, 50) * 1000, 1),
            "itl_p99_ms": round(pct(itl, 99) * 1000, 1)}


Plan = list[list[tuple[float, int, int]]]


def schedule(streams: int, rounds: int, think_s: float, tokens: int, vary: bool, seed: int) -> Plan:
    """Per stream, per round: (think time before the request, prompt index, tokens to generate), the same for
    every system. With `vary`, lengths are uniform in [tokens/4, 7*tokens/4] (mean `tokens`), as real
    completions vary; else all `tokens` (static batching's best case)."""
    rng = random.Random(seed)
    lo, hi = max(1, tokens // 4), tokens * 7 // 4
    return [[(rng.expovariate(1 / think_s) if think_s > 0 else 0.0, (s * rounds + r) % len(PROMPTS),
              rng.randint(lo, hi) if vary else tokens)
             for r in range(rounds)] for s in range(streams)]


# ---------------------------------------------------------------------------------------------- fleet

async def fleet_level(url: str, model: str, plan: Plan) -> tuple[dict[str, Any], list[tuple[int, list[int]]]]:
    ttft: list[float] = []
    itl: list[float] = []
    outputs: list[tuple[int, list[int]]] = []
    body = {"ignore_eos": True, "stream": True, "exclude_input_in_output": True}

    async def stream(client: httpx.AsyncClient, rounds: list[tuple[float, int, int]]) -> None:
        for think, prompt, tokens in rounds:
            await asyncio.sleep(think)
            sent = time.perf_counter()
            last = None
            ids: list[int] = []
            async with client.stream("POST", f"http://{url}/v2/models/{model}/generate_stream",
                                     json={"text_input": PROMPTS[prompt], "max_tokens": tokens, **body}) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    doc = json.loads(line[6:])
                    if "error" in doc:
                        raise RuntimeError(doc["error"])
                    got = doc.get("OUTPUT_IDS", [])
                    got = [got] if isinstance(got, int) else got
                    if not got:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        itl.extend([(now - last) / len(got)] * len(got))
                    last = now
                    ids.extend(got)
            outputs.append((prompt, ids))

    limits = httpx.Limits(max_connections=len(plan) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(stream(client, rounds) for rounds in plan))
        seconds = time.perf_counter() - start
    return summary("fleet", len(plan), sum(len(ids) for _, ids in outputs), seconds, ttft, itl), outputs


# ---------------------------------------------------------------------------------------------- in-process

class Local:
    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = ROOT / "model_repository" / "smollm2" / "1"
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        # Never stopped by EOS (fleet's requests say ignore_eos); min_new_tokens would suppress EOS instead,
        # changing the argmax wherever EOS is the top token.
        self.model.generation_config.eos_token_id = None
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token

    def generate(self, prompts: list[str], tokens: int, on_step: Any = None) -> list[list[int]]:
        from transformers import LogitsProcessor, LogitsProcessorList

        class Step(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                if on_step is not None:
                    on_step()
                return scores

        batch = self.tok(prompts, return_tensors="pt", padding=True)
        with self.torch.no_grad():
            out = self.model.generate(**batch, max_new_tokens=tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id,
                                      logits_processor=LogitsProcessorList([Step()]))
        return [[int(t) for t in row] for row in out[:, batch["input_ids"].shape[1]:]]

    def margin(self, prompt: str, prefix: list[int]) -> float:
        """Top-1 minus top-2 logit of the token after `prefix`, the prompt run alone."""
        ids = self.tok(prompt, return_tensors="pt")["input_ids"]
        full = self.torch.cat([ids, self.torch.tensor([prefix], dtype=ids.dtype)], dim=1) if prefix else ids
        with self.torch.no_grad():
            logits = self.model(full).logits[0, -1]
        top = self.torch.topk(logits, 2).values
        return float(top[0] - top[1])


def sequential(local: Local, prompts: list[int], tokens: int) -> tuple[dict[str, Any], dict[int, list[int]]]:
    refs: dict[int, list[int]] = {}
    start = time.perf_counter()
    for p in prompts:
        refs[p] = local.generate([PROMPTS[p]], tokens)[0]
    seconds = time.perf_counter() - start
    return summary("sequential", 1, len(prompts) * tokens, seconds, [], []), refs


def static_level(local: Local, plan: Plan) -> dict[str, Any]:
    """Closed-loop streams as for fleet; a batch starts once every stream has a request waiting, and runs
    until its longest request is done (each request counts only its own tokens)."""
    size = len(plan)
    queue: list[tuple[float, int, threading.Event, int]] = []
    cv = threading.Condition()
    ttft: list[float] = []
    itl: list[float] = []
    made = 0

    def stream(rounds: list[tuple[float, int, int]]) -> None:
        for think, prompt, tokens in rounds:
            time.sleep(think)
            done = threading.Event()
            with cv:
                queue.append((time.perf_counter(), prompt, done, tokens))
                cv.notify()
            done.wait()

    threads = [threading.Thread(target=stream, args=(r,)) for r in plan]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for _ in range(len(plan[0])):
        with cv:
            cv.wait_for(lambda: len(queue) >= size)
            batch, queue[:] = queue[:size], queue[size:]
        steps: list[float] = []
        longest = max(n for *_, n in batch)
        local.generate([PROMPTS[p] for _, p, _, _ in batch], longest,
                       on_step=lambda steps=steps: steps.append(time.perf_counter()))
        steps.append(time.perf_counter())
        # The processor runs before each token is chosen: token i is ready at steps[i + 1].
        for arrived, _, done, tokens in batch:
            ttft.append(steps[1] - arrived)
            itl.extend(b - a for a, b in zip(steps[1:tokens], steps[2:tokens + 1], strict=True))
            made += tokens
            done.set()
    for t in threads:
        t.join()
    return summary("static", size, made, time.perf_counter() - start, ttft, itl)


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--think-s", type=float, default=0.3)
    ap.add_argument("--same-length", action="store_true", help="every request exactly --tokens (static's best case)")
    ap.add_argument("--sequential-prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--fleet-only", action="store_true", help="no baselines, no exactness check (profiling)")
    args = ap.parse_args()

    if args.fleet_only:
        for streams in args.streams:
            plan = schedule(streams, args.rounds, args.think_s, args.tokens, not args.same_length, streams)
            print(asyncio.run(fleet_level(args.url, args.model, plan))[0], flush=True)
        return
    local = Local()
    rows: list[dict[str, Any]] = []
    longest = args.tokens if args.same_length else args.tokens * 7 // 4
    seq, refs = sequential(local, list(range(args.sequential_prompts)), longest)
    rows.append(seq)
    print(seq, flush=True)
    mismatches: list[dict[str, Any]] = []
    for streams in args.streams:
        plan = schedule(streams, args.rounds, args.think_s, args.tokens, not args.same_length, streams)
        row, outputs = asyncio.run(fleet_level(args.url, args.model, plan))
        rows.append(row)
        print(row, flush=True)
        for prompt, ids in outputs:
            ref = refs.get(prompt) or local.generate([PROMPTS[prompt]], longest)[0]
            refs[prompt] = ref
            ref = ref[:len(ids)]  # greedy: a shorter generation is a prefix of the longest
            if ids != ref:
                at = next((i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b),
                          min(len(ids), len(ref)))
                mismatches.append({"streams": streams, "prompt": prompt, "first_difference_at": at,
                                   "alone_margin": round(local.margin(PROMPTS[prompt], ref[:at]), 4)})
        row = static_level(local, plan)
        rows.append(row)
        print(row, flush=True)
    seq_tps = seq["tokens_per_s"]
    print("\n| system | streams | tokens/s | x sequential | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['streams']} | {r['tokens_per_s']} | {r['tokens_per_s'] / seq_tps:.2f} | "
              f"{r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['itl_p50_ms']} | {r['itl_p99_ms']} |")
    print(f"\nexactness: {sum(len(o) for o in [mismatches])} fleet generations differ from the prompt alone"
          + (f": {mismatches}" if mismatches else ""))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"rows": rows, "mismatches": mismatches, "args": vars(args) | {"out": str(args.out)}}
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
