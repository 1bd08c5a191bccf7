"""A pure-Python stand-in for the CUDA-only ``sgl_kernel`` package, for CPU test servers.

Why this exists
---------------
SGLang 0.5.23 imports ``sgl_kernel`` unconditionally on several server code
paths, and with ``SGLANG_USE_CPU_ENGINE=1`` some modules ask it for CPU helper
names at import time (``copy_all_layer_kv_cache_cpu`` in
``sglang/kernels/ops/kvcache/cache_move.py``, ``assign_req_to_token_pool_cpu``
in ``sglang/srt/mem_cache/allocation.py``). The only ``sgl_kernel`` on PyPI
(``sglang-kernel``) is a CUDA-only binary wheel and there is no source
package, so a CPU-only test machine cannot install it.

``kvbridge.demo.sglang_server`` puts this ``sgl_shim`` folder on ``PYTHONPATH`` for the
SGLang server processes only (never for the test process itself), so this
module never shadows a real ``sgl_kernel`` anywhere else.

What it provides
----------------
* ``copy_all_layer_kv_cache_cpu`` and ``assign_req_to_token_pool_cpu``:
  small copy helpers, implemented correctly with torch ops (same semantics as
  the native CPU kernels they stand in for).
* Every other public name resolves (so ``from sgl_kernel import X`` works) to a
  stub that raises ``NotImplementedError`` naming itself WHEN CALLED. If a
  server ever reaches one, the test fails loudly instead of computing garbage.
* It registers NO ``torch.ops.sgl_kernel`` operators: SGLang enables its Intel
  AMX CPU backend only when ``torch.ops.sgl_kernel.convert_weight_packed``
  exists, so the torch-native code paths stay selected.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

__version__ = "0.0.0+kvbridge.cpu.shim"

_SHIM_PUBLIC = ("copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu")
# KVBRIDGE_SGL_SHIM_TRACE=1: say on stderr (the server log) when a shim function runs.
_TRACE = os.environ.get("KVBRIDGE_SGL_SHIM_TRACE") == "1"


def _trace(name: str) -> None:
    if _TRACE:
        print(f"[sgl_kernel shim] {name} called (pid {os.getpid()})", file=sys.stderr, flush=True)


def _missing(qualname: str):
    def stub(*args, **kwargs):
        _trace(qualname)
        raise NotImplementedError(
            f"{qualname} is not implemented by the kvbridge CPU test shim of sgl_kernel "
            f"(kvbridge/demo/sgl_shim); SGLang reached a kernel that has no CPU stand-in"
        )

    stub.__name__ = qualname.rsplit(".", 1)[-1]
    stub.__qualname__ = qualname
    return stub


def _module_getattr(module_name: str):
    """A module-level ``__getattr__`` that hands out raising stubs for public names."""

    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _missing(f"{module_name}.{name}")

    return __getattr__


__getattr__ = _module_getattr(__name__)


def _host_rows(ptr: int, rows: int, row_bytes: int) -> torch.Tensor:
    """A uint8 [rows, row_bytes] view of host memory at address ``ptr`` (no copy)."""
    buf = (ctypes.c_uint8 * (rows * row_bytes)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For each KV buffer b: ``buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]``.

    ``data_ptrs``: base address of each (host) buffer; ``strides``: bytes per slot
    row of each buffer; ``tgt_loc``/``src_loc``: slot indices of equal length.
    All source rows are read before any target row is written, so overlapping
    ``tgt_loc`` and ``src_loc`` are safe (gather, then scatter).
    """
    _trace("copy_all_layer_kv_cache_cpu")
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError("tgt_loc and src_loc must have the same length")
    if data_ptrs.numel() != strides.numel():
        raise ValueError("data_ptrs and strides must have the same length")
    if tgt_loc.numel() == 0 or data_ptrs.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64).reshape(-1)
    src = src_loc.to(torch.int64).reshape(-1)
    if int(tgt.min()) < 0 or int(src.min()) < 0:
        raise IndexError("copy_all_layer_kv_cache_cpu: negative slot index")
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        view = _host_rows(int(ptr) & (2**64 - 1), rows, int(stride))
        view[tgt] = view[src]  # advanced indexing: gathers a copy first


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int | None = None,
    *unused,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[p_i:p_{i+1}]``.

    ``p_i`` is the running sum of ``end_offset[j] - start_offset[j]`` for ``j < i``.
    ``req_to_token`` (int32, [max_reqs, pool_len]) is written in place.
    """
    _trace("assign_req_to_token_pool_cpu")
    if pool_len is not None and req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token has {req_to_token.shape[1]} columns, pool_len={pool_len}")
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n <= 0:
            continue
        req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


__all__ = list(_SHIM_PUBLIC)
