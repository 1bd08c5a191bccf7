"""KV geometry of a TensorRT-LLM rank, and which prefill ranks a decode rank pulls from.

TensorRT-LLM's primary pool is ``[num_blocks, layers_in_pool, kv_factor,
num_kv_heads * tokens_per_block * head_dim]``, HND inside a block
(``tensorrt_llm/_torch/pyexecutor/resource_manager.py`` ``KVCacheManager``:
``get_unique_primary_pool()``, ``tokens_per_block``, ``kv_factor``,
``num_kv_heads_per_layer``, ``head_dim``, ``layer_offsets``). kv_factor is 1 for MLA
(one latent "head"). The connector worker only receives the pool tensor
(``register_kv_caches``), so the parts its shape cannot say (tokens per block, the
model's KV heads, the tensor-parallel split, an fp8 pool stored as bytes) come from the
LLM args or the plugin's settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvbridge.layout import KVLayout, LayoutError, tp_head_slice, trtllm_pool_layout

from .config import BridgeConfig, ConfigError

__all__ = ["RankGeometry", "pool_layout", "geometry_from_llm_args", "layout_from_kv_cache_manager", "pull_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankGeometry:
    """What the pool's shape does not say: tokens per block, the model's KV heads (0 for
    MLA or unknown), the head split over ranks, and the logical KV dtype ('' = the pool's)."""

    tokens_per_block: int
    total_kv_heads: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    dtype: str = ""
    head_dim: int = 0


def pool_layout(pool: torch.Tensor, geo: RankGeometry, pool_layers: Sequence[int] | None = None) -> KVLayout:
    """The KVLayout of one rank's primary pool ``[blocks, layers, kv_factor, block_size]``."""
    if pool.dim() != 4:
        raise LayoutError(f"a TensorRT-LLM primary pool is 4-d [blocks, layers, kv_factor, block_size], got {tuple(pool.shape)}")
    _, _, kv_factor, block_size = pool.shape
    tpb = geo.tokens_per_block
    if tpb <= 0 or block_size % tpb:
        raise LayoutError(f"block_size {block_size} is not a multiple of tokens_per_block {tpb}")
    dtype = geo.dtype or pool.dtype
    if kv_factor == 1:  # MLA: one latent head, replicated on every rank
        return trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=1, dtype=dtype, pool_layers=pool_layers)
    if geo.total_kv_heads > 0:
        _, heads = tp_head_slice(geo.total_kv_heads, geo.tp_size, geo.tp_rank)
    elif geo.head_dim > 0:
        heads = block_size // (tpb * geo.head_dim)
        if geo.tp_size > 1:
            raise LayoutError("with tensor parallelism the model's KV head count is needed (num_kv_heads)")
    else:
        raise LayoutError("the KV head count or head_dim is needed to read an MHA pool")
    if geo.head_dim and heads * tpb * geo.head_dim != block_size:
        raise LayoutError(f"pool block_size {block_size} != {heads} heads x {tpb} tokens x head_dim {geo.head_dim}")
    return trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=heads, dtype=dtype,
                              total_heads=geo.total_kv_heads or None, tp_rank=geo.tp_rank, tp_size=geo.tp_size,
                              pool_layers=pool_layers)


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if obj is None:
            return default
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return default if obj is None else obj


def _mpi_rank() -> int:
    try:  # pragma: no cover - only with TensorRT-LLM
        from tensorrt_llm._utils import mpi_rank

        return int(mpi_rank())
    except Exception:
        return 0


def geometry_from_llm_args(llm_args: Any, cfg: BridgeConfig) -> RankGeometry:
    """Geometry from TensorRT-LLM's LLM args (``kv_cache_config.tokens_per_block`` and
    ``.dtype``, ``parallel_config.tp_size``, the model's config for KV heads and head_dim),
    each overridden by the plugin's settings when set."""
    if _get(llm_args, "enable_attention_dp", False) or _get(llm_args, "parallel_config.enable_attention_dp", False):
        raise ConfigError("the kvbridge connector does not support attention data parallelism")
    tpb = cfg.tokens_per_block or int(_get(llm_args, "kv_cache_config.tokens_per_block", 32))
    tp = cfg.tp_size or int(_get(llm_args, "parallel_config.tp_size", 0) or _get(llm_args, "tensor_parallel_size", 1))
    rank = cfg.tp_rank if cfg.tp_rank >= 0 else _mpi_rank() % tp
    dtype = cfg.dtype
    if not dtype:
        kv_dtype = str(_get(llm_args, "kv_cache_config.dtype", "auto")).lower()
        dtype = "fp8" if "fp8" in kv_dtype else ""
    heads, head_dim = cfg.num_kv_heads, cfg.head_dim
    if not heads:
        heads, hd = _model_kv_heads(llm_args)
        head_dim = head_dim or hd
    return RankGeometry(tokens_per_block=tpb, total_kv_heads=heads, tp_size=tp, tp_rank=rank, dtype=dtype, head_dim=head_dim)


def _model_kv_heads(llm_args: Any) -> tuple[int, int]:
    """(KV heads, head_dim) from the model's Hugging Face config, or (0, 0)."""
    model = _get(llm_args, "model")
    if model is None:
        return 0, 0
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(model), trust_remote_code=bool(_get(llm_args, "trust_remote_code", False)))
    except Exception as e:
        log.info("kvbridge: no model config for %s (%s); set num_kv_heads if the pool is not MLA", model, e)
        return 0, 0
    hf = getattr(hf, "text_config", None) or hf
    heads = getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_attention_heads", 0) or 0
    hd = getattr(hf, "head_dim", None) or 0
    if not hd and heads and getattr(hf, "hidden_size", 0) and getattr(hf, "num_attention_heads", 0):
        hd = hf.hidden_size // hf.num_attention_heads
    return int(heads), int(hd)


def layout_from_kv_cache_manager(mgr: Any, tp_rank: int, tp_size: int, dtype: str = "") -> KVLayout:
    """The KVLayout of a ``KVCacheManager``'s primary pool, from its own geometry
    (``get_unique_primary_pool()``, ``tokens_per_block``, ``kv_factor``,
    ``num_kv_heads_per_layer``, ``total_num_kv_heads_per_layer``, ``head_dim``) and its
    layer-to-pool mapping ``layer_offsets`` {model layer: layer inside the pool}."""
    pool = mgr.get_unique_primary_pool()
    heads_per_layer = [h for h in getattr(mgr, "num_kv_heads_per_layer", []) if h > 0]
    if len(set(heads_per_layer)) > 1:
        raise LayoutError(f"layers with different KV head counts {sorted(set(heads_per_layer))} need one pool each; "
                          "kvbridge moves one pool per rank")
    offsets = dict(getattr(mgr, "layer_offsets", {}) or {})
    pool_layers = [offsets[layer] for layer in sorted(offsets)] if offsets else None
    total = [h for h in getattr(mgr, "total_num_kv_heads_per_layer", []) if h > 0]
    kv_factor = int(getattr(mgr, "kv_factor", pool.shape[2]))
    if kv_factor != pool.shape[2]:
        raise LayoutError(f"the manager says kv_factor {kv_factor} but its pool has {pool.shape[2]}")
    geo = RankGeometry(tokens_per_block=int(mgr.tokens_per_block), total_kv_heads=int(total[0]) if total and kv_factor == 2 else 0,
                       tp_size=tp_size, tp_rank=tp_rank, dtype=dtype, head_dim=int(getattr(mgr, "head_dim", 0) or 0))
    return pool_layout(pool, geo, pool_layers)


@dataclass(frozen=True)
class PullPlan:
    """Which prefill ranks one decode rank asks for a room, and how many decode ranks ask
    each of them (``receivers``, the same for every prefill rank in ``ranks``)."""

    ranks: tuple[int, ...]
    receivers: int


def pull_plan(total_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> PullPlan:
    """The prefill ranks decode rank ``decode_rank`` pulls from (``total_heads`` 1 for MLA).

    Prefill ranks holding the same heads are replicas; each replica is pulled by some
    decode rank (so every prefill rank's handoff ends), and a decode rank pulls exactly
    one replica of each head slice it needs, or several (identical bytes) when there are
    more replicas than decode ranks needing them.
    """
    if not 0 <= decode_rank < decode_tp:
        raise LayoutError(f"decode rank {decode_rank} outside tensor-parallel size {decode_tp}")
    d0, dn = tp_head_slice(total_heads, decode_tp, decode_rank)
    slices: dict[tuple[int, int], list[int]] = {}
    for p in range(prefill_tp):
        slices.setdefault(tp_head_slice(total_heads, prefill_tp, p), []).append(p)
    ranks: list[int] = []
    receivers = set()
    for (p0, pn), replicas in sorted(slices.items()):
        if p0 >= d0 + dn or d0 >= p0 + pn:
            continue
        # decode ranks that need this slice, in rank order; this rank is number i of m
        needers = [d for d in range(decode_tp)
                   if (lambda a, b: a < p0 + pn and p0 < a + b)(*tp_head_slice(total_heads, decode_tp, d))]
        i, m, k = needers.index(decode_rank), len(needers), len(replicas)
        if m >= k:
            if m % k:
                raise LayoutError(f"{m} decode ranks cannot share {k} prefill replicas evenly")
            ranks.append(replicas[i % k])
            receivers.add(m // k)
        else:
            ranks.extend(replicas[j] for j in range(k) if j % m == i)
            receivers.add(1)
    if not ranks:
        raise LayoutError(f"decode rank {decode_rank} shares no heads with any prefill rank")
    if len(receivers) != 1:
        raise LayoutError(f"uneven fan-out {sorted(receivers)} between prefill TP {prefill_tp} and decode TP {decode_tp}")
    return PullPlan(tuple(ranks), receivers.pop())
