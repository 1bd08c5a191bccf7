"""Configurations the TensorRT-LLM plugin refuses at start-up, by name.

Each would corrupt KV or strand blocks under load, and TensorRT-LLM itself lets some of
them through. Checked by both halves of the connector when TensorRT-LLM builds them
(``create_py_executor``, every rank; after TensorRT-LLM has applied its own overrides to
``llm_args.kv_cache_config``, so the values read are the effective ones):

- ``kv_cache_config.host_cache_size`` (host offloading): offloading swaps blocks' pool
  offsets (``KVCacheBlock::swapMemoryPoolBlockOffset``), so the block ids a connector is
  handed stop addressing their KV; main refuses it in ``_maybe_init_kv_connector_manager``,
  1.2 does not;
- block reuse off, whatever turned it off (``FORCE_DETERMINISTIC=1``, the FLASHINFER
  attention backends, MLA on a GPU outside SM 90/100/103/120 or with a KV cache quantized
  other than FP8, or ``enable_block_reuse: false``; ``create_py_executor`` turns it off
  with at most a warning): TensorRT-LLM asks a connector for matched tokens only on the
  reuse path (C++ ``WindowBlockManager::addSequence`` with block keys), so a decode would
  never load and every prefill room sent to it would hold its blocks until the deadline;
- main's ``KVCacheManagerV2`` (``kv_cache_config.use_kv_cache_manager_v2``, or the manager
  TensorRT-LLM picked for the model, seen at ``register_kv_caches``): it allocates pages a
  chunk at a time, may honour fewer matched tokens than offered, and can pause and replay
  a request; the plugin assumes none of that.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from .config import ConfigError
from .geometry import _get, model_hf_config

__all__ = ["refuse_unsupported", "refuse_manager"]

FLASHINFER_BACKENDS = ("FLASHINFER", "FLASHINFER_STAR_ATTENTION")


def _reuse_off_cause(llm_args: Any, environ: Mapping[str, str]) -> str:
    """What most likely turned block reuse off (``create_py_executor``'s overrides, in its order)."""
    if environ.get("FORCE_DETERMINISTIC", "0") == "1":
        return "FORCE_DETERMINISTIC=1"
    backend = str(_get(llm_args, "attn_backend", "") or "").upper()
    if backend in FLASHINFER_BACKENDS:
        return f"the {backend} attention backend"
    if getattr(model_hf_config(llm_args), "kv_lora_rank", None):  # MLA
        return ("MLA, on a GPU outside SM 90/100/103/120 or with a KV cache quantized other than FP8 "
                "(or kv_cache_config.enable_block_reuse: false)")
    return "kv_cache_config.enable_block_reuse: false"


def refuse_unsupported(llm_args: Any, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError naming every configuration in ``llm_args`` the plugin cannot serve."""
    env = os.environ if environ is None else environ
    problems = []
    if _get(llm_args, "kv_cache_config.host_cache_size", None):
        problems.append("kv_cache_config.host_cache_size (host offloading) is set: TensorRT-LLM swaps blocks' pool "
                        "offsets when it offloads, so the block ids a connector is given would no longer address "
                        "their KV; unset host_cache_size")
    if not _get(llm_args, "kv_cache_config.enable_block_reuse", True):
        problems.append(f"block reuse is off ({_reuse_off_cause(llm_args, env)}): TensorRT-LLM asks a connector for "
                        "matched tokens only with block reuse on, so this server would never load a handoff and "
                        "every prefill room sent to it would hold its blocks until the deadline")
    if _get(llm_args, "kv_cache_config.use_kv_cache_manager_v2", None):
        problems.append("kv_cache_config.use_kv_cache_manager_v2 is on: KVCacheManagerV2 allocates pages a chunk "
                        "at a time, may honour fewer matched tokens than offered and can pause and replay a "
                        "request, none of which kvbridge supports; set it to false")
    if problems:
        raise ConfigError("kvbridge TensorRT-LLM plugin refuses this configuration: " + "; ".join(problems))


def refuse_manager(kv_cache_manager: Any) -> None:
    """ConfigError when the executor's KV cache manager is one the plugin cannot serve
    (main picks ``KVCacheManagerV2`` per model when ``use_kv_cache_manager_v2`` is unset)."""
    name = type(kv_cache_manager).__name__
    if "V2" in name:
        raise ConfigError(f"kvbridge TensorRT-LLM plugin refuses the executor's {name}: it allocates pages a chunk "
                          "at a time, may honour fewer matched tokens than offered and can pause and replay a "
                          "request; set kv_cache_config.use_kv_cache_manager_v2: false")
    windows, max_seq = getattr(kv_cache_manager, "max_attention_window_vec", None), getattr(kv_cache_manager,
                                                                                         "max_seq_len", None)
    if windows and max_seq:
        short = sorted({int(w) for w in windows if w is not None and int(w) < int(max_seq)})
        if short:
            raise ConfigError(f"kvbridge TensorRT-LLM plugin refuses sliding-window attention (attention window(s) "
                              f"{short} < max_seq_len {int(max_seq)}, kv_cache_config.max_attention_window): "
                              "the pages a window has passed are recycled (main reports them as -1), so a prompt longer "
                              "than the window has no KV to hand off; serve this model without kvbridge")
