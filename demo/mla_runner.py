"""A tiny DeepSeek-V3-style MLA model runner over a KV pool of TensorRT-LLM's MLA geometry.

``TinyMLARunner`` is the multi-head latent attention counterpart of
``kvbridge.demo.llama_runner.TinyLlamaRunner``, with the same interface, so
the TensorRT-LLM stand-in (``kvbridge.demo.trtllm``) runs it alike: a greedy float32 forward (RMSNorm, MLA attention, SiLU MLP) over the weights
transformers loads from a DeepSeek-V3 model folder, that keeps the attention cache ONLY
in a TensorRT-LLM MLA pool::

    pool [num_blocks, layers, 1, tokens_per_block * (kv_lora_rank + qk_rope_head_dim)]

(kv_factor 1: one latent "head" per token; ``kvbridge.layout.allocate_pool("trtllm",
..., mla=True)``). Per token and layer a pool row is ``kv_lora_rank + qk_rope_head_dim``
values, exactly what SGLang's ``MLATokenToKVPool`` stores per token (one row of
``kv_buffer[layer]`` ``[slots, 1, kv_lora_rank + qk_rope_head_dim]``), so bytes moved
from an SGLang pool are bytes this runner reads:

- ``[0, kv_lora_rank)``: the compressed KV after ``kv_a_layernorm``
  (SGLang ``forward_mla``: ``k_nope = kv_a_layernorm(latent_cache[..., :kv_lora_rank])``;
  transformers caches the same tensor as its "key");
- ``[kv_lora_rank, +qk_rope_head_dim)``: the shared key part ``k_pe`` after RoPE, in
  the model's own dimension order. With ``rope_interleave`` (DeepSeek-V3's default)
  RoPE rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` and SGLang keeps that
  order (``is_neox_style=False``: GPT-J rotation in place); transformers' cache holds
  the same values de-interleaved (``cat(even, odd)``, ``apply_rotary_pos_emb_interleave``).
  Without ``rope_interleave`` both use rotate-half RoPE in place.

Attention expands the latent rows read from the pool with ``kv_b_proj`` into per-head
``k_nope`` and ``v``; scores are ``q_nope.k_nope + q_pe.k_pe`` times the model's scale.
Every forward step writes the new tokens' rows into the request's blocks, then reads
rows ``[0, pos]`` back from the blocks, so decode continues from whatever the pool
holds (for example rows another engine wrote).

Only dense-MLP models are supported (``first_k_dense_replace`` >= layers): MoE layers
raise ``NotImplementedError``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .paged_runner import PagedRunner, PoolStore, SeqStep

__all__ = ["TinyMLARunner"]

log = logging.getLogger(__name__)


class TinyMLARunner(PagedRunner):
    """Greedy float32 DeepSeek-V3 (MLA, dense MLP) over a TensorRT-LLM MLA pool (one request at a time)."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        cfg = model.config
        if not getattr(cfg, "kv_lora_rank", None):
            raise ValueError(f"{model_dir}: not an MLA model (no kv_lora_rank in its config)")
        self.cfg = cfg
        self.layers = cfg.num_hidden_layers
        dense = getattr(cfg, "first_k_dense_replace", self.layers)
        if dense < self.layers:
            raise NotImplementedError(f"{model_dir}: layers {dense}..{self.layers - 1} are MoE; "
                                      "TinyMLARunner runs dense-MLP layers only")
        self.heads = cfg.num_attention_heads
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_dim = cfg.qk_rope_head_dim
        self.nope_dim = cfg.qk_nope_head_dim
        self.v_dim = cfg.v_head_dim
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        self.row = self.kv_lora_rank + self.rope_dim  # one pool row per token and layer
        self.head_dim = self.row  # the pool's one latent "head"
        self.kv_heads = 1
        self.eps = cfg.rms_norm_eps
        self.interleave = bool(getattr(cfg, "rope_interleave", True))
        # RoPE frequencies, their scale (yarn's attention factor; 1 for plain RoPE) and the
        # softmax scale exactly as the model defines them (rope type, yarn mscale).
        rot = model.model.rotary_emb
        self.inv_freq = rot.inv_freq.detach().float().clone()  # [rope_dim / 2]
        self.rope_scale = float(rot.attention_scaling)
        self.scaling = float(model.model.layers[0].self_attn.scaling)
        self.w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
        log.debug("TinyMLARunner: %d layers, %d heads, latent row %d (kv_lora_rank %d + rope %d), interleave %s",
                  self.layers, self.heads, self.row, self.kv_lora_rank, self.rope_dim, self.interleave)

    # -- pools --------------------------------------------------------------------------
    def allocate_pool(self, *, tokens_per_block: int, num_blocks: int, seed: int | None = 7):
        """A TensorRT-LLM MLA pool for this model (float32) and its KVLayout:
        ``[num_blocks, layers, 1, tokens_per_block * (kv_lora_rank + qk_rope_head_dim)]``,
        filled with seeded garbage so that reading anything the request does not own shows up."""
        from kvbridge.layout import allocate_pool

        return allocate_pool("trtllm", layers=self.layers, total_heads=1, head_dim=self.row, dtype="float32",
                             tokens_per_block=tokens_per_block, num_blocks=num_blocks, mla=True, seed=seed)

    def _rows(self, pool: torch.Tensor, tpb: int) -> torch.Tensor:
        """The pool as [num_blocks, layers, tokens_per_block, row]."""
        if pool.dim() != 4 or pool.shape[2] != 1 or pool.shape[3] != tpb * self.row or pool.shape[1] != self.layers:
            raise ValueError(f"expected an MLA pool [blocks, {self.layers}, 1, {tpb} x {self.row}], "
                             f"got {tuple(pool.shape)}")
        return pool.view(pool.shape[0], self.layers, tpb, self.row)

    def read_kv(self, pool, tpb, blocks, layer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ckv [n, kv_lora_rank], k_pe [n, qk_rope_head_dim]) of positions [0, n) from the
        request's blocks."""
        rows = self._rows(pool, tpb)
        blk, slot = self._where(blocks, torch.arange(n), tpb)
        r = rows[blk, layer, slot]  # [n, row]
        return r[:, : self.kv_lora_rank], r[:, self.kv_lora_rank:]

    # -- the forward ----------------------------------------------------------------------
    def _rope(self, x, positions):
        """RoPE over the last dim of x [T, ..., rope_dim], in place of the model's order:
        interleaved pairs (GPT-J style) with ``rope_interleave``, else rotate-half."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rope_dim / 2]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[-1],)
        cos = (freqs.cos() * self.rope_scale).view(shape)
        sin = (freqs.sin() * self.rope_scale).view(shape)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _linear(self, x, name):
        y = x @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    def _embed(self, seq: SeqStep) -> None:
        ids = torch.as_tensor(list(seq.token_ids), dtype=torch.long)
        seq.state["x"] = self.w["model.embed_tokens.weight"][ids]
        seq.state["pos"] = torch.arange(seq.start, seq.start + len(ids))

    def _layer(self, i: int, seq: SeqStep, store: PoolStore) -> None:
        """Decoder layer ``i`` for ``seq``: its new tokens' latent rows ``[ckv | k_pe]``
        into the store (one "head"), attention over the rows of ``[0, start)`` read from
        the store and of the new tokens as stored."""
        w, H, x, pos = self.w, self.heads, seq.state["x"], seq.state["pos"]
        r, nope = self.kv_lora_rank, self.nope_dim
        T, n = len(pos), seq.start + len(pos)
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = self._rms(x, w[p + "input_layernorm.weight"])
        if self.q_lora_rank:
            q = self._linear(self._rms(self._linear(h, a + "q_a_proj"), w[a + "q_a_layernorm.weight"]), a + "q_b_proj")
        else:
            q = self._linear(h, a + "q_proj")
        q = q.view(T, H, nope + self.rope_dim)
        q_nope, q_pe = q[..., :nope], self._rope(q[..., nope:], pos)
        latent = self._linear(h, a + "kv_a_proj_with_mqa")  # [T, r + rope]
        ckv = self._rms(latent[:, :r], w[a + "kv_a_layernorm.weight"])
        k_pe = self._rope(latent[:, r:], pos)
        fresh = store.write(i, seq.blocks, pos, torch.cat([ckv, k_pe], dim=-1)[None, :, None, :])  # [1, T, 1, row]
        rows = torch.cat([store.read(i, seq.blocks, seq.start), fresh], dim=1)[0, :, 0, :]  # [n, row]: only from the pool
        C, KPE = rows[:, :r], rows[:, r:]
        kv = (C @ w[a + "kv_b_proj.weight"].T).view(n, H, nope + self.v_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        causal = pos[:, None] >= torch.arange(n)[None, :]  # [T, n]
        scores = (torch.einsum("thd,nhd->htn", q_nope, k_nope)
                  + torch.einsum("thd,nd->htn", q_pe, KPE)) * self.scaling
        scores = scores.masked_fill(~causal[None], float("-inf"))
        attn = torch.einsum("htn,nhd->thd", scores.softmax(-1), v).reshape(T, H * self.v_dim)
        x = x + self._linear(attn, a + "o_proj")
        h = self._rms(x, w[p + "post_attention_layernorm.weight"])
        gate = self._linear(h, p + "mlp.gate_proj")
        up = self._linear(h, p + "mlp.up_proj")
        seq.state["x"] = x + self._linear(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj")

    def _logits(self, seq: SeqStep) -> torch.Tensor:
        return self._rms(seq.state["x"], self.w["model.norm.weight"]) @ self.w["lm_head.weight"].T
