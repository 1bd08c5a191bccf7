"""TensorRT-LLM's KV cache manager pool as a KVLayout.

The primary pool is one tensor ``[num_blocks, layers_in_pool, kv_factor, block_size]``
with ``block_size = num_kv_heads * tokens_per_block * head_dim``; inside a block the
order is HND: ``[head][token][dim]``. ``kv_factor`` is 2 (K, V), or 1 for MLA where one
"head" holds ``kv_lora_rank + qk_rope_head_dim``. One pool exists per distinct KV head
count; ``pool_layers`` says which of the pool's layers this layout covers, in model
order (``get_layer_to_pool_mapping()``). Block ids index dimension 0. This module does
not import TensorRT-LLM.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .geometry import KVLayout, LayoutError, Region, canonical_dtype, dtype_itemsize
from .heads import tp_head_slice

__all__ = ["trtllm_pool_layout", "trtllm_layout_from_geometry"]


def trtllm_layout_from_geometry(
    pool_ptr: int,
    num_blocks: int,
    layers_in_pool: int,
    kv_factor: int,
    num_kv_heads: int,
    tokens_per_block: int,
    head_dim: int,
    dtype: Any,
    *,
    total_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    pool_layers: Sequence[int] | None = None,
    layer_offset: int = 0,
    tensor: torch.Tensor | None = None,
    token_major: bool = False,
) -> KVLayout:
    """Layout of a pool given by its address and the KV cache manager's geometry.

    ``num_kv_heads`` are the heads per layer on this rank; ``total_heads`` (default
    ``num_kv_heads * tp_size``, or 1 for MLA) the model's. Inside a block the order is
    HND ``[head][token][dim]`` (the TRTLLM attention backend's), or NHD
    ``[token][head][dim]`` with ``token_major`` (backends that address the pool through
    ``KVCacheManager.get_buffers``: VANILLA, FLASHINFER).
    """
    if kv_factor not in (1, 2):
        raise LayoutError(f"TensorRT-LLM kv_factor must be 1 or 2, got {kv_factor}")
    itemsize = dtype_itemsize(dtype)
    head_bytes = head_dim * itemsize
    block_kv_bytes = num_kv_heads * tokens_per_block * head_bytes
    layer_bytes = kv_factor * block_kv_bytes
    block_stride = layers_in_pool * layer_bytes
    layers = np.asarray(list(range(layers_in_pool)) if pool_layers is None else list(pool_layers), dtype=np.int64)
    if layers.size == 0 or layers.min() < 0 or layers.max() >= layers_in_pool:
        raise LayoutError(f"pool_layers {layers.tolist()} outside the pool's {layers_in_pool} layers")
    if kv_factor == 1 and num_kv_heads != 1:
        raise LayoutError(f"an MLA pool (kv_factor 1) holds one latent head, not {num_kv_heads}")
    total = total_heads if total_heads is not None else (1 if kv_factor == 1 else num_kv_heads * tp_size)
    head_offset = 0
    if kv_factor == 2:
        head_offset, n = tp_head_slice(total, tp_size, tp_rank)
        if n != num_kv_heads:
            raise LayoutError(f"tp_rank {tp_rank} of {tp_size} holds {n} of {total} heads, but the pool has {num_kv_heads}")
    base = pool_ptr + layers[:, None] * layer_bytes + np.arange(kv_factor, dtype=np.int64)[None, :] * block_kv_bytes
    return KVLayout(
        engine="trtllm-mla" if kv_factor == 1 else "trtllm",
        num_layers=int(layers.size),
        kv_factor=kv_factor,
        num_heads=num_kv_heads,
        head_offset=head_offset,
        total_heads=total,
        head_dim=head_dim,
        dtype=canonical_dtype(dtype),
        tokens_per_block=tokens_per_block,
        num_blocks=num_blocks,
        first_block=0,
        block_stride=block_stride,
        token_stride=num_kv_heads * head_bytes if token_major else head_bytes,
        head_stride=head_bytes if token_major else tokens_per_block * head_bytes,
        base=base,
        region_of=np.zeros_like(base),
        regions=(Region(int(pool_ptr), num_blocks * block_stride),),
        layer_offset=layer_offset,
        tensors=(tensor,) if tensor is not None else None,
    )


def trtllm_pool_layout(
    pool: torch.Tensor,
    *,
    tokens_per_block: int,
    num_kv_heads: int,
    head_dim: int | None = None,
    dtype: Any = None,
    total_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    pool_layers: Sequence[int] | None = None,
    layer_offset: int = 0,
    token_major: bool = False,
) -> KVLayout:
    """Layout of a live primary pool tensor ``[num_blocks, layers_in_pool, kv_factor,
    num_kv_heads * tokens_per_block * head_dim]`` (HND inside a block; NHD with ``token_major``).

    ``dtype`` is the logical KV dtype when the pool stores it as raw bytes (fp8 as uint8).
    """
    if pool.dim() != 4 or not pool.is_contiguous():
        raise LayoutError(f"expected a contiguous 4-d pool [blocks, layers, kv_factor, block_size], got {tuple(pool.shape)}")
    num_blocks, layers_in_pool, kv_factor, block_size = pool.shape
    if block_size % (num_kv_heads * tokens_per_block):
        raise LayoutError(
            f"block_size {block_size} is not num_kv_heads {num_kv_heads} x tokens_per_block {tokens_per_block} x head_dim"
        )
    hd = block_size // (num_kv_heads * tokens_per_block)
    if head_dim is not None and head_dim != hd:
        raise LayoutError(f"head_dim {head_dim} does not match the pool's block_size {block_size} (implies {hd})")
    dtype = pool.dtype if dtype is None else dtype
    if dtype_itemsize(dtype) != pool.element_size():
        raise LayoutError(f"dtype {dtype} does not match the pool's {pool.element_size()}-byte elements")
    return trtllm_layout_from_geometry(
        pool.data_ptr(),
        num_blocks,
        layers_in_pool,
        kv_factor,
        num_kv_heads,
        tokens_per_block,
        hd,
        dtype,
        total_heads=total_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pool_layers=pool_layers,
        layer_offset=layer_offset,
        tensor=pool,
        token_major=token_major,
    )
