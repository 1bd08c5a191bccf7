"""The model of the demo's "TensorRT-LLM side": a tiny Llama forward over a KV pool of
TensorRT-LLM's exact geometry (``kvbridge.demo.trt_engine`` drives the connector with it).

``TinyLlamaRunner`` implements the Llama forward (RMSNorm, GQA attention with
non-interleaved "rotate half" RoPE, SiLU MLP) over the weights transformers loads from
the tiny model's folder, and keeps K/V ONLY in the pool
``[num_blocks, layers, 2, kv_heads * tokens_per_block * head_dim]`` (HND inside a block,
``kvbridge.layout.allocate_pool("trtllm", ...)``). What the pool holds per token is what
SGLang's ``MHATokenToKVPool`` and transformers' ``DynamicCache`` hold: K after RoPE, V
as projected (SGLang: ``LlamaAttention.forward`` applies ``rotary_emb`` before
``RadixAttention`` stores k; transformers: ``apply_rotary_pos_emb`` before
``past_key_values.update``). Every forward step writes the new tokens' K/V into the
request's blocks and then gathers K/V for positions ``[0, pos]`` back from the blocks, so
decode continues from whatever the pool holds, e.g. KV another engine wrote.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .paged_runner import PagedRunner


# -- the model runner -------------------------------------------------------------------
class TinyLlamaRunner(PagedRunner):
    """Greedy float32 Llama over a TensorRT-LLM-geometry pool (one request at a time)."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        cfg = model.config
        self.cfg = cfg
        self.layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rp = getattr(cfg, "rope_parameters", None) or {}
        theta = rp.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rp.get('rope_type')}")
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.w = sd
        del model

    # -- pools --------------------------------------------------------------------------
    def allocate_pool(self, *, tokens_per_block: int, num_blocks: int, seed: int | None = 7):
        """A pool of TensorRT-LLM's geometry for this model (float32), filled with seeded
        garbage so that reading anything the request does not own shows up."""
        from kvbridge.layout import allocate_pool

        return allocate_pool("trtllm", layers=self.layers, total_heads=self.kv_heads, head_dim=self.head_dim,
                             dtype="float32", tokens_per_block=tokens_per_block, num_blocks=num_blocks, seed=seed)

    def _blocks6(self, pool: torch.Tensor, tpb: int) -> torch.Tensor:
        nb, layers, kvf, bs = pool.shape
        assert kvf == 2 and bs == self.kv_heads * tpb * self.head_dim, pool.shape
        return pool.view(nb, layers, 2, self.kv_heads, tpb, self.head_dim)  # HND inside a block

    def write_kv(self, pool, tpb, blocks, layer, positions, k, v) -> None:
        """k, v: [T, kv_heads, head_dim] for ``positions`` -> the request's blocks."""
        p6 = self._blocks6(pool, tpb)
        blk, slot = self._where(blocks, positions, tpb)
        p6[blk, layer, 0, :, slot, :] = k
        p6[blk, layer, 1, :, slot, :] = v

    def read_kv(self, pool, tpb, blocks, layer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n, kv_heads, head_dim] of positions [0, n) from the request's blocks."""
        p6 = self._blocks6(pool, tpb)
        blk, slot = self._where(blocks, torch.arange(n), tpb)
        return p6[blk, layer, 0, :, slot, :], p6[blk, layer, 1, :, slot, :]

    # -- the forward ----------------------------------------------------------------------
    def _rope(self, x, positions):  # x [T, H, D]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    @torch.no_grad()
    def forward(self, token_ids: Sequence[int], start: int, pool: torch.Tensor, tpb: int,
                blocks: Sequence[int]) -> torch.Tensor:
        """Compute tokens at positions [start, start + T): write their K/V into the pool,
        attend over K/V of [0, start + T) read from the pool. Returns logits [T, vocab]."""
        w, T, D = self.w, len(token_ids), self.head_dim
        pos = torch.arange(start, start + T)
        n = start + T
        x = w["model.embed_tokens.weight"][torch.as_tensor(list(token_ids), dtype=torch.long)]
        causal = pos[:, None] >= torch.arange(n)[None, :]  # [T, n]
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, self.heads, D)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, self.kv_heads, D)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, self.kv_heads, D)
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.write_kv(pool, tpb, blocks, i, pos, k, v)
            K, V = self.read_kv(pool, tpb, blocks, i, n)  # [n, kvh, D]: only from the pool
            K = K.repeat_interleave(group, dim=1)
            V = V.repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,nhd->htn", q, K) / math.sqrt(D)
            scores = scores.masked_fill(~causal[None], float("-inf"))
            attn = torch.einsum("htn,nhd->thd", scores.softmax(-1), V).reshape(T, self.heads * D)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = self._rms(x, w["model.norm.weight"])
        return x @ w["lm_head.weight"].T


def pool_kv(runner: TinyLlamaRunner, pool, tpb, blocks, n) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (K, V) [n, kv_heads, head_dim] of the first n positions (copies)."""
    return [tuple(t.clone().numpy() for t in runner.read_kv(pool, tpb, blocks, i, n)) for i in range(runner.layers)]
