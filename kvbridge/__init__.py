"""kvbridge: move a request's KV cache between LLM serving engines of any kind.

Public re-exports; the code lives in ``kvbridge.layout`` (geometry, plans, repack),
``kvbridge.common`` (transfer core) and ``kvbridge.adapters.*`` (engine plugins): the core a
serving process loads. Benchmarks, reports and charts: ``kvbridge.bench``.
"""

from kvbridge.layout import (
    HeadMap,
    KVLayout,
    LayoutError,
    LayoutMismatchError,
    PlanCosts,
    PlanKind,
    TransferPlan,
    plan_transfer,
    repack,
    sglang_layout_from_buffers,
    sglang_mha_layout,
    sglang_mla_layout,
    trtllm_layout_from_geometry,
    trtllm_pool_layout,
)

__version__ = "0.1.0"

__all__ = [
    "HeadMap",
    "KVLayout",
    "LayoutError",
    "LayoutMismatchError",
    "PlanCosts",
    "PlanKind",
    "TransferPlan",
    "plan_transfer",
    "repack",
    "sglang_layout_from_buffers",
    "sglang_mha_layout",
    "sglang_mla_layout",
    "trtllm_layout_from_geometry",
    "trtllm_pool_layout",
    "__version__",
]
