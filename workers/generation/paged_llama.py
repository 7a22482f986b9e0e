"""One forward pass of a Llama model over a continuous-batching iteration, with a paged KV cache.

Why not Hugging Face's own forward: its caches are per batch (a DynamicCache grows every row together),
so sequences could not join and leave the running batch between steps without copying every cache.
Here the weights and submodules are transformers' own (`LlamaForCausalLM`: embeddings, projections,
norms, rotary tables, MLP, lm_head); only the attention's KV storage is fleet's.

Layout (vLLM's "paged attention" without its kernels): per layer one K and one V tensor of
`kv_blocks * block_tokens` token slots, [slots, kv_heads, head_dim]; a sequence owns whole blocks,
listed in its block table, so its position p lives in slot `table[p // block] * block + p % block`.
Memory is fixed at load: `kv_blocks * block_tokens * layers * 2 * kv_heads * head_dim * 4` bytes (SmolLM2:
46 KiB per token). The cost is a gather per layer: attention reads each sequence's keys through its slot
indices (a copy of the batch's context per layer per step), where a padded contiguous cache would copy
nothing but would reserve max-context slots for every running sequence.

The pass is "flattened": the tokens of every sequence in it (a decode's one token, a prefill chunk's
many) are one [1, T] batch through every linear layer (one matmul each), and only attention is per
sequence: decodes together as one padded batch, each prefill chunk alone with its causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@dataclass(frozen=True, slots=True)
class Segment:
    """A sequence's tokens in the pass: `tokens` at positions [start, start + len(tokens)), whose context
    (earlier positions) is already cached; `logits`: whether the pass must score its last token."""

    key: str
    tokens: list[int]
    start: int
    logits: bool


class PagedKV:
    """The KV storage and the block tables of the sequences that hold blocks."""

    def __init__(self, config: Any, kv_blocks: int, block_tokens: int, dtype: torch.dtype) -> None:
        self.block_tokens = block_tokens
        self.kv_blocks = kv_blocks
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        slots = kv_blocks * block_tokens
        self.k = [torch.zeros(slots, heads, head_dim, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(slots, heads, head_dim, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self._free = list(range(kv_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def used_blocks(self) -> int:
        return self.kv_blocks - len(self._free)

    def ensure(self, key: str, tokens: int) -> None:
        """Blocks for positions [0, tokens) of `key` (the scheduler has already counted them as taken)."""
        table = self.tables.setdefault(key, [])
        while len(table) * self.block_tokens < tokens:
            table.append(self._free.pop())

    def release(self, key: str) -> None:
        self._free.extend(reversed(self.tables.pop(key, [])))

    def slots(self, key: str, start: int, end: int) -> torch.Tensor:
        table = torch.tensor(self.tables[key], dtype=torch.long)
        pos = torch.arange(start, end, dtype=torch.long)
        return table[pos // self.block_tokens] * self.block_tokens + pos % self.block_tokens


class PagedLlama:
    """A loaded LlamaForCausalLM run pass by pass over a PagedKV."""

    def __init__(self, model: Any, kv_blocks: int, block_tokens: int) -> None:
        self.model = model.eval()
        self.config = model.config
        dtype = next(model.parameters()).dtype
        self.kv = PagedKV(self.config, kv_blocks, block_tokens, dtype)
        self._inner = model.model
        self._heads = self.config.num_attention_heads

    @torch.inference_mode()  # type: ignore[untyped-decorator]  # torch is not followed (pyproject)
    def forward(self, segments: list[Segment]) -> dict[str, torch.Tensor]:
        """Runs one pass; writes every segment's K/V into its blocks (ensure() them first). Returns the
        last token's logits (float32, [vocab]) of each segment that asked for them."""
        kv = self.kv
        tokens = [t for s in segments for t in s.tokens]
        positions = torch.tensor([s.start + i for s in segments for i in range(len(s.tokens))], dtype=torch.long)
        write = torch.cat([kv.slots(s.key, s.start, s.start + len(s.tokens)) for s in segments])
        decodes = [i for i, s in enumerate(segments) if len(s.tokens) == 1 and s.start > 0]
        others = [i for i, s in enumerate(segments) if not (len(s.tokens) == 1 and s.start > 0)]
        offsets = [0]
        for s in segments:
            offsets.append(offsets[-1] + len(s.tokens))
        # Every layer reads the same context slots: worked out once per pass.
        dec_rows = torch.tensor([offsets[i] for i in decodes], dtype=torch.long)
        dec_slots = dec_mask = None
        if decodes:
            lengths = [segments[i].start + 1 for i in decodes]
            width = max(lengths)
            dec_slots = torch.zeros(len(decodes), width, dtype=torch.long)  # padding reads slot 0, masked out
            dec_mask = torch.zeros(len(decodes), 1, 1, width, dtype=torch.bool)
            for row, (i, n) in enumerate(zip(decodes, lengths, strict=True)):
                dec_slots[row, :n] = kv.slots(segments[i].key, 0, n)
                dec_mask[row, 0, 0, :n] = True
        chunk_ctx = {i: kv.slots(segments[i].key, 0, segments[i].start + len(segments[i].tokens)) for i in others}

        h = self._inner.embed_tokens(torch.tensor([tokens], dtype=torch.long))
        cos, sin = self._inner.rotary_emb(h, positions[None])
        for li, layer in enumerate(self._inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, len(tokens), -1, attn.head_dim)
            k = attn.k_proj(x).view(1, len(tokens), -1, attn.head_dim)
            v = attn.v_proj(x).view(1, len(tokens), -1, attn.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            kv.k[li][write] = k[0]
            kv.v[li][write] = v[0]
            out = torch.empty(len(tokens), self._heads, attn.head_dim, dtype=q.dtype)
            if decodes:
                assert dec_slots is not None and dec_mask is not None
                qd = q[0, dec_rows].unsqueeze(2)  # [B, heads, 1, dim]
                kd = kv.k[li][dec_slots].transpose(1, 2)  # [B, kv_heads, width, dim]
                vd = kv.v[li][dec_slots].transpose(1, 2)
                o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec_mask, scale=attn.scaling,
                                                   enable_gqa=True)
                out[dec_rows] = o[:, :, 0]
            for i in others:
                s = segments[i]
                lo, hi = offsets[i], offsets[i + 1]
                ctx = chunk_ctx[i]
                qc = q[0, lo:hi].transpose(0, 1)[None]  # [1, heads, n, dim]
                kc = kv.k[li][ctx].transpose(0, 1)[None]
                vc = kv.v[li][ctx].transpose(0, 1)[None]
                # Query j sits at position start + j and sees positions <= its own.
                mask = torch.ones(hi - lo, len(ctx), dtype=torch.bool).tril(s.start)
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
                out[lo:hi] = o[0].transpose(0, 1)
            h = h + attn.o_proj(out.reshape(1, len(tokens), -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        want = [(s.key, offsets[i + 1] - 1) for i, s in enumerate(segments) if s.logits]
        if not want:
            return {}
        last = self._inner.norm(h[0, [row for _, row in want]])
        logits = self.model.lm_head(last).float()
        return {key: logits[n] for n, (key, _) in enumerate(want)}
