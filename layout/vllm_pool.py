"""vLLM's paged KV cache as a KVLayout: its GPU backends' logical views
(``vllm_paged_layout``) and the CPU attention backend's 'vec', 'vec16' and 'amx' kernels.

vLLM hands a KV connector one tensor per attention layer (``register_kv_caches``). The
CPU backend (``CPU_ATTN``, ``vllm/v1/attention/backends/cpu_attn.py``,
``get_kv_cache_shape``) shapes it ``[num_blocks, num_kv_heads, block_size, 2 *
head_size]`` and its forward reads it as ``[num_blocks, num_kv_heads, 2 * block_size,
head_size]`` cut in two along dim 2: inside one (block, head), the first ``block_size *
head_size`` elements are K, the next ``block_size * head_size`` are V. The kernels of the
'vec' ISA (``csrc/cpu/cpu_attn_vec.hpp``, ``reshape_and_cache``) write V row-major,
``[block_size, head_size]``, and K column-major: element (token ``t``, dim ``j``) at
``j * block_size + t``. So a K head row is ``head_size`` elements ``block_size`` apart
(``KVLayout.row_strides``). Block 0 is vLLM's null block; valid ids start at 1. In vLLM
0.32 the per-layer tensors are views into one allocation, layer after layer.

The 'vec16' ISA (picked for a head size that is a multiple of 16 but not of 32, e.g. 80,
or a block size that is not a multiple of 32) lays a block out the same way: checked
element by element against vLLM's own ``cpu_attn_reshape_and_cache`` for float32 and
bfloat16 (tests/helpers/vllm_scripts/kernel_layout.py). The 'amx' ISA (bfloat16, block
size a multiple of 32, on hosts with AMX tiles) interleaves tokens and dimensions inside
each K and V tile; its offsets are mixed-radix in tokens and in dimensions
(``_amx_row_strides``), checked the same way. Other ISAs ('neon', ...) are refused by
name, as are fp8 KV caches (another writer).

MLA: the CPU MLA backend (``CPU_MLA``, ``vllm/v1/attention/backends/mla/cpu_mla.py``;
head size 576 = kv_lora_rank 512 + rope 64, block size 16 only) hands each layer a
contiguous ``[num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]``: one latent
row per token, rows contiguous (``vllm_cpu_mla_layout``, kv_factor 1). This module does
not import vLLM.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .geometry import KVLayout, LayoutError, Region, canonical_dtype, dtype_itemsize
from .heads import tp_head_slice

__all__ = ["VLLM_CPU_ISAS", "vllm_cpu_layout", "vllm_cpu_layout_from_geometry", "vllm_cpu_mla_layout", "vllm_paged_layout"]

VLLM_CPU_ISAS = ("vec", "vec16", "amx")  # the CPU backend's kernels whose block layout kvbridge knows


def _amx_row_strides(block_size: int, head_size: int, isz: int) -> tuple:
    """'amx' tiles of one (block, head), in bytes: K (token t, dim j) at ``(t // 16) * 16 *
    head_size + (j // 2) * 32 + (t % 16) * 2 + j % 2`` elements, V at ``(j // 16) * 16 *
    block_size + (t // 2) * 32 + (j % 16) * 2 + t % 2`` (checked against vLLM's own
    ``cpu_attn_reshape_and_cache``, tests/helpers/vllm_scripts/kernel_layout.py)."""
    e = isz
    k = (((block_size // 16, 16 * head_size * e), (16, 2 * e)), ((head_size // 2, 32 * e), (2, e)))
    v = (((block_size // 2, 32 * e), (2, e)), ((head_size // 16, 16 * block_size * e), (16, 2 * e)))
    return (k, v)


def vllm_cpu_layout_from_geometry(
    layer_ptrs: Sequence[int],
    layer_nbytes: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: Any,
    *,
    isa: str = "vec",
    total_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_offset: int = 0,
    tensors: Sequence[torch.Tensor] | None = None,
) -> KVLayout:
    """Layout of vLLM's CPU KV cache from each layer tensor's address and the geometry.

    ``num_kv_heads`` are the heads on this rank; ``total_heads`` (default ``num_kv_heads
    * tp_size``) the model's. Raises LayoutError naming an ISA or a size it cannot describe.
    """
    if isa not in VLLM_CPU_ISAS:
        raise LayoutError(f"vLLM CPU attention ISA {isa!r} is not supported (its block layout differs); "
                          f"kvbridge handles {list(VLLM_CPU_ISAS)}")
    isz = dtype_itemsize(dtype)
    if isz == 1:
        raise LayoutError("vLLM's CPU fp8 KV cache is written by other kernels; only float32/bfloat16/float16 are supported")
    if isa == "amx" and (canonical_dtype(dtype) != "bfloat16" or block_size % 32 or head_size % 16):
        raise LayoutError(f"vLLM's 'amx' ISA lays out bfloat16 caches of block sizes that are multiples of 32 and "
                          f"head sizes that are multiples of 16; got {canonical_dtype(dtype)}, block size "
                          f"{block_size}, head size {head_size}")
    ptrs = np.asarray([int(p) for p in layer_ptrs], dtype=np.int64)
    if ptrs.size == 0:
        raise LayoutError("vLLM KV cache: no layer tensors")
    tile = block_size * head_size * isz  # one K (or V) of one (block, head)
    head_stride = 2 * tile
    block_stride = num_kv_heads * head_stride
    if layer_nbytes != num_blocks * block_stride:
        raise LayoutError(f"vLLM KV cache: a layer of {layer_nbytes} B is not {num_blocks} blocks x {num_kv_heads} heads "
                          f"x 2 x {block_size} tokens x {head_size} x {isz} B")
    total = total_heads if total_heads is not None else num_kv_heads * tp_size
    head_offset, n = tp_head_slice(total, tp_size, tp_rank)
    if n != num_kv_heads:
        raise LayoutError(f"tp_rank {tp_rank} of {tp_size} holds {n} of {total} KV heads, but the cache has {num_kv_heads}")
    base = np.stack([ptrs, ptrs + tile], axis=1)  # K then V inside each (block, head)
    return KVLayout(
        engine="vllm-cpu-amx" if isa == "amx" else "vllm-cpu",
        num_layers=int(ptrs.size),
        kv_factor=2,
        num_heads=num_kv_heads,
        head_offset=head_offset,
        total_heads=total,
        head_dim=head_size,
        dtype=canonical_dtype(dtype),
        tokens_per_block=block_size,
        num_blocks=num_blocks,
        first_block=1,
        block_stride=block_stride,
        token_stride=(2 if isa == "amx" else head_size) * isz,  # V's innermost; every K/V's is in row_strides
        head_stride=head_stride,
        base=base,
        region_of=np.repeat(np.arange(ptrs.size, dtype=np.int64)[:, None], 2, axis=1),
        regions=tuple(Region(int(p), int(layer_nbytes)) for p in ptrs),
        layer_offset=layer_offset,
        tensors=tuple(tensors) if tensors is not None else None,
        row_strides=(_amx_row_strides(block_size, head_size, isz) if isa == "amx"
                     else ((isz, block_size * isz), (head_size * isz, isz))),
    )


def vllm_cpu_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    isa: str = "vec",
    dtype: Any = None,
    total_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_offset: int = 0,
) -> KVLayout:
    """Layout of the per-layer tensors vLLM's CPU backend hands ``register_kv_caches``
    (in model layer order), each ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
    and contiguous; their tensors are attached."""
    if not kv_caches:
        raise LayoutError("vLLM KV cache: no layer tensors")
    t0 = kv_caches[0]
    for t in kv_caches:
        if t.dim() != 4 or tuple(t.shape) != tuple(t0.shape) or t.dtype != t0.dtype or not t.is_contiguous():
            raise LayoutError(f"vLLM CPU KV cache tensors must all be contiguous [num_blocks, num_kv_heads, block_size, "
                              f"2 * head_size] of one dtype, got {tuple(t.shape)} {t.dtype} "
                              f"(contiguous: {t.is_contiguous()}) beside {tuple(t0.shape)} {t0.dtype}")
    num_blocks, heads, block_size, two_hd = t0.shape
    if two_hd % 2:
        raise LayoutError(f"vLLM CPU KV cache: last dimension {two_hd} is not 2 * head_size")
    return vllm_cpu_layout_from_geometry(
        [t.data_ptr() for t in kv_caches], t0.numel() * t0.element_size(), int(num_blocks), int(heads), int(block_size),
        int(two_hd) // 2, dtype if dtype is not None else t0.dtype, isa=isa, total_heads=total_heads, tp_rank=tp_rank,
        tp_size=tp_size, layer_offset=layer_offset, tensors=kv_caches)


def vllm_cpu_mla_layout(kv_caches: Sequence[torch.Tensor], *, dtype: Any = None, layer_offset: int = 0) -> KVLayout:
    """Layout of the per-layer tensors vLLM's CPU MLA backend hands ``register_kv_caches``
    (model layer order), each contiguous ``[num_blocks, 1, block_size, latent]`` (or
    ``[num_blocks, block_size, latent]``); one latent "head" replicated on every TP rank."""
    if not kv_caches:
        raise LayoutError("vLLM KV cache: no layer tensors")
    t0 = kv_caches[0]
    shape = tuple(t0.shape)
    if len(shape) == 4 and shape[1] == 1:
        shape = (shape[0], shape[2], shape[3])
    if len(shape) != 3:
        raise LayoutError(f"vLLM CPU MLA cache must be [num_blocks, 1, block_size, latent], got {tuple(t0.shape)}")
    for t in kv_caches:
        if tuple(t.shape) != tuple(t0.shape) or t.dtype != t0.dtype or not t.is_contiguous():
            raise LayoutError(f"vLLM CPU MLA cache tensors must be alike and contiguous, got {tuple(t.shape)} {t.dtype} "
                              f"beside {tuple(t0.shape)} {t0.dtype}")
    num_blocks, block_size, latent = (int(x) for x in shape)
    dt = dtype if dtype is not None else t0.dtype
    isz = dtype_itemsize(dt)
    if isz == 1:
        raise LayoutError("vLLM's CPU fp8 KV cache is not supported")
    row = latent * isz
    ptrs = np.asarray([t.data_ptr() for t in kv_caches], dtype=np.int64)
    nbytes = num_blocks * block_size * row
    return KVLayout(
        engine="vllm-mla", num_layers=int(ptrs.size), kv_factor=1, num_heads=1, head_offset=0, total_heads=1,
        head_dim=latent, dtype=canonical_dtype(dt), tokens_per_block=block_size, num_blocks=num_blocks, first_block=1,
        block_stride=block_size * row, token_stride=row, head_stride=row, base=ptrs[:, None].copy(),
        region_of=np.arange(ptrs.size, dtype=np.int64)[:, None], regions=tuple(Region(int(p), nbytes) for p in ptrs),
        layer_offset=layer_offset, tensors=tuple(kv_caches))


def vllm_paged_layout(kv_caches: Sequence[torch.Tensor], *, head_size: int, head_size_v: int | None = None,
                      total_heads: int | None = None, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                      dtype: Any = None, layer_offset: int = 0) -> KVLayout:
    """Layout of vLLM's logical KV cache views: what every GPU attention backend of vLLM
    0.32 gets per layer (``vllm/v1/kv_cache_interface.py``, ``create_kv_cache_views``).

    ``kv_caches[l]``: layer ``l``'s ``[B, H, N, C]`` view (blocks, KV heads on this rank,
    tokens per block, content elements), any of the six stride orders of
    ``KVCacheLayout`` (layer-compact ``L...`` orders or block-outermost ``B...`` ones,
    whose one block holds every layer). ``C`` is ``head_size`` K elements then
    ``head_size_v`` V elements of one (block, head, token) (FLASH_ATTN and the other
    backends split it so: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); with
    ``mla``, ``C`` is one latent row (``head_size`` = kv_lora_rank + rope), kv_factor 1.
    Strides come from the views themselves, so any order vLLM lays out is described as it
    is. Block 0 is vLLM's null block. LayoutError when the views are not alike, ``C`` is
    not contiguous, or K and V rows differ in size.

    Example (LBNHC: tokens outside heads inside a block; two layers in one allocation)::

        >>> raw = torch.zeros(2 * 8 * 16 * 4 * 2 * 64, dtype=torch.bfloat16)
        >>> v = raw.view(2, 8, 16, 4, 128).permute(0, 1, 3, 2, 4)  # logical [L, B, H, N, C]
        >>> lay = vllm_paged_layout(list(v.unbind(0)), head_size=64, total_heads=4)
        >>> (lay.token_stride, lay.head_stride, lay.is_head_major)
        (1024, 256, False)
    """
    if not kv_caches:
        raise LayoutError("vLLM KV cache: no layer views")
    t0 = kv_caches[0]
    if t0.dim() != 4:
        raise LayoutError(f"a vLLM KV cache view is [blocks, heads, tokens, content], got {tuple(t0.shape)}")
    for t in kv_caches:
        if tuple(t.shape) != tuple(t0.shape) or t.stride() != t0.stride() or t.dtype != t0.dtype:
            raise LayoutError(f"vLLM KV cache views differ: {tuple(t.shape)} strides {t.stride()} {t.dtype} beside "
                              f"{tuple(t0.shape)} strides {t0.stride()} {t0.dtype}")
    num_blocks, heads, tokens, content = (int(x) for x in t0.shape)
    hv = 0 if mla else (head_size if head_size_v is None else int(head_size_v))
    if not mla and hv != head_size:
        raise LayoutError(f"vLLM KV cache with K rows of {head_size} and V rows of {hv} elements: kvbridge moves "
                          "K and V of one head size")
    if content != head_size + hv:
        raise LayoutError(f"vLLM KV cache content is {content} elements, expected {head_size} + {hv}")
    if t0.stride(3) != 1:
        raise LayoutError(f"vLLM KV cache content is not contiguous (stride {t0.stride(3)})")
    if mla and heads != 1:
        raise LayoutError(f"a vLLM MLA cache has one latent head, got {heads}")
    dt = dtype if dtype is not None else t0.dtype
    isz = t0.element_size()
    if dtype_itemsize(dt) != isz:
        raise LayoutError(f"dtype {dt} does not match the cache's {isz}-byte elements")
    if mla:
        total, first = 1, 0
    else:
        total = int(total_heads or heads * tp_size)
        first, count = tp_head_slice(total, tp_size, tp_rank)
        if count != heads:
            raise LayoutError(f"{total} KV heads over tensor-parallel size {tp_size} give rank {tp_rank} {count} "
                              f"head(s); its cache holds {heads}")
    ptrs = np.asarray([t.data_ptr() for t in kv_caches], dtype=np.int64)
    kv = 1 if mla else 2
    base = ptrs[:, None] + np.arange(kv, dtype=np.int64)[None, :] * head_size * isz
    # one region per backing allocation (a block-outermost order interleaves the layers in one)
    storages: dict[int, torch.Tensor] = {}  # storage address -> its bytes
    region_of = np.empty((ptrs.size, kv), dtype=np.int64)
    for i, t in enumerate(kv_caches):
        st = t.untyped_storage()
        if st.data_ptr() not in storages:
            storages[st.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),))
        region_of[i, :] = list(storages).index(st.data_ptr())
    regions = tuple(Region(int(b.data_ptr()), int(b.numel())) for b in storages.values())
    return KVLayout(
        engine="vllm-mla" if mla else "vllm", num_layers=int(ptrs.size), kv_factor=kv, num_heads=heads,
        head_offset=first, total_heads=total, head_dim=head_size, dtype=canonical_dtype(dt), tokens_per_block=tokens,
        num_blocks=num_blocks, first_block=1, block_stride=t0.stride(0) * isz, token_stride=t0.stride(2) * isz,
        head_stride=t0.stride(1) * isz, base=base, region_of=region_of, regions=regions,
        layer_offset=layer_offset, tensors=tuple(storages.values()))
