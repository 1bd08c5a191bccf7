"""kvbridge.layout: engine-neutral KV geometry, transfer plans and repack kernels.

Pure: imports torch and numpy (and xxhash, for content digests) only; no engine, no
network, no globals.
"""

from .copyspec import CopySpec, TokenRuns
from .digest import (DIGEST_ALGORITHM, DIGEST_HASHES, MAX_UNITS, TORCH_DIGEST_ALGORITHM, DigestGrid, accepted_algorithms,
                     digest_algorithm_for, first_difference, grid_for, kv_digest)
from .geometry import (SCALED_DTYPES, KVLayout, LayoutError, LayoutMismatchError, Region, canonical_dtype,
                       check_compatible, dtype_itemsize, scale_mismatches)
from .heads import HeadMap, tp_head_slice
from .plan import KindEstimate, PlanCosts, PlanKind, TransferPlan, estimate_plan, plan_transfer, refused_kinds
from .pools import alias_memory, allocate_pool
from .repack import repack
from .segments import Segments, block_ranges, check_segments_inside, coalesce, compile_segments, count_segments
from .sglang_pool import sglang_layout_from_buffers, sglang_mha_layout, sglang_mla_layout
from .trtllm_pool import trtllm_layout_from_geometry, trtllm_pool_layout
from .vllm_pool import (VLLM_CPU_ISAS, vllm_cpu_layout, vllm_cpu_layout_from_geometry, vllm_cpu_mla_layout,
                        vllm_paged_layout)

__all__ = [
    "DIGEST_ALGORITHM",
    "DIGEST_HASHES",
    "TORCH_DIGEST_ALGORITHM",
    "accepted_algorithms",
    "digest_algorithm_for",
    "MAX_UNITS",
    "DigestGrid",
    "first_difference",
    "grid_for",
    "kv_digest",
    "allocate_pool",
    "alias_memory",
    "CopySpec",
    "HeadMap",
    "KVLayout",
    "LayoutError",
    "LayoutMismatchError",
    "KindEstimate",
    "PlanCosts",
    "PlanKind",
    "Region",
    "Segments",
    "TokenRuns",
    "TransferPlan",
    "block_ranges",
    "canonical_dtype",
    "check_compatible",
    "scale_mismatches",
    "SCALED_DTYPES",
    "check_segments_inside",
    "coalesce",
    "compile_segments",
    "count_segments",
    "dtype_itemsize",
    "estimate_plan",
    "plan_transfer",
    "refused_kinds",
    "repack",
    "sglang_layout_from_buffers",
    "sglang_mha_layout",
    "sglang_mla_layout",
    "tp_head_slice",
    "trtllm_layout_from_geometry",
    "trtllm_pool_layout",
    "VLLM_CPU_ISAS",
    "vllm_cpu_layout",
    "vllm_cpu_layout_from_geometry",
    "vllm_cpu_mla_layout",
    "vllm_paged_layout",
]
