"""Allocate KV pools in an engine's exact memory format, without the engine.

For benchmarks, demos and tests, and for the TensorRT-LLM side where the engine cannot
run. ``engine='sglang'``: per layer one allocation holding K then V, each
``[num_blocks * tokens_per_block, heads, head_dim]`` (slot = page * page_size + token,
page 0 the padding page), as ``MHATokenToKVPool`` lays them out; MLA: per layer
``[slots, 1, head_dim]``. ``engine='trtllm'``: one tensor ``[num_blocks, layers,
kv_factor, heads * tokens_per_block * head_dim]``, HND inside a block. ``engine='vllm'``:
vLLM's CPU cache, per layer ``[num_blocks, heads, tokens_per_block, 2 * head_dim]`` views
into one allocation, K transposed inside a (block, head); MLA: per layer ``[num_blocks, 1,
tokens_per_block, head_dim]`` latent rows (``vllm_pool``). fp8 is stored as
uint8. ``seed`` fills every byte deterministically (same seed, same bytes).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from .geometry import KVLayout, LayoutError, dtype_itemsize
from .heads import tp_head_slice
from .sglang_pool import sglang_layout_from_buffers
from .trtllm_pool import trtllm_pool_layout
from .vllm_pool import vllm_cpu_layout, vllm_cpu_mla_layout

__all__ = ["allocate_pool", "alias_memory"]


class _CudaSpan:
    """``__cuda_array_interface__`` of ``nbytes`` device bytes at ``addr`` (for a zero-copy alias)."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def alias_memory(addr: int, nbytes: int, device: "torch.device | str" = "cpu") -> torch.Tensor:
    """A uint8 tensor ``[nbytes]`` over the memory at ``addr`` on ``device`` (host or CUDA),
    no copy. The caller keeps whatever owns that memory alive while the alias is used."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(int(addr))))
    if dev.type == "cuda":
        return torch.as_tensor(_CudaSpan(int(addr), int(nbytes)), device=dev)
    raise LayoutError(f"cannot alias memory on a {dev.type} device")

_STORE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}


def _fill(t: torch.Tensor, gen: torch.Generator) -> None:
    b = t.reshape(-1).view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).to(b.device))


def allocate_pool(
    engine: str,
    *,
    layers: int,
    total_heads: int,
    head_dim: int,
    dtype: str,
    tokens_per_block: int,
    num_blocks: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    mla: bool = False,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    isa: str = "vec",
) -> KVLayout:
    """A fresh pool of one engine's format and its KVLayout (tensors attached); ``isa``
    picks the block layout of vLLM's CPU kernels ('vec', 'vec16', 'amx')."""
    heads = 1 if mla else tp_head_slice(total_heads, tp_size, tp_rank)[1]
    store = torch.uint8 if dtype_itemsize(dtype) == 1 else _STORE[dtype_itemsize(dtype)]
    if "float16" == dtype or dtype in ("fp16", "half"):
        store = torch.float16
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tpb = tokens_per_block
    if engine == "sglang":
        slots = num_blocks * tpb
        kv = 1 if mla else 2
        per_layer = [torch.empty(kv, slots, heads, head_dim, dtype=store, device=device) for _ in range(layers)]
        if gen is not None:
            for t in per_layer:
                _fill(t, gen)
        tensors = [t[k] for k in range(kv) for t in per_layer]  # K of every layer, then V
        page = heads * head_dim * tensors[0].element_size() * tpb
        return sglang_layout_from_buffers(
            [t.data_ptr() for t in tensors], [t.numel() * t.element_size() for t in tensors], [page] * len(tensors),
            tpb, heads, 1 if mla else total_heads, dtype, is_mla=mla, tp_rank=tp_rank, tp_size=tp_size,
            tensors=tensors,
        )
    if engine == "trtllm":
        pool = torch.empty(num_blocks, layers, 1 if mla else 2, heads * tpb * head_dim, dtype=store, device=device)
        if gen is not None:
            _fill(pool, gen)
        return trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=heads, dtype=dtype,
                                  total_heads=None if mla else total_heads, tp_rank=0 if mla else tp_rank,
                                  tp_size=1 if mla else tp_size)
    if engine == "vllm":
        if dtype_itemsize(dtype) == 1:
            raise LayoutError("vLLM's CPU fp8 KV cache is not supported")
        if mla:
            one = torch.empty(layers, num_blocks, 1, tpb, head_dim, dtype=store, device=device)
            if gen is not None:
                _fill(one, gen)
            return vllm_cpu_mla_layout(list(one.unbind(0)), dtype=dtype)
        one = torch.empty(layers, num_blocks, heads, tpb, 2 * head_dim, dtype=store, device=device)
        if gen is not None:
            _fill(one, gen)
        return vllm_cpu_layout(list(one.unbind(0)), dtype=dtype, total_heads=total_heads, tp_rank=tp_rank,
                               tp_size=tp_size, isa=isa)
    raise LayoutError(f"unknown engine format {engine!r}; known: 'sglang', 'trtllm', 'vllm'")
