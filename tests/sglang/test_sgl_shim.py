"""The pure-Python sgl_kernel stand-in (demo/sgl_shim, shipped in kvbridge.demo) that CPU SGLang servers import.

Loaded under another module name, so this test process never gets an
``sgl_kernel`` in sys.modules.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SHIM = Path(__file__).resolve().parents[2] / "demo" / "sgl_shim" / "sgl_kernel" / "__init__.py"


@pytest.fixture(scope="module")
def shim():
    spec = importlib.util.spec_from_file_location("kvbridge_tests_sgl_kernel_shim", SHIM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_assign_req_to_token_pool_cpu(shim):
    req_to_token = torch.zeros((5, 32), dtype=torch.int32)
    expect = req_to_token.clone()
    req_pool_indices = torch.tensor([2, 4, 1], dtype=torch.int64)
    start = torch.tensor([0, 3, 8], dtype=torch.int32)
    end = torch.tensor([6, 3, 15], dtype=torch.int32)
    loc = torch.randperm(4096, dtype=torch.int64)[:13]
    shim.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, loc, 32)
    expect[2, 0:6] = loc[0:6].int()
    expect[1, 8:15] = loc[6:13].int()
    assert torch.equal(req_to_token, expect)
    with pytest.raises(ValueError):
        shim.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, loc, 31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_copy_all_layer_kv_cache_cpu(shim, dtype):
    g = torch.Generator().manual_seed(0)
    # 3 layers x K/V, rows of different widths, like per-layer K and V buffers
    bufs = [(torch.randn((40, 2, w), generator=g) * 50).to(dtype) for w in (8, 8, 4, 4, 16, 16)]
    expect = [b.clone() for b in bufs]
    src = torch.tensor([3, 4, 5, 10], dtype=torch.int64)
    tgt = torch.tensor([4, 5, 6, 39], dtype=torch.int64)  # overlaps src: must gather first
    for e in expect:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(bufs, expect):
        assert torch.equal(b, e)
    # no-op on empty
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt[:0], src[:0])
    for b, e in zip(bufs, expect):
        assert torch.equal(b, e)


def test_other_names_raise_when_called_not_when_imported(shim):
    fn = shim.silu_and_mul  # resolving the name works (import-time `from sgl_kernel import x`)
    with pytest.raises(NotImplementedError, match="silu_and_mul"):
        fn(torch.zeros(2))
    with pytest.raises(AttributeError):
        shim.__wrapped__  # dunders stay absent, so hasattr() probes behave
    # the AMX CPU backend must stay off: no torch.ops.sgl_kernel operators
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
