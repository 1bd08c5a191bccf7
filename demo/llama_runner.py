"""The model of the demo's "TensorRT-LLM side": a tiny Llama forward over a KV pool of
TensorRT-LLM's exact geometry (the model of ``kvbridge.demo.trtllm``, the TensorRT-LLM stand-in).

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

import numpy as np
import torch

from .paged_runner import PagedRunner, PoolStore, SeqStep


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

    def _embed(self, seq: SeqStep) -> None:
        ids = torch.as_tensor(list(seq.token_ids), dtype=torch.long)
        seq.state["x"] = self.w["model.embed_tokens.weight"][ids]
        seq.state["pos"] = torch.arange(seq.start, seq.start + len(ids))

    def _layer(self, i: int, seq: SeqStep, store: PoolStore) -> None:
        """Decoder layer ``i`` for ``seq``: its new tokens' K (after RoPE) and V into the
        store, attention over K/V of ``[0, start)`` read from the store and of the new
        tokens as stored."""
        w, D, x, pos = self.w, self.head_dim, seq.state["x"], seq.state["pos"]
        T, n = len(pos), seq.start + len(pos)
        p = f"model.layers.{i}."
        h = self._rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, self.heads, D)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, self.kv_heads, D)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, self.kv_heads, D)
        q, k = self._rope(q, pos), self._rope(k, pos)
        fresh = store.write(i, seq.blocks, pos, torch.stack([k, v]))  # [2, T, kvh, D] as stored
        kv = torch.cat([store.read(i, seq.blocks, seq.start), fresh], dim=1)  # [2, n, kvh, D]: only from the pool
        group = self.heads // self.kv_heads
        K, V = kv[0].repeat_interleave(group, dim=1), kv[1].repeat_interleave(group, dim=1)
        causal = pos[:, None] >= torch.arange(n)[None, :]  # [T, n]
        scores = torch.einsum("thd,nhd->htn", q, K) / math.sqrt(D)
        scores = scores.masked_fill(~causal[None], float("-inf"))
        attn = torch.einsum("htn,nhd->thd", scores.softmax(-1), V).reshape(T, self.heads * D)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = self._rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        seq.state["x"] = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def _logits(self, seq: SeqStep) -> torch.Tensor:
        return self._rms(seq.state["x"], self.w["model.norm.weight"]) @ self.w["lm_head.weight"].T


def pool_kv(runner: TinyLlamaRunner, pool, tpb, blocks, n) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (K, V) [n, kv_heads, head_dim] of the first n positions (copies)."""
    return [tuple(t.clone().numpy() for t in runner.read_kv(pool, tpb, blocks, i, n)) for i in range(runner.layers)]
