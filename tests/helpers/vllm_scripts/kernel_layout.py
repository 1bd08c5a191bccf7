"""Run in the vLLM venv: vLLM's own CPU kernel writes known K/V into a cache tensor of its
backend's shape; kvbridge's layout of that tensor must find every element where the
kernel put it. The 'vec' and 'vec16' kernels (vec16: a head size that is a multiple of
16 but not 32, or a block size that is not a multiple of 32) run on every x86 host; where
the host's backend would pick an ISA kvbridge does not know, it must refuse that ISA by
name. The 'amx' kernel (bfloat16 on AMX hosts, whose blocks interleave tokens and
dimensions) runs on AVX-512 hosts without AMX tiles too, and is checked the same way. Prints one
JSON line: {"<dtype> <isa> bs<block size> hd<head size>": result}."""

import json
import sys

import numpy as np
import torch

import vllm  # noqa: F401  (selects CpuPlatform, loads the _C kernels)
from vllm import _custom_ops as ops
from vllm.platforms import current_platform
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvbridge.layout import CopySpec, LayoutError, allocate_pool, vllm_cpu_layout
from kvbridge.layout.repack import Gather

current_platform.import_kernels()
out = {}
CASES = (("vec", 32, 32), ("vec16", 32, 80), ("vec16", 16, 64), ("vec16", 16, 48))  # (isa, block size, head size)
AMX_CASES = (("amx", 32, 64), ("amx", 64, 128))  # bfloat16 only; the kernel also runs on hosts without AMX tiles
for dtype, (isa, bs, hd) in ([(d, c) for d in (torch.float32, torch.bfloat16) for c in CASES]
                             + [(torch.bfloat16, c) for c in AMX_CASES]):
    nb, nh, layers = 6, 2, 2
    host_isa = _get_attn_isa(dtype, bs, hd)  # what the backend picks on this host
    shape = (nb, nh, bs, 2 * hd)  # what register_kv_caches gets per layer (LBHNC, [B, H, N, 2 * head_size])
    one = torch.zeros((layers,) + tuple(shape), dtype=dtype)
    caches = list(one.unbind(0))
    g = torch.Generator().manual_seed(0)
    n = 2 * bs + 6
    slots = torch.tensor(np.r_[np.arange(3 * bs, 4 * bs), np.arange(1 * bs, 2 * bs), np.arange(5 * bs, 5 * bs + n - 2 * bs)])
    keys, values = [], []
    try:
        for c in caches:  # the backend's own write path (CPUAttentionBackendImpl.do_kv_cache_update)
            k = torch.randn(n, nh, hd, generator=g).to(dtype)
            v = torch.randn(n, nh, hd, generator=g).to(dtype)
            kc, vc = c.view(nb, nh, bs * 2, hd).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
            keys.append(k)
            values.append(v)
    except RuntimeError as e:  # vLLM's build for this host's instruction set has no kernel for it
        out[f"{dtype} {isa} bs{bs} hd{hd}"] = {"isa": isa, "host_isa": host_isa, "ran": False, "why": str(e)[:300]}
        continue
    lay = vllm_cpu_layout(caches, isa=isa)
    # gather the request's rows into an NHD pool (SGLang's order) with kvbridge's kernels
    dst = allocate_pool("sglang", layers=layers, total_heads=nh, head_dim=hd, dtype=str(dtype).split(".")[1],
                        tokens_per_block=1, num_blocks=n + 1)
    spec = CopySpec.build(lay, [3, 1, 5], dst, np.arange(1, n + 1), n)
    staging = torch.empty(spec.nbytes, dtype=torch.uint8)
    Gather(spec).run(staging)
    rows = staging.view(dtype).view(-1, hd)
    # staging is in the destination's address order: K of layer 0, ... (SGLang: per layer K then V)
    want = torch.cat([torch.stack([keys[l], values[l]]).reshape(-1, hd) for l in range(layers)])
    order = np.argsort(np.concatenate([np.asarray(dst.base[l, kv] + np.arange(n)[:, None] * dst.token_stride
                                                  + np.arange(nh)[None, :] * dst.head_stride).reshape(-1)
                                       for l in range(layers) for kv in range(2)]), kind="stable")
    refused = None
    if host_isa != isa:
        try:
            vllm_cpu_layout(caches, isa=host_isa)
        except LayoutError as e:
            refused = str(e)
    out[f"{dtype} {isa} bs{bs} hd{hd}"] = {"isa": isa, "host_isa": host_isa, "ran": True, "refused": refused, "shape": list(shape), "equal": bool(torch.equal(rows, want[order])),
                       "row_strides": [list(p) for p in lay.row_strides], "nonzero_elems": int((one != 0).sum())}

# 'amx' (bfloat16 on AMX hosts): what vLLM's own reshape kernel does, where it runs (also on
# hosts without AMX), is recorded against the formulas docs/vllm.md states (and the engine
# oracle of the tests, tests/helpers/engine_kv.py, uses), element offsets inside one (block, head) K or V tile of block size bs, head size hd:
#   K (t, j): (t // 16) * 16 * hd + (j // 2) * 32 + (t % 16) * 2 + j % 2
#   V (t, j): (j // 16) * 16 * bs + (t // 2) * 32 + (j % 16) * 2 + t % 2
amx = {}
for bs, hd in ((32, 64), (64, 128)):
    cache = torch.zeros(3, 1, bs, 2 * hd, dtype=torch.bfloat16)
    kc, vc = cache.view(3, 1, 2 * bs, hd).chunk(2, dim=2)
    code = torch.arange(bs * hd, dtype=torch.int32).view(bs, 1, hd) + 1  # distinct bit patterns, no NaN
    try:
        ops.cpu_attn_reshape_and_cache(code.to(torch.int16).view(torch.bfloat16),
                                       (code + 16384).to(torch.int16).view(torch.bfloat16), kc, vc,
                                       torch.arange(bs, 2 * bs), "amx")
    except Exception as e:  # vLLM cannot call it on this host
        amx[f"bs{bs} hd{hd}"] = {"ran": False, "why": f"{type(e).__name__}: {e}"[:300]}
        continue
    tile = cache[1, 0].reshape(-1).view(torch.int16).to(torch.int64)
    t, j = np.meshgrid(np.arange(bs), np.arange(hd), indexing="ij")
    k_at = (t // 16) * 16 * hd + (j // 2) * 32 + (t % 16) * 2 + j % 2
    v_at = bs * hd + (j // 16) * 16 * bs + (t // 2) * 32 + (j % 16) * 2 + t % 2
    want = (t * hd + j + 1)
    amx[f"bs{bs} hd{hd}"] = {"ran": True, "k_formula": bool((tile[k_at.reshape(-1)].numpy() == want.reshape(-1)).all()),
                             "v_formula": bool((tile[v_at.reshape(-1)].numpy() == want.reshape(-1) + 16384).all())}
out["amx"] = amx
print(json.dumps(out))
