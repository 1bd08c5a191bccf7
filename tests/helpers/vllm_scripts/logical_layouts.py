"""Run in the vLLM venv: vLLM's own KV cache allocation (``vllm/v1/kv_cache_interface.py``:
``compute_layout_strides`` for the ``KVCacheTensor`` strides, as
``kv_cache_utils.get_kv_cache_config`` computes them, and ``create_kv_cache_views``, as
the GPU worker calls it) lays out one backing buffer in each of ``KVCacheLayout``'s six
stride orders, for an attention cache (``FullAttentionSpec``) and an MLA cache
(``MLAAttentionSpec``), on CPU memory. Known K/V go in through vLLM's *logical* view the
way its attention backends read it (``kv_cache.transpose(1, 2).split(head_size, -1)``,
FLASH_ATTN; the latent row for MLA), kvbridge describes the views
(``vllm_paged_layout``) and moves a request to an SGLang and a TensorRT-LLM pool and back;
every element is compared through each engine's own indexing. Prints one JSON line:
{"<mha|mla> <layout>": {"to_sglang", "to_trtllm", "from_sglang", "block_outermost", "kinds"}}."""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec, compute_layout_strides,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge.layout import allocate_pool, plan_transfer, vllm_paged_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: its test helpers
from tests.helpers.kvhelpers import run_plan  # noqa: E402

L, NB, BS, H, HD, LATENT, T = 3, 10, 16, 4, 32, 96, 37
DT = torch.bfloat16


def vllm_tensor(spec, layout):
    """The ``KVCacheTensor`` of ``L`` layers in one allocation, as vLLM's KV cache config has it."""
    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, NB, L, layout)
    return KVCacheTensor(size=L * NB * spec.page_size_bytes, layers=[f"model.layers.{i}.self_attn.attn" for i in range(L)],
                         layer_stride=layer_stride, block_stride=block_stride)


def vllm_caches(spec, layout):
    """Per-layer logical views over one buffer, as vLLM's worker builds them."""
    tensor = vllm_tensor(spec, layout)
    raw = torch.randint(-128, 127, (tensor.size,), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    return raw, create_kv_cache_views(raw, spec, NB, layout, tensor)


def logical_rows(caches, mla):
    """K and V (or the latent) as the backend reads them: per layer [B, N, H, D] each."""
    if mla:
        return [(c.transpose(1, 2),) for c in caches]
    return [tuple(c.transpose(1, 2).split(HD, dim=-1)) for c in caches]


def engine_rows(engine, pool, blocks, tpb, mla):
    """[L, kv, T, H, D] read through the engine's own indexing (SGLang: per-layer K then V
    buffers [slots, heads, dim]; TensorRT-LLM: one pool [blocks, layers, kv, heads*tpb*dim], HND)."""
    kv = 1 if mla else 2
    heads, hd = (1, LATENT) if mla else (H, HD)
    pos = torch.arange(T)
    if engine == "sglang":
        slots = torch.as_tensor(blocks)[pos // tpb] * tpb + pos % tpb
        bufs = list(pool.tensors)
        return torch.stack([torch.stack([bufs[k * L + l].view(-1, heads, hd)[slots] for k in range(kv)])
                            for l in range(L)])
    p = pool.tensors[0].view(NB_OTHER, L, kv, heads, tpb, hd)
    b = torch.as_tensor(blocks)[pos // tpb]
    return p[b, :, :, :, pos % tpb].permute(1, 2, 0, 3, 4)


NB_OTHER = 12
out = {}
for kind in ("mha", "mla"):
    mla = kind == "mla"
    spec = (MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=DT) if mla else
            FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=HD, dtype=DT))
    for layout in KVCacheLayout:
        raw, caches = vllm_caches(spec, layout)
        lay = vllm_paged_layout(caches, head_size=LATENT if mla else HD, total_heads=1 if mla else H, mla=mla)
        g = torch.Generator().manual_seed(7)
        vblocks = [4, 9, 2]  # vLLM block ids of the request, token order
        rows = logical_rows(caches, mla)
        want = torch.randn(L, 1 if mla else 2, T, 1 if mla else H, LATENT if mla else HD, generator=g).to(DT)
        pos = torch.arange(T)
        for l in range(L):
            for k, part in enumerate(rows[l]):  # [B, N, H, D]: write through vLLM's logical view
                part[torch.as_tensor(vblocks)[pos // BS], pos % BS] = want[l, k]
        res = {"block_outermost": layout.is_block_outermost}
        for engine, tpb in (("sglang", 8), ("trtllm", 32)):
            other = allocate_pool(engine, layers=L, total_heads=1 if mla else H, head_dim=LATENT if mla else HD,
                                  dtype="bf16", tokens_per_block=tpb, num_blocks=NB_OTHER, mla=mla, seed=3)
            oblocks = list(range(NB_OTHER - 1, NB_OTHER - 1 - (-(-T // tpb)), -1))
            run_plan(plan_transfer(lay, vblocks, other, oblocks, (0, T)), [(r.addr, r.nbytes) for r in other.regions])
            got = engine_rows(engine, other, oblocks, tpb, mla)
            res[f"to_{engine}"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        # back: SGLang's pool (holding the request) into other vLLM blocks of the same cache
        back = [7, 1, 5]
        sg = allocate_pool("sglang", layers=L, total_heads=1 if mla else H, head_dim=LATENT if mla else HD,
                           dtype="bf16", tokens_per_block=8, num_blocks=NB_OTHER, mla=mla, seed=4)
        sblocks = list(range(1, 1 + -(-T // 8)))
        before = raw.clone()
        run_plan(plan_transfer(sg, sblocks, lay, back, (0, T)), [(r.addr, r.nbytes) for r in lay.regions])
        # every other (block, token) of every layer as it was: compare the logical views
        # with the written (block, token) cells masked out
        written = torch.zeros(NB, BS, dtype=torch.bool)
        written[torch.as_tensor(back)[pos // BS], pos % BS] = True
        same = True
        for c, b in zip(caches, create_kv_cache_views(before, spec, NB, layout, vllm_tensor(spec, layout))):
            same &= bool(torch.equal(c.transpose(1, 2)[~written].view(torch.int16), b.transpose(1, 2)[~written].view(torch.int16)))
        res["untouched_elsewhere"] = same
        src = engine_rows("sglang", sg, sblocks, 8, mla)
        rows = logical_rows(caches, mla)
        got = torch.stack([torch.stack([part[torch.as_tensor(back)[pos // BS], pos % BS] for part in rows[l]])
                           for l in range(L)])
        res["from_sglang"] = bool(torch.equal(got.view(torch.int16), src.view(torch.int16)))  # bytes: the pool holds NaNs
        out[f"{kind} {layout.name}"] = res
print(json.dumps(out))
