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

``kv_addresses`` gives the byte address of every (layer, K/V, token, head) row of a pool
kvbridge was handed, by the same rules applied to the engine's own tensors as kvbridge got
them (their shapes, and the order the engine registers them in: SGLang's
``get_contiguous_buf_infos`` lists every layer's K buffer, then every layer's V buffer),
never the layout's strides.

``transformers_kv`` is the reference: per layer and position, K after RoPE and V (or an
MLA model's latent row ``[kv_a_layernorm(ckv) | k_pe]``, k_pe in the model's interleaved
order) from the model's own forward with ``use_cache=True``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["kv_addresses", "trtllm_kv", "sglang_kv", "vllm_kv", "transformers_kv", "fp8_round", "as_float", "assert_kv_close"]


def kv_addresses(layout: Any, blocks: Sequence[int], first_token: int, start: int, stop: int,
                 heads_local: Sequence[int]) -> np.ndarray:
    """Absolute byte addresses ``[layers, kv_factor, T, H, row_bytes]`` (int64) of tokens
    ``[start, stop)`` and the pool's local heads ``heads_local``, in a pool kvbridge was
    handed (``layout.tensors``, ``blocks`` in token order from ``first_token``), computed
    by that engine's own indexing from its tensors. Read from the layout: only which engine
    and the geometry the engine was configured with (page size, heads, row bytes)."""
    t = np.arange(start, stop, dtype=np.int64) - int(first_token)
    h = np.asarray(list(heads_local), dtype=np.int64)
    blocks = np.asarray(blocks, dtype=np.int64)
    tensors = list(layout.tensors)
    eng, page, layers = layout.engine, int(layout.tokens_per_block), int(layout.num_layers)
    blk, slot = blocks[t // page], t % page
    if eng in ("sglang-mha", "sglang-mla"):
        # k_buffer[l] / v_buffer[l] (kv_buffer[l] for MLA): [size + page_size, heads, head_dim]
        kvf = 1 if eng == "sglang-mla" else 2
        if len(tensors) != kvf * layers:
            raise AssertionError(f"{eng}: {len(tensors)} buffers for {layers} layers")
        out = []
        for l in range(layers):
            per_kv = []
            for kv in range(kvf):
                buf = tensors[kv * layers + l]
                _, nh, hd = buf.shape
                row = hd * buf.element_size()
                rows = (blk * page + slot)[:, None] * nh + h[None, :]  # [T, H]
                per_kv.append(buf.data_ptr() + rows[:, :, None] * row + np.arange(row)[None, None, :])
            out.append(np.stack(per_kv))
        return np.stack(out)
    if eng in ("trtllm", "trtllm-mla"):
        # the primary pool [blocks, layers, kv_factor, heads * tokens_per_block * head_dim],
        # HND inside a block (token-major: NHD)
        (pool,) = tensors
        nb, nl, kvf, per_block = pool.shape
        if nl != layers:
            raise AssertionError(f"{eng}: a pool of {nl} layers seen as {layers} (pool_layers): not modelled here")
        nh, isz = int(layout.num_heads), pool.element_size()
        hd = per_block // (nh * page)
        row = hd * isz
        token_major = int(layout.token_stride) == nh * row and nh > 1
        within = (slot[:, None] * nh + h[None, :]) if token_major else (h[None, :] * page + slot[:, None])  # [T, H]
        lk = (np.arange(nl)[:, None] * kvf + np.arange(kvf)[None, :])  # [layers, kv]
        elem = ((blk[None, None, :, None] * nl * kvf + lk[:, :, None, None]) * nh * page + within[None, None]) * row
        return pool.data_ptr() + elem[..., None] + np.arange(row)
    if eng in ("vllm-cpu", "vllm-cpu-amx", "vllm-mla"):
        rel = _vllm_offsets(layout, blocks, first_token, start, stop, heads_local)
        return rel + np.array([x.data_ptr() for x in tensors], dtype=np.int64)[:, None, None, None, None]
    raise AssertionError(f"no engine indexing rule for a {eng!r} pool")


def _vllm_offsets(layout: Any, blocks, first_token: int, start: int, stop: int, heads_local) -> np.ndarray:
    """Byte offsets ``[layers, 2, T, H, row_bytes]`` inside each layer tensor of vLLM's CPU
    cache, from vLLM's own description and not the layout's strides: each layer tensor is ``[num_blocks, heads, block_size, 2 * head_size]``
    (its shape read here); inside a (block, head), K element (token t, dim j) is element
    ``j * block_size + t`` and V element (t, j) is ``block_size * head_size + t * head_size
    + j`` (cpu_attn_vec.hpp, reshape_and_cache); for the 'amx' ISA the offsets its
    reshape kernel writes (vllm_scripts/kernel_layout.py checks them on every element). The last axis is each element's bytes.
    MLA (CPU_MLA): each layer ``[num_blocks, 1, block_size, latent]``, one row per token."""
    if layout.engine == "vllm-mla":
        nb, _, bs, d = layout.tensors[0].shape
        isz = layout.tensors[0].element_size()
        t = np.arange(start, stop) - first_token
        rows = np.asarray(blocks, dtype=np.int64)[t // bs] * bs + t % bs
        byte = (rows[:, None] * d * isz + np.arange(d * isz)[None, :])[None, :, None, :]  # [kv=1, T, H=1, bytes]
        return np.broadcast_to(byte[None], (len(layout.tensors),) + byte.shape).copy()
    nb, nh, bs, hd2 = layout.tensors[0].shape
    hd, isz = hd2 // 2, layout.tensors[0].element_size()
    blocks = np.asarray(blocks, dtype=np.int64)
    t = np.arange(start, stop) - first_token
    blk, slot = blocks[t // bs], t % bs
    h = np.asarray(heads_local, dtype=np.int64)
    j = np.arange(hd)
    tile = (blk[:, None] * nh + h[None, :]) * (bs * hd2)  # [T, H] first element of the (block, head)
    isa = "amx" if layout.engine == "vllm-cpu-amx" else "vec"
    k, v = _vllm_tile_elems(isa, bs, hd, slot[:, None, None], j[None, None, :])
    elems = np.stack([tile[:, :, None] + k, tile[:, :, None] + v])  # [kv, T, H, hd]
    byte = (elems[..., None] * isz + np.arange(isz)).reshape(2, t.size, h.size, hd * isz)
    return np.broadcast_to(byte[None], (len(layout.tensors),) + byte.shape).copy()


def _vllm_tile_elems(isa: str, bs: int, hd: int, t, j):
    """Element offsets of K and V (token ``t``, dim ``j``; arrays that broadcast) inside one
    (block, head) tile of vLLM's CPU cache, as its ``isa`` kernel writes them: 'vec' and
    'vec16' store K transposed (``j * bs + t``) and V row-major after it; 'amx' interleaves
    K in 16-token runs of dimension pairs and V in token pairs (its own reshape kernel,
    checked element by element in vllm_scripts/kernel_layout.py)."""
    if isa == "amx":
        return ((t // 16) * 16 * hd + (j // 2) * 32 + (t % 16) * 2 + j % 2,
                bs * hd + (j // 16) * 16 * bs + (t // 2) * 32 + (j % 16) * 2 + t % 2)
    return j * bs + t, bs * hd + t * hd + j


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
            positions: Sequence[int], isa: str = "vec") -> torch.Tensor:
    """``[layers, 2, T, heads, head_dim]`` of ``positions`` from vLLM's CPU cache, one
    ``[num_blocks, heads, block_size, 2 * head_dim]`` tensor per layer, as its ``isa``
    kernel lays a (block, head) out."""
    nb, heads, bs, hd2 = layer_caches[0].shape
    hd = hd2 // 2
    j = torch.arange(hd)
    out = torch.empty(len(layer_caches), 2, len(positions), heads, hd, dtype=layer_caches[0].dtype)
    for layer, cache in enumerate(layer_caches):
        for i, t in enumerate(positions):
            b, slot = int(blocks[t // block_size]), t % block_size
            k, v = _vllm_tile_elems(isa, bs, hd, slot, j)
            for h in range(heads):
                tile = cache[b, h].reshape(-1)
                out[layer, 0, i, h] = tile[k]
                out[layer, 1, i, h] = tile[v]
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


def assert_kv_close(got: torch.Tensor, want: torch.Tensor, what: str, fp8: bool = False, atol: float = 1e-5) -> None:
    """Engine KV ``got`` equals the reference ``want`` (float32; fp8-rounded when the cache is fp8;
    ``atol`` for float caches: another engine's kernels round differently from transformers')."""
    if fp8:
        want = fp8_round(want)
        # values near a rounding boundary may round the other way: allow one fp8 step (12.5% relative)
        torch.testing.assert_close(got, want, rtol=0.13, atol=2 ** -9, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")

