"""KV read the way each engine addresses it, and KV computed by transformers.

Written from the engines' own indexing rules, independently of ``kvbridge.layout``
(which the code under test uses), so a test can check a pool against the engine rather
than against the layout model:

- TensorRT-LLM primary pool: ``pool[block, layer, kv].view(heads, tokens_per_block,
  head_dim)[head, slot, :]`` with ``block = blocks[t // tokens_per_block]``,
  ``slot = t % tokens_per_block`` (HND inside a block; ``kvCacheUtils.h`` ``getKVLocalIdx``);
- SGLang ``MHATokenToKVPool``: ``k_buffer[layer][page * page_size + t % page_size, head, :]``
  with ``page = pages[t // page_size]``;
- vLLM's CPU cache (``CPU_ATTN``): per layer ``[num_blocks, heads, block_size, 2 * head_dim]``;
  in the (block, head) tile K element (t, j) is element ``j * block_size + t`` and V element
  (t, j) is ``block_size * head_dim + t * head_dim + j`` (``csrc/cpu/cpu_attn_vec.hpp``,
  ``reshape_and_cache``).

``transformers_kv`` is the reference: per layer and position, K after RoPE and V (or an
MLA model's latent row ``[kv_a_layernorm(ckv) | k_pe]``, k_pe in the model's interleaved
order) from the model's own forward with ``use_cache=True``.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["trtllm_kv", "sglang_kv", "vllm_kv", "transformers_kv", "fp8_round", "as_float", "assert_kv_close"]


def trtllm_kv(pool: torch.Tensor, blocks: Sequence[int], tokens_per_block: int, head_dim: int,
              positions: Sequence[int], block_order: str = "HND") -> torch.Tensor:
    """``[layers, kv_factor, T, heads, head_dim]`` (the pool's dtype) of ``positions``;
    ``block_order="NHD"``: ``pool[b, l, kv].view(tokens_per_block, heads, head_dim)[slot, h, :]``."""
    nb, layers, kvf, block_size = pool.shape
    heads = block_size // (tokens_per_block * head_dim)
    out = torch.empty(layers, kvf, len(positions), heads, head_dim, dtype=pool.dtype)
    for i, t in enumerate(positions):
        b, slot = int(blocks[t // tokens_per_block]), t % tokens_per_block
        for layer in range(layers):
            for kv in range(kvf):
                if block_order == "NHD":
                    out[layer, kv, i] = pool[b, layer, kv].view(tokens_per_block, heads, head_dim)[slot]
                else:
                    out[layer, kv, i] = pool[b, layer, kv].view(heads, tokens_per_block, head_dim)[:, slot, :]
    return out


def sglang_kv(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor] | None, pages: Sequence[int],
              page_size: int, positions: Sequence[int]) -> torch.Tensor:
    """``[layers, kv_factor, T, heads, head_dim]`` of ``positions`` from per-layer
    ``k_buffer`` / ``v_buffer`` (MLA: ``kv_buffer`` as ``k_buffers``, ``v_buffers`` None)."""
    slots = [int(pages[t // page_size]) * page_size + t % page_size for t in positions]
    kvs = [k_buffers] if v_buffers is None else [k_buffers, v_buffers]
    return torch.stack([torch.stack([buf[layer][slots] for layer in range(len(k_buffers))]) for buf in kvs], dim=1)


def vllm_kv(layer_caches: Sequence[torch.Tensor], blocks: Sequence[int], block_size: int,
            positions: Sequence[int]) -> torch.Tensor:
    """``[layers, 2, T, heads, head_dim]`` of ``positions`` from vLLM's CPU cache, one
    ``[num_blocks, heads, block_size, 2 * head_dim]`` tensor per layer."""
    nb, heads, bs, hd2 = layer_caches[0].shape
    hd = hd2 // 2
    out = torch.empty(len(layer_caches), 2, len(positions), heads, hd, dtype=layer_caches[0].dtype)
    for layer, cache in enumerate(layer_caches):
        for i, t in enumerate(positions):
            b, slot = int(blocks[t // block_size]), t % block_size
            for h in range(heads):
                tile = cache[b, h].reshape(-1)
                out[layer, 0, i, h] = tile[: bs * hd].view(hd, bs)[:, slot]  # K stored transposed
                out[layer, 1, i, h] = tile[bs * hd + slot * hd: bs * hd + (slot + 1) * hd]
    return out


def transformers_kv(model_dir, prompt: Sequence[int]) -> torch.Tensor:
    """``[layers, kv_factor, T, heads, head_dim]`` float32: what a paged KV cache holds for
    ``prompt`` after transformers' own forward (GQA: K after RoPE, V; MLA: one latent row)."""
    from kvbridge.demo.models import load_model

    model = load_model(model_dir)
    with torch.no_grad():
        cache = model(torch.tensor([list(prompt)]), use_cache=True).past_key_values
    cfg = model.config
    out = []
    for layer in cache.layers:
        k, v = layer.keys[0].float(), layer.values[0].float()  # GQA: [heads, T, D]; MLA: [1, T, r], [1, T, rope]
        if getattr(cfg, "kv_lora_rank", None):
            rope = v.shape[-1]
            # transformers keeps k_pe de-interleaved (cat(even, odd)); engines keep the model's order
            inter = torch.empty(rope, dtype=torch.long)
            inter[0::2], inter[1::2] = torch.arange(rope // 2), torch.arange(rope // 2, rope)
            row = torch.cat([k, v[..., inter]], dim=-1)  # [1, T, r + rope]
            out.append(row.transpose(0, 1)[None])  # [1, T, 1, row]
        else:
            out.append(torch.stack([k.transpose(0, 1), v.transpose(0, 1)]))  # [2, T, heads, D]
    return torch.stack(out)


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded through fp8 e4m3 (what an fp8 KV cache keeps), as float32."""
    return x.to(torch.float8_e4m3fn).float()


def as_float(kv: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Pool elements as float32 (fp8 pools store e4m3 bytes)."""
    return kv.view(torch.float8_e4m3fn).float() if fp8 else kv.float()


def assert_kv_close(got: torch.Tensor, want: torch.Tensor, what: str, fp8: bool = False) -> None:
    """Engine KV ``got`` equals the reference ``want`` (float32; fp8-rounded when the cache is fp8)."""
    if fp8:
        want = fp8_round(want)
        # values near a rounding boundary may round the other way: allow one fp8 step (12.5% relative)
        torch.testing.assert_close(got, want, rtol=0.13, atol=2 ** -9, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")

