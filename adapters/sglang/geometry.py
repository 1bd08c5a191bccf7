"""A rank's KV layout from SGLang's KVArgs: dtype, the served model's config, tensors over the pool.

Called by the manager (``manager.KVBridgeKVManager``) when it is built, on both sides.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from sglang.srt.disaggregation.base.conn import KVArgs

from kvbridge.layout import KVLayout, LayoutError, alias_memory, canonical_dtype, sglang_layout_from_buffers

__all__ = ["layout_from_kv_args", "resolve_kv_dtype", "served_model_config", "names_kv_dtype"]

log = logging.getLogger(__name__)


def names_kv_dtype(kv_args: KVArgs, server_args: Any) -> bool:
    """Whether KVArgs or the server arguments name the KV dtype (not 'auto')."""
    for cand in (getattr(kv_args, "kv_cache_dtype_str", None), getattr(server_args, "kv_cache_dtype", None),
                 getattr(server_args, "dtype", None)):
        try:
            if cand is not None and canonical_dtype(cand):
                return True
        except LayoutError:
            continue
    return False


def resolve_kv_dtype(kv_args: KVArgs, server_args: Any = None, model_dtype: Any = None) -> str:
    """The pool's dtype: ``kv_cache_dtype_str`` when it names one ('bfloat16',
    'fp8_e4m3'...), else the model dtype of ``server_args``, else ``model_dtype`` (the
    served model's resolved dtype, for ``--dtype auto``), else raw bytes ('uint8'; the
    layout then counts head_dim in bytes, which moves the same bytes)."""
    for cand in (getattr(kv_args, "kv_cache_dtype_str", None), getattr(server_args, "kv_cache_dtype", None),
                 getattr(server_args, "dtype", None), model_dtype):
        if cand is None:
            continue
        try:
            return canonical_dtype(cand)
        except LayoutError:
            continue
    log.warning("kvbridge: KV dtype %r not resolvable; treating KV as raw bytes",
                getattr(kv_args, "kv_cache_dtype_str", None))
    return "uint8"


def served_model_config(server_args: Any):
    """SGLang's ``ModelConfig`` of the model this server runs (what its scheduler built
    from the same ``server_args``), or None when its config is not on this host (a local
    folder, or a hub model already in the cache): nothing is downloaded here."""
    path = str(getattr(server_args, "model_path", "") or "")
    try:
        if not os.path.isdir(path):
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(path, "config.json"), str):
                return None
        from sglang.srt.configs.model_config import ModelConfig

        return ModelConfig.from_server_args(server_args)
    except Exception as e:
        log.debug("kvbridge: no model config for %r: %s", path, e)
        return None


def _kv_buffers(kv_args: KVArgs) -> tuple[list[int], list[int], list[int]]:
    """The KV pool entries of KVArgs (draft-model entries, appended last, are not moved)."""
    n = len(kv_args.kv_data_ptrs) - int(getattr(kv_args, "num_draft_entries", 0) or 0)
    return list(kv_args.kv_data_ptrs[:n]), list(kv_args.kv_data_lens[:n]), list(kv_args.kv_item_lens[:n])


def layout_from_kv_args(kv_args: KVArgs, *, is_mla: bool, dtype: str, tp_rank: int, tp_size: int,
                        heads: int | None = None, total_heads: int | None = None) -> KVLayout:
    """A rank's KVLayout from SGLang's KVArgs (``kv_data_ptrs/lens/item_lens``,
    ``page_size``, ``kv_head_num``, ``total_kv_head_num``), with tensors aliasing the
    pool memory attached (the sender's repack reads through them)."""
    ptrs, lens, items = _kv_buffers(kv_args)
    heads = heads if heads is not None else getattr(kv_args, "kv_head_num", 1)
    total = total_heads if total_heads is not None else getattr(kv_args, "total_kv_head_num", heads)
    lay = sglang_layout_from_buffers(ptrs, lens, items, kv_args.page_size, heads, total, dtype, is_mla=is_mla,
                                     tp_rank=0 if is_mla else tp_rank, tp_size=None if is_mla else tp_size,
                                     layer_offset=int(getattr(kv_args, "prefill_start_layer", 0) or 0))
    return lay.with_tensors(_alias_regions(lay, getattr(kv_args, "gpu_id", None)))


def _alias_regions(lay: KVLayout, gpu_id: Optional[int]) -> list[torch.Tensor]:
    """uint8 tensors over the layout's regions (no copy), on the pool's device."""
    out = []
    on_gpu = torch.cuda.is_available() and gpu_id is not None and _is_device_ptr(lay.regions[0].addr)
    for r in lay.regions:
        out.append(alias_memory(r.addr, r.nbytes, f"cuda:{gpu_id}" if on_gpu else "cpu"))
    return out


def _is_device_ptr(addr: int) -> bool:
    try:
        attrs = torch.cuda.cudart().cudaPointerGetAttributes(addr)  # type: ignore[attr-defined]
        return int(getattr(attrs, "type", 0)) == 2
    except Exception:  # no runtime binding: assume device memory when CUDA is present
        return True
