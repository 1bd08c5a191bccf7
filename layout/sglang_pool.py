"""SGLang's token pools as KVLayouts.

``MHATokenToKVPool`` (NHD): per layer, K and V each a tensor ``[slots, heads, head_dim]``
with ``slot = page * page_size + token``; slot 0 / page 0 is padding, so valid page ids
start at 1. ``MLATokenToKVPool``: per layer one tensor ``[slots, 1, kv_lora_rank +
qk_rope_head_dim]`` (kv_factor 1). fp8 KV is stored as uint8. SGLang hands a transfer
backend the same memory as ``kv_data_ptrs`` (K of every layer, then V of every layer;
one entry per layer for MLA), ``kv_data_lens`` and ``kv_item_lens`` (bytes of one page).
The pools are read by attribute (duck typing): this module does not import SGLang.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .geometry import KVLayout, LayoutError, Region, canonical_dtype, dtype_itemsize
from .heads import tp_head_slice

__all__ = ["sglang_layout_from_buffers", "sglang_mha_layout", "sglang_mla_layout"]


def sglang_layout_from_buffers(
    kv_data_ptrs: Sequence[int],
    kv_data_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    page_size: int,
    kv_head_num: int,
    total_kv_head_num: int,
    dtype: Any,
    *,
    is_mla: bool = False,
    tp_rank: int = 0,
    tp_size: int | None = None,
    layer_offset: int = 0,
    tensors: Sequence[torch.Tensor] | None = None,
) -> KVLayout:
    """Layout of an SGLang pool from what SGLang gives a transfer backend (``KVArgs``).

    ``dtype`` is the logical KV dtype (``'bfloat16'``, ``'fp8_e4m3'``, a torch dtype);
    ``kv_head_num`` the heads on this rank, ``total_kv_head_num`` the model's. The
    rank's global head offset follows from ``tp_rank`` of ``tp_size`` (default: the
    split ``total_kv_head_num / kv_head_num``). Every buffer is checked to be a whole
    number of pages of the implied head_dim.
    """
    ptrs, lens, items = (list(map(int, x)) for x in (kv_data_ptrs, kv_data_lens, kv_item_lens))
    if not (len(ptrs) == len(lens) == len(items)) or not ptrs:
        raise LayoutError(
            f"kv_data_ptrs/lens/item_lens must be equally long and non-empty, got {len(ptrs)}/{len(lens)}/{len(items)}"
        )
    kv_factor = 1 if is_mla else 2
    if len(ptrs) % kv_factor:
        raise LayoutError(f"{len(ptrs)} KV buffers cannot be split into K and V halves")
    num_layers = len(ptrs) // kv_factor
    heads = 1 if is_mla else int(kv_head_num)
    total = 1 if is_mla else int(total_kv_head_num)
    itemsize = dtype_itemsize(dtype)
    if len(set(items)) != 1:
        raise LayoutError(f"kv_item_lens differ between buffers: {sorted(set(items))}")
    page_bytes = items[0]
    if page_size <= 0 or page_bytes % (page_size * heads * itemsize):
        raise LayoutError(
            f"item_len {page_bytes} B is not page_size {page_size} x {heads} heads x a whole head_dim of {itemsize}-byte items"
        )
    head_dim = page_bytes // (page_size * heads * itemsize)
    if any(n % page_bytes for n in lens):
        raise LayoutError(f"kv_data_lens {sorted(set(lens))} are not whole pages of {page_bytes} B")
    num_pages = min(lens) // page_bytes
    if is_mla:
        head_offset = 0
    else:
        if tp_size is None:
            tp_size = max(1, total // heads)
        head_offset, n = tp_head_slice(total, tp_size, tp_rank)
        if n != heads:
            raise LayoutError(f"tp_rank {tp_rank} of {tp_size} holds {n} of {total} heads, but the pool has {heads}")
    # SGLang order: K_l0..K_lN-1 then V_l0..V_lN-1 -> base[layer, kv]
    base = np.asarray(ptrs, dtype=np.int64).reshape(kv_factor, num_layers).T.copy()
    region_of = np.arange(len(ptrs), dtype=np.int64).reshape(kv_factor, num_layers).T.copy()
    head_bytes = head_dim * itemsize
    return KVLayout(
        engine="sglang-mla" if is_mla else "sglang-mha",
        num_layers=num_layers,
        kv_factor=kv_factor,
        num_heads=heads,
        head_offset=head_offset,
        total_heads=total,
        head_dim=head_dim,
        dtype=canonical_dtype(dtype),
        tokens_per_block=int(page_size),
        num_blocks=num_pages,
        first_block=1,
        block_stride=page_bytes,
        token_stride=heads * head_bytes,
        head_stride=head_bytes,
        base=base,
        region_of=region_of,
        regions=tuple(Region(p, n) for p, n in zip(ptrs, lens)),
        layer_offset=layer_offset,
        tensors=tuple(tensors) if tensors is not None else None,
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise LayoutError("SGLang KV buffers must be contiguous")
    return t


def sglang_mha_layout(pool: Any, *, tp_rank: int = 0, tp_size: int = 1, total_heads: int | None = None) -> KVLayout:
    """Layout of a live ``MHATokenToKVPool`` (NHD), with its tensors attached.

    ``k_buffer[l]`` / ``v_buffer[l]``: ``[size + page_size, head_num, head_dim]``.
    ``total_heads`` defaults to ``head_num * tp_size``.
    """
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        raise LayoutError(f"K head_dim {pool.head_dim} != V head_dim {pool.v_head_dim} is not supported")
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        raise LayoutError(f"SGLang pool layout {pool.kv_cache_layout!r}: only NHD can be transferred")
    tensors = [_flat(t) for t in list(pool.k_buffer) + list(pool.v_buffer)]
    total = total_heads if total_heads is not None else pool.head_num * tp_size
    return sglang_layout_from_buffers(
        [t.data_ptr() for t in tensors],
        [t.numel() * t.element_size() for t in tensors],
        [pool.page_size * t[0].numel() * t.element_size() for t in tensors],
        pool.page_size,
        pool.head_num,
        total,
        pool.dtype,
        tp_rank=tp_rank,
        tp_size=tp_size,
        layer_offset=getattr(pool, "start_layer", 0) or 0,
        tensors=tensors,
    )


def sglang_mla_layout(pool: Any) -> KVLayout:
    """Layout of a live ``MLATokenToKVPool``: ``kv_buffer[l]``: ``[size + page_size, 1,
    kv_lora_rank + qk_rope_head_dim]``, one latent "head" replicated on every TP rank."""
    tensors = [_flat(t) for t in pool.kv_buffer]
    return sglang_layout_from_buffers(
        [t.data_ptr() for t in tensors],
        [t.numel() * t.element_size() for t in tensors],
        [pool.page_size * t[0].numel() * t.element_size() for t in tensors],
        pool.page_size,
        1,
        1,
        pool.dtype,
        is_mla=True,
        layer_offset=getattr(pool, "start_layer", 0) or 0,
        tensors=tensors,
    )
