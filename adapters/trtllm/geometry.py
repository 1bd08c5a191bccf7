"""KV geometry of a TensorRT-LLM rank, and which prefill ranks a decode rank pulls from.

TensorRT-LLM's primary pool is ``[num_blocks, layers_in_pool, kv_factor,
heads_per_rank * tokens_per_block * head_dim]``, HND inside a block
(``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager``: ``get_unique_primary_pool()``,
``tokens_per_block``, ``kv_factor``, ``num_kv_heads_per_layer``, ``head_dim``,
``dtype``); kv_factor is 1 for MLA (one latent "head"). The connector worker receives
only the pool tensor (``register_kv_caches``), from ``PyExecutor._maybe_init_kv_connector_manager``,
so the geometry comes from the pool's shape and the executor's own KV cache manager
(``PyExecutor.kv_cache_manager``), never from ``kv_cache_config``: the executor creator
forces ``tokens_per_block`` (64 for MLA with FlashMLA, ``max_num_tokens`` for the VANILLA
attention backend) without updating the config the connector holds. The model's total KV
head count (for the tensor-parallel head split) comes from its Hugging Face config; the
manager's ``total_num_kv_heads_per_layer`` holds per-rank counts. An fp8 pool's scales
come from the model the executor runs (``model_scales``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvbridge.layout import SCALED_DTYPES, KVLayout, LayoutError, tp_head_slice, trtllm_pool_layout

from .config import BridgeConfig, ConfigError

__all__ = ["RankGeometry", "block_order", "model_scales", "pool_layout", "rank_geometry", "pull_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankGeometry:
    """What the pool's shape does not say: tokens per block, the model's KV heads (0 for
    MLA), the head split over ranks, the logical KV dtype ('' = the pool's) and head_dim."""

    tokens_per_block: int
    total_kv_heads: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    dtype: str = ""
    head_dim: int = 0
    token_major: bool = False  # NHD inside a block (VANILLA / FLASHINFER attention backends), else HND


def model_scales(executor: Any, layout: KVLayout) -> KVLayout:
    """``layout`` with the fp8 KV scales of the model ``executor`` runs (other dtypes as
    they are). Each decoder layer's attention module (``_torch/modules/attention.py``:
    ``layer_idx``; its backend ``attn``) keeps one scale for K and V, the TRTLLM backend's
    ``kv_cache_scaling_factor`` (``attention_backend/trtllm.py``: stored = value / scale).
    Raises LayoutError when the model or a layer's scale cannot be found: an fp8 cache
    moves only with its scales."""
    if layout.dtype not in SCALED_DTYPES:
        return layout
    model = getattr(getattr(executor, "model_engine", None), "model", None)
    if model is None:
        raise LayoutError(f"the {layout.dtype} KV cache's scales are unknown: no executor model to read them from")
    found: dict[int, float] = {}
    for m in model.modules():
        factor = getattr(getattr(m, "attn", None), "kv_cache_scaling_factor", None)
        if factor is not None and getattr(m, "layer_idx", None) is not None:
            found[int(m.layer_idx)] = float(torch.as_tensor(factor).reshape(-1)[0])
    want = range(layout.layer_offset, layout.layer_offset + layout.num_layers)
    missing = [i for i in want if i not in found]
    if missing:
        raise LayoutError(f"the {layout.dtype} KV cache's scales are unknown for layer(s) {missing[:8]}: no attention "
                          "module with that layer_idx holds a kv_cache_scaling_factor")
    return layout.with_scales(np.array([found[i] for i in want])[:, None])  # [layers, 1]: K and V share it


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
        return trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=1, dtype=dtype, pool_layers=pool_layers,
                                  token_major=geo.token_major)
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
                              pool_layers=pool_layers, token_major=geo.token_major)


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if obj is None:
            return default
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return default if obj is None else obj


def _mpi_rank() -> int:
    try:
        from tensorrt_llm._utils import mpi_rank
    except ImportError:
        return 0
    return int(mpi_rank())


_DTYPES = {"FP8": "fp8", "HALF": "float16", "BF16": "bfloat16", "FLOAT": "float32", "INT8": "int8"}


def rank_geometry(pool: torch.Tensor, *, manager: Any = None, dist: Any = None, llm_args: Any = None,
                  cfg: BridgeConfig) -> RankGeometry:
    """The geometry of this rank's primary pool ``[blocks, layers, kv_factor, block_size]``
    from the KV cache ``manager`` (``tokens_per_block``, ``head_dim``,
    ``num_kv_heads_per_layer``, ``dtype``), the executor's ``dist`` (``tp_size``,
    ``tp_rank``), the model's config (total KV heads), each overridden by ``cfg``; without
    a manager, tokens per block follow from the pool: ``block_size / (heads x head_dim)``.
    LayoutError naming what disagrees."""
    if pool.dim() != 4:
        raise LayoutError(f"a TensorRT-LLM primary pool is 4-d [blocks, layers, kv_factor, block_size], got {tuple(pool.shape)}")
    if _get(llm_args, "enable_attention_dp", False) or _get(llm_args, "parallel_config.enable_attention_dp", False):
        raise ConfigError("the kvbridge connector does not support attention data parallelism")
    kv_factor, block_size = int(pool.shape[2]), int(pool.shape[3])
    tp = cfg.tp_size or int(_get(dist, "tp_size", 0) or _get(llm_args, "parallel_config.tp_size", 0)
                            or _get(llm_args, "tensor_parallel_size", 1))
    rank = cfg.tp_rank if cfg.tp_rank >= 0 else int(_get(dist, "tp_rank", -1) if dist is not None else -1)
    if rank < 0:
        rank = _mpi_rank() % tp
    model_heads, model_head_dim = _model_kv_geometry(llm_args, mla=kv_factor == 1)
    head_dim = cfg.head_dim or int(_get(manager, "head_dim", 0) or 0) or model_head_dim
    if kv_factor == 1:
        total, per_rank = 0, 1
    else:
        total = cfg.num_kv_heads or model_heads
        mgr_heads = [int(h) for h in (_get(manager, "num_kv_heads_per_layer", None) or []) if int(h) > 0]
        if total:
            per_rank = tp_head_slice(total, tp, rank)[1]
            if mgr_heads and mgr_heads[0] != per_rank:
                raise LayoutError(f"the KV cache manager holds {mgr_heads[0]} KV head(s) per layer on this rank, but "
                                  f"{total} KV heads over tensor-parallel size {tp} give {per_rank}")
        elif mgr_heads and tp == 1:
            total = per_rank = mgr_heads[0]
        else:
            raise LayoutError("the model's KV head count is needed to split heads over ranks (set num_kv_heads)")
    if not head_dim:
        raise LayoutError("head_dim is unknown: neither the KV cache manager nor the model config gives it (set head_dim)")
    tpb = cfg.tokens_per_block or int(_get(manager, "tokens_per_block", 0) or 0)
    if not tpb:
        if block_size % (per_rank * head_dim):
            raise LayoutError(f"pool block_size {block_size} is not a multiple of {per_rank} head(s) x head_dim {head_dim}")
        tpb = block_size // (per_rank * head_dim)
    if per_rank * tpb * head_dim != block_size:
        raise LayoutError(f"pool block_size {block_size} != {per_rank} head(s) x {tpb} tokens per block x head_dim "
                          f"{head_dim}")
    configured = int(_get(llm_args, "kv_cache_config.tokens_per_block", 0) or 0)
    if configured and configured != tpb:
        log.info("kvbridge: the KV cache has %d tokens per block (kv_cache_config says %d; the executor forced it)",
                 tpb, configured)
    dtype = cfg.dtype
    if not dtype:
        name = getattr(_get(manager, "dtype", None), "name", "")
        dtype = _DTYPES.get(name, "")
        if not dtype and pool.dtype == torch.uint8 and "fp8" in str(_get(llm_args, "kv_cache_config.dtype", "")).lower():
            dtype = "fp8"
    return RankGeometry(tokens_per_block=tpb, total_kv_heads=total, tp_size=tp, tp_rank=rank, dtype=dtype,
                        head_dim=head_dim, token_major=block_order(llm_args, cfg) == "NHD")


# Attention backends that address the pool through KVCacheManager.get_buffers, which views a
# layer as [blocks, kv_factor, tokens_per_block, heads, head_dim]: NHD inside a block.
_NHD_BACKENDS = ("VANILLA", "FLASHINFER", "FLASHINFER_STAR_ATTENTION")


def block_order(llm_args: Any, cfg: BridgeConfig) -> str:
    """"HND" or "NHD": the order inside a pool block, from ``cfg.block_order`` or the LLM
    args' ``attn_backend`` (TRTLLM, the default, writes HND)."""
    if cfg.block_order:
        return cfg.block_order
    backend = str(_get(llm_args, "attn_backend", "TRTLLM") or "TRTLLM").upper()
    return "NHD" if backend in _NHD_BACKENDS else "HND"


def model_hf_config(llm_args: Any) -> Any:
    """The served model's Hugging Face config (its text config where it has one), or None."""
    model = _get(llm_args, "model")
    if model is None:
        return None
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(model), trust_remote_code=bool(_get(llm_args, "trust_remote_code", False)))
    except Exception as e:
        log.info("kvbridge: no model config for %s (%s)", model, e)
        return None
    return getattr(hf, "text_config", None) or hf


def _model_kv_geometry(llm_args: Any, mla: bool) -> tuple[int, int]:
    """(KV heads, head_dim) from the model's Hugging Face config (MLA: 1 latent head of
    kv_lora_rank + qk_rope_head_dim), or (0, 0)."""
    hf = model_hf_config(llm_args)
    if hf is None:
        return 0, 0
    if mla or getattr(hf, "kv_lora_rank", None):
        return 1, int(getattr(hf, "kv_lora_rank", 0) or 0) + int(getattr(hf, "qk_rope_head_dim", 0) or 0)
    heads = getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_attention_heads", 0) or 0
    hd = getattr(hf, "head_dim", None) or 0
    if not hd and heads and getattr(hf, "hidden_size", 0) and getattr(hf, "num_attention_heads", 0):
        hd = hf.hidden_size // hf.num_attention_heads
    return int(heads), int(hd)


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
