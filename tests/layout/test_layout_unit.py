"""Unit tests of the layout core: constructors, errors, head maps, coalescing, plan choice."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.layout import (
    HeadMap,
    KVLayout,
    LayoutError,
    LayoutMismatchError,
    PlanKind,
    block_ranges,
    check_segments_inside,
    plan_transfer,
    sglang_layout_from_buffers,
    sglang_mha_layout,
    sglang_mla_layout,
    tp_head_slice,
    trtllm_layout_from_geometry,
    trtllm_pool_layout,
)


def fake_sglang(layers=2, heads=2, head_dim=8, page=16, pages=10, dtype="bf16", tp_rank=0, tp_size=1, total=None):
    """An SGLang-geometry layout over made-up addresses (planning needs no memory)."""
    item = 1 if "fp8" in dtype else 2
    page_bytes = page * heads * head_dim * item
    ptrs = [0x10_0000_0000 + i * (1 << 24) for i in range(2 * layers)]
    return sglang_layout_from_buffers(ptrs, [pages * page_bytes] * (2 * layers), [page_bytes] * (2 * layers), page, heads,
                                      total or heads * tp_size, dtype, tp_rank=tp_rank, tp_size=tp_size)


def fake_trtllm(layers=2, heads=2, head_dim=8, tpb=32, blocks=10, dtype="bf16", **kw):
    return trtllm_layout_from_geometry(0x20_0000_0000, blocks, layers, 2, heads, tpb, head_dim, dtype, **kw)


def test_sglang_layout_from_kvargs_matches_live_pool(sglang_pools):
    MHA, MLA = sglang_pools
    pool = MHA(size=96, page_size=16, dtype=torch.float8_e4m3fn, head_num=2, head_dim=8, layer_num=3, device="cpu",
               enable_memory_saver=False)
    live = sglang_mha_layout(pool, tp_rank=1, tp_size=2)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    args = sglang_layout_from_buffers(ptrs, lens, items, 16, 2, 4, "fp8_e4m3", tp_rank=1, tp_size=2)
    assert args.describe() == live.describe()
    assert (live.num_layers, live.kv_factor, live.num_heads, live.head_offset, live.head_dim) == (3, 2, 2, 2, 8)
    assert (live.dtype, live.itemsize, live.tokens_per_block, live.first_block, live.num_blocks) == ("float8_e4m3fn", 1, 16, 1, 7)
    assert live.base[0, 1] == pool.v_buffer[0].data_ptr() and live.base[2, 0] == pool.k_buffer[2].data_ptr()
    mla = sglang_mla_layout(MLA(size=64, page_size=1, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
                                layer_num=2, device="cpu", enable_memory_saver=False))
    assert (mla.kv_factor, mla.num_heads, mla.head_dim, mla.num_blocks, mla.engine) == (1, 1, 24, 65, "sglang-mla")


def test_trtllm_pool_geometry_is_hnd_and_rejects_bad_shapes():
    pool = torch.zeros(6, 4, 2, 2 * 32 * 8, dtype=torch.bfloat16)
    lay = trtllm_pool_layout(pool, tokens_per_block=32, num_kv_heads=2, pool_layers=[1, 3], layer_offset=5)
    assert lay.is_head_major and lay.layers_inside_blocks
    assert (lay.num_layers, lay.head_dim, lay.token_stride, lay.head_stride) == (2, 8, 16, 32 * 16)
    assert lay.base[1, 1] == pool.data_ptr() + 3 * 2 * 2 * 32 * 8 * 2 + 2 * 32 * 8 * 2
    assert lay.block_stride == 4 * 2 * 2 * 32 * 8 * 2
    with pytest.raises(LayoutError, match="block_size"):
        trtllm_pool_layout(pool, tokens_per_block=24, num_kv_heads=2)
    with pytest.raises(LayoutError, match="does not match the pool"):
        trtllm_pool_layout(pool, tokens_per_block=32, num_kv_heads=2, dtype="fp8")
    with pytest.raises(LayoutError, match="pool_layers"):
        trtllm_pool_layout(pool, tokens_per_block=32, num_kv_heads=2, pool_layers=[4])
    mla = trtllm_pool_layout(torch.zeros(3, 2, 1, 32 * 576, dtype=torch.uint8), tokens_per_block=32, num_kv_heads=1, dtype="fp8")
    assert (mla.kv_factor, mla.head_dim, mla.engine) == (1, 576, "trtllm-mla")


def test_incompatible_layouts_name_every_mismatch():
    a = fake_sglang(layers=2, head_dim=8, dtype="bf16")
    b = fake_trtllm(layers=3, head_dim=16, dtype="fp8", heads=4)
    with pytest.raises(LayoutMismatchError) as e:
        plan_transfer(a, [1], b, [0], 4)
    msg = str(e.value)
    for field in ("num_layers", "total_heads", "head_dim", "dtype"):
        assert field in msg
    assert len(e.value.mismatches) == 4
    mla = trtllm_layout_from_geometry(0x1000, 4, 2, 1, 1, 32, 8, "bf16")
    with pytest.raises(LayoutMismatchError, match="kv_factor"):
        plan_transfer(fake_sglang(heads=1), [1], mla, [0], 4)


@pytest.mark.parametrize(
    "blocks, tokens, first, match",
    [
        ([0, 1], 20, 0, r"block ids \[0\] outside"),  # SGLang page 0 is padding
        ([1, 10], 20, 0, r"block ids \[10\] outside"),
        ([1], 20, 0, "needs 2"),
        ([3, 3], 20, 0, "names a block twice"),
        ([1, 2], (5, 5), 0, "empty"),
        ([1, 2], 20, 8, "not a multiple"),
        ([1, 2], (0, 20), 16, "precedes"),
    ],
)
def test_bad_block_lists_and_ranges_are_named(blocks, tokens, first, match):
    with pytest.raises(LayoutError, match=match):
        plan_transfer(fake_sglang(), blocks, fake_trtllm(), [0, 1, 2], tokens, src_first_token=first)


def test_bad_arguments_raise_layout_errors():
    with pytest.raises(LayoutError, match="2-d|1-d"):
        plan_transfer(fake_sglang(), [[1, 2]], fake_trtllm(), [0], 4)
    with pytest.raises(LayoutError, match="integers"):
        plan_transfer(fake_sglang(), [1.5], fake_trtllm(), [0], 4)
    with pytest.raises(LayoutError, match="unsupported KV dtype"):
        fake_sglang(dtype="int4")
    with pytest.raises(LayoutError, match="not page_size"):
        sglang_layout_from_buffers([0x1000, 0x2000], [1000, 1000], [100, 100], 16, 2, 2, "bf16")
    with pytest.raises(LayoutError, match="malformed"):
        KVLayout.from_description({"engine": "x"})
    with pytest.raises(LayoutError, match="do not fit"):
        KVLayout.from_description({**fake_trtllm().describe(), "num_blocks": 11})


def test_tp_head_slices_and_maps():
    assert [tp_head_slice(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [tp_head_slice(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [tp_head_slice(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # replicated
    with pytest.raises(LayoutError, match="cannot be split"):
        tp_head_slice(6, 4, 0)
    # prefill TP 2 -> decode TP 4: decode rank 3 takes global heads 6..8 = prefill rank 1's local 2..4
    src = fake_sglang(heads=4, tp_rank=1, tp_size=2)
    dst = fake_trtllm(heads=2, tp_rank=3, tp_size=4)
    assert HeadMap.between(src, dst) == HeadMap(global_start=6, count=2, src_start=2, dst_start=0)
    # and back: TP 4 -> TP 2
    assert HeadMap.between(dst, src) == HeadMap(6, 2, 0, 2)
    with pytest.raises(LayoutError, match="do not overlap"):
        HeadMap.between(fake_sglang(heads=4, tp_rank=0, tp_size=2), dst)


def test_same_layouts_coalesce_to_few_segments():
    # SGLang -> SGLang, same page size, consecutive pages: one segment per layer and K/V
    a, b = fake_sglang(layers=3, pages=40), fake_sglang(layers=3, pages=40)
    plan = plan_transfer(a, np.arange(1, 8), b, np.arange(20, 27), 100)
    assert plan.kind is PlanKind.DIRECT and plan.num_segments == 3 * 2
    # TRT-LLM -> TRT-LLM, same block size, consecutive full blocks: one segment in all
    t1, t2 = fake_trtllm(layers=4, blocks=20), fake_trtllm(layers=4, blocks=20)
    plan = plan_transfer(t1, [2, 3, 4], t2, [10, 11, 12], 96)
    assert plan.kind is PlanKind.DIRECT and plan.num_segments == 1 and plan.nbytes == 96 * 4 * 2 * 2 * 16
    # a prefix the receiver holds (tokens 0..40): skipped, the rest still coalesces
    plan = plan_transfer(t1, [2, 3, 4], t2, [10, 11, 12], (40, 96))
    assert plan.nbytes == 56 * 4 * 2 * 2 * 16 and plan.num_segments < 4 * 2 * 2 * 2


def test_plan_choice_and_explanation():
    # NHD -> HND at scale: direct would be one segment per head per token; staging wins
    src = fake_sglang(layers=4, heads=8, head_dim=128, page=64, pages=80)
    dst = fake_trtllm(layers=4, heads=8, head_dim=128, tpb=32, blocks=160)
    plan = plan_transfer(src, np.arange(1, 65), dst, np.arange(128), 4096)
    assert plan.kind is PlanKind.STAGED_SEND
    assert plan.estimates[PlanKind.DIRECT].segments == 4 * 2 * 4096 * 8
    assert plan.num_segments == 1 and plan.staging_bytes == plan.nbytes
    assert "chose staged_send" in plan.explain() and "direct" in plan.explain()
    # prefill TP 2 -> decode TP 1 into SGLang (NHD): receiver rows are split between senders,
    # so only receiver-side staging makes segments large
    s = fake_sglang(layers=2, heads=4, head_dim=64, page=16, pages=70, tp_rank=1, tp_size=2)
    d = fake_sglang(layers=2, heads=8, head_dim=64, page=16, pages=70)
    plan = plan_transfer(s, np.arange(1, 65), d, np.arange(2, 66), 1024, kinds=tuple(PlanKind))
    assert plan.kind is PlanKind.STAGED_RECV
    assert plan.estimates[PlanKind.DIRECT].segments == 2 * 2 * 1024
    assert plan.num_segments == 2 * 2
    # without receiver-side staging, sender staging cannot merge split rows: direct it is
    assert plan_transfer(s, np.arange(1, 65), d, np.arange(2, 66), 1024).kind is PlanKind.DIRECT


def test_plan_from_a_peer_description_is_identical():
    src, dst = fake_sglang(layers=2, pages=20), fake_trtllm(layers=2, blocks=20)
    remote = KVLayout.from_description(json.loads(json.dumps(dst.describe())))
    p1 = plan_transfer(src, [3, 5, 7], dst, [9, 1], 40, force="direct")
    p2 = plan_transfer(src, [3, 5, 7], remote, [9, 1], 40, force="direct")
    assert np.array_equal(p1.wire.src, p2.wire.src) and np.array_equal(p1.wire.dst, p2.wire.dst)


def test_write_guard_accepts_room_blocks_and_rejects_others():
    src, dst = fake_sglang(layers=2, pages=20), fake_trtllm(layers=2, blocks=20)
    plan = plan_transfer(src, [3, 5, 7], dst, [9, 1], 40, force="direct")
    allowed = block_ranges(dst, np.array([9, 1]))
    check_segments_inside(plan.wire.dst, plan.wire.length, allowed, "room 7")
    with pytest.raises(LayoutError, match="room 7: 1 segment"):
        check_segments_inside(plan.wire.dst[:1] + dst.block_stride, plan.wire.length[:1], block_ranges(dst, np.array([1])), "room 7")
    with pytest.raises(LayoutError, match="outside"):
        check_segments_inside(np.array([10]), np.array([8]), np.array([[0, 16]]), "x")  # runs past the end


def test_chunks_cover_the_plan_exactly():
    src = fake_sglang(layers=2, heads=8, head_dim=128, page=64, pages=40)
    dst = fake_trtllm(layers=2, heads=8, head_dim=128, tpb=32, blocks=80)
    plan = plan_transfer(src, np.arange(1, 33), dst, np.arange(64)[::-1], (10, 2000))
    parts = plan.chunks(1 << 20)
    assert parts[0].spec.start == 10 and parts[-1].spec.stop == 2000
    assert all(p.spec.stop == q.spec.start for p, q in zip(parts, parts[1:]))
    assert sum(p.nbytes for p in parts) == plan.nbytes
    assert all((p.spec.start - 10 if i == 0 else p.spec.start) % 64 == 0 or i == 0 for i, p in enumerate(parts))


def test_bench_layout_cli_reports_what_the_issue_asks():
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "layout", "--json", "--plan-tokens", "2048",
                          "--repack-tokens", "256", "--reps", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    for key in ("repack_gbps", "memcpy_gbps", "repack_ratio", "plan_ms_32k", "segments_direct", "segments_staged",
                "memcpy_one_thread_gbps", "repack_all_threads_ratio", "one_thread_copy_share_spread"):
        assert key in res
    # the sender's one-thread gather is held to a one-thread memcpy; all threads' figure beside it
    one, every = res["memcpy_one_thread_gbps"], res["memcpy_gbps"]
    assert res["repack_ratio"] == res["repack_ratio_spread"]["median"] and res["repack_ratio_spread"]["n"] == 2
    assert res["one_thread_copy_share_spread"]["n"] == 2 and one > 0 and every > 0
    assert any("threads' speed here" in w for w in res["warnings"]) == (
        res["one_thread_copy_share_spread"]["median"] < 0.8 and res["threads"] > 1)
    assert res["repack_bytes_verified"] is True
    # the gather on every thread against the fastest copy of the same bytes, any thread count
    assert res["gather_best_ratio"] == res["gather_best_ratio_spread"]["median"] > 0
    assert res["repack_split_gbps"] > 0 and res["memcpy_split_gbps"] > 0 and "fastest by median" in res["gather_best"]
    assert res["gather_choice"]["tcp"]["threads"] == 1
    assert res["segments_direct"] == 32 * 2 * 2048 * 8 and res["segments_staged"] < 100
    d = res["digest"]  # the content digest of the same tokens in both engines' pools, one thread and all
    want = {"sglang", "trtllm", "trtllm_torch"} | ({"sglang_split", "trtllm_split"} if res["threads"] > 1 else set())
    assert set(d["gbps"]) == want and all(g["n"] == 2 and g["median"] > 0 for g in d["gbps"].values()), d
    assert d["hash"].endswith("C walk in the pool's address order") and d["bytes"] == 256 * 32 * 2 * 8 * 128 * 2
    v = res["vllm_cpu"]  # vLLM's CPU caches per ISA, staged: their repacks against a memcpy, bytes checked
    assert v["amx_to_vec_plan"] == "staged_both" and v["amx_to_vec_bytes_verified"] is True
    for k in ("vec_gather", "amx_gather", "vec_scatter", "amx_scatter", "amx_to_vec_both"):
        assert v[f"{k}_gbps"] > 0 and v[f"{k}_ratio_spread"]["n"] == 2


def test_wheel_contains_every_subpackage(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (whl,) = tmp_path.glob("kvbridge-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for mod in ("kvbridge/__init__.py", "kvbridge/cli.py", "kvbridge/layout/plan.py", "kvbridge/layout/repack.py",
                "kvbridge/common/__init__.py", "kvbridge/adapters/sglang/__init__.py", "kvbridge/adapters/trtllm/__init__.py",
                "kvbridge/adapters/vllm/connector.py", "kvbridge/layout/vllm_pool.py", "kvbridge/demo/vllm_server.py",
                "kvbridge/common/bootstrap.py", "kvbridge/demo/__init__.py", "kvbridge/demo/run.py",
                # the router (kvbridge route) and the stand-in's trtllm-serve HTTP shape
                "kvbridge/route/__init__.py", "kvbridge/route/app.py", "kvbridge/route/dispatch.py",
                "kvbridge/demo/trtllm/http.py",
                # package data the demo's SGLang server needs on its PYTHONPATH
                "kvbridge/demo/sgl_shim/sgl_kernel/__init__.py",
                "kvbridge/demo/sgl_shim/mla_torch_native/kvbridge_tests_mla_torch_native.py",
                "kvbridge/demo/sgl_shim/mla_torch_native/kvbridge_tests_mla_torch_native-0.0.dist-info/entry_points.txt",
                # the TensorRT-LLM stand-in and its per-version import trees
                "kvbridge/demo/trtllm/executor.py",
                "kvbridge/demo/trtllm/site/v1_2/tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py",
                "kvbridge/demo/trtllm/site/main/tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py",
                # the benchmarks, reports and charts: their own room
                "kvbridge/bench/__init__.py", "kvbridge/bench/transfer.py", "kvbridge/bench/load.py",
                "kvbridge/bench/layout.py", "kvbridge/bench/sglang.py", "kvbridge/bench/sglang_worker.py",
                "kvbridge/bench/route.py", "kvbridge/bench/vllm.py", "kvbridge/bench/plots.py",
                "kvbridge/bench/report.py", "kvbridge/bench/report_faults.py"):
        assert mod in names, mod
    # the C tile copy, built for this interpreter (the gather's CPU path; kvbridge.layout.repack)
    assert [n for n in names if n.startswith("kvbridge/layout/_tilecopy") and n.endswith(".so")], sorted(names)[:20]
    # and the content digest's hash loop (kvbridge.layout.digest)
    assert [n for n in names if n.startswith("kvbridge/layout/_runhash") and n.endswith(".so")], sorted(names)[:20]
    core = [n for n in names if n.startswith(("kvbridge/common/", "kvbridge/layout/", "kvbridge/adapters/"))]
    assert core and not [n for n in core if any(w in n.rsplit("/", 1)[-1] for w in ("bench", "report", "plot"))]


def test_local_repack_between_pools_is_exact():
    """repack(): a pool-to-pool copy in one process (gather, then scatter) moves exactly the request."""
    from kvbridge.layout import CopySpec, allocate_pool, repack
    from tests.helpers.kvhelpers import read_units, snapshot, unit_addresses, written_mask

    src = allocate_pool("sglang", layers=2, total_heads=4, head_dim=8, dtype="bf16", tokens_per_block=16, num_blocks=12, seed=1)
    dst = allocate_pool("trtllm", layers=2, total_heads=4, head_dim=8, dtype="bf16", tokens_per_block=32, num_blocks=8, seed=2)
    sb, db = [5, 2, 9, 7, 11, 3], [6, 1, 4]
    before = snapshot(dst)
    spec = CopySpec.build(src, sb, dst, db, (10, 90))
    assert repack(spec) == spec.nbytes
    so = unit_addresses(src, sb, 0, 10, 90, range(4))
    do = unit_addresses(dst, db, 0, 10, 90, range(4))
    assert np.array_equal(read_units(src, so), read_units(dst, do))
    mask = written_mask(dst, do)
    assert all(np.array_equal(a[~m], b[~m]) for a, b, m in zip(snapshot(dst), before, mask))


def test_staged_send_in_row_parts_is_exact():
    """The sender's pipeline: each chunk of a staged_send plan gathered in row parts of any
    size into one small region, each part's wire cut with ``Segments.window``; the
    destination ends up byte-exact and nothing else in it changes."""
    from kvbridge.layout import allocate_pool
    from tests.helpers.kvhelpers import execute_segments, read_units, snapshot, unit_addresses, written_mask

    src = allocate_pool("sglang", layers=2, total_heads=4, head_dim=8, dtype="bf16", tokens_per_block=16, num_blocks=12, seed=1)
    dst = allocate_pool("trtllm", layers=2, total_heads=4, head_dim=8, dtype="bf16", tokens_per_block=32, num_blocks=8, seed=2)
    sb, db = [5, 2, 9, 7, 11, 3], [6, 1, 4]
    before = snapshot(dst)
    plan = plan_transfer(src, sb, dst, db, (10, 90), kinds=(PlanKind.STAGED_SEND,))
    region = torch.empty(4096, dtype=torch.uint8)
    parts = 0
    for chunk in plan.chunks(3000):
        g = chunk.gather()
        for a, b in zip(range(0, g.rows, 7), [*range(7, g.rows, 7), g.rows]):  # 7 rows: parts cut runs mid-way
            assert g.run(region, rows=(a, b)) == (b - a) * g.row_bytes
            w = chunk.wire.window(a * g.row_bytes, b * g.row_bytes)
            assert w.nbytes == (b - a) * g.row_bytes
            execute_segments(w.shifted(src_by=region.data_ptr()))
            parts += 1
    assert parts > 10
    so = unit_addresses(src, sb, 0, 10, 90, range(4))
    do = unit_addresses(dst, db, 0, 10, 90, range(4))
    assert np.array_equal(read_units(src, so), read_units(dst, do))
    mask = written_mask(dst, do)
    assert all(np.array_equal(a[~m], b[~m]) for a, b, m in zip(snapshot(dst), before, mask))
    with pytest.raises(LayoutError, match="row range"):
        g.run(region, rows=(0, g.rows + 1))


def test_gather_parts_and_cpu_copy_split_match_one_whole_gather(monkeypatch):
    """A gather run part by part (each part's row index built lazily, from the boxes that
    hold it) and in CPU copies of a few elements each writes the same staging bytes as one
    whole gather with its index built at once."""
    import sys

    from kvbridge.layout import allocate_pool

    repack_mod = sys.modules["kvbridge.layout.repack"]
    src = allocate_pool("sglang", layers=3, total_heads=4, head_dim=16, dtype="bf16", tokens_per_block=16, num_blocks=20, seed=3)
    dst = allocate_pool("trtllm", layers=3, total_heads=4, head_dim=16, dtype="bf16", tokens_per_block=32, num_blocks=12, seed=4)
    plan = plan_transfer(src, [7, 2, 9, 11, 3, 5, 14, 8], dst, [4, 1, 9, 6], (5, 120), kinds=(PlanKind.STAGED_SEND,))
    whole = plan.gather()
    assert whole.index.numel() == whole.rows  # built at once
    ref = torch.zeros(whole.nbytes, dtype=torch.uint8)
    whole.run(ref)
    monkeypatch.setattr(repack_mod, "CPU_COPY_ELEMENTS", 8)  # 2 rows of 32 B per copy
    parted = plan.gather()
    out = torch.zeros_like(ref)
    rb = parted.row_bytes
    for a in range(0, parted.rows, 37):  # parts cut boxes mid-way
        b = min(parted.rows, a + 37)
        parted.run(out[a * rb:], rows=(a, b))
    assert parted._index is None  # no part needed the whole index
    assert torch.equal(out, ref)
    assert parted._copies(parted.rows)[1] == (2, 4)
    assert parted._copies(parted.rows, inline=False) == [(0, parted.rows)]
    for inline in (True, False):  # the whole gather forced onto the calling thread, or left to torch
        out.zero_()
        plan.gather().run(out, inline=inline)
        assert torch.equal(out, ref)


def test_relative_key_is_the_same_pool_anywhere_in_memory():
    """Equal for a pool shifted as a whole (another process), different as soon as the
    order of its (layer, K/V) buffers or its geometry differs: rows would be ordered
    differently."""
    a = fake_trtllm(blocks=10)
    assert trtllm_layout_from_geometry(0x7F_0000_0000, 10, 2, 2, 2, 32, 8, "bf16").relative_key == a.relative_key
    assert fake_trtllm(blocks=10, tpb=16).relative_key != a.relative_key
    s = fake_sglang()
    page_bytes = 16 * 2 * 8 * 2

    def sglang_at(ptrs):
        return sglang_layout_from_buffers(ptrs, [10 * page_bytes] * 4, [page_bytes] * 4, 16, 2, 2, "bf16")

    shifted = [0x30_0000_0000 + i * (1 << 24) for i in range(4)]
    assert sglang_at(shifted).relative_key == s.relative_key
    assert sglang_at(shifted[::-1]).relative_key != s.relative_key  # buffers in another order


def test_bench_layout_repack_read_back_by_each_engines_indexing():
    """Not the bench's own ``repack_bytes_verified``: its staged bytes are sent to a real
    TensorRT-LLM-format pool along the plan's wire segments (as a transport would), then the
    destination is read by TensorRT-LLM's indexing rule and compared with the source read by
    SGLang's (tests/helpers/engine_kv.py, written apart from ``KVLayout``)."""
    from tests.helpers.engine_kv import sglang_kv, trtllm_kv
    from kvbridge.bench.layout import bench_layout
    from tests.helpers.kvhelpers import execute_segments

    layers, heads, hd, page, tpb, tokens = 2, 2, 16, 64, 32, 256
    keep: dict = {}
    res = bench_layout(layers=layers, heads=heads, head_dim=hd, src_page=page, dst_tokens_per_block=tpb,
                       plan_tokens=512, repack_tokens=tokens, reps=1, keep=keep)
    plan, stage, dblocks = keep["plan"], keep["staging"], keep["dst_blocks"]
    dst = plan.spec.dst
    pool = torch.full((dst.num_blocks, layers, 2, heads * tpb * hd), -1, dtype=torch.int16).view(torch.bfloat16)
    execute_segments(plan.wire.shifted(src_by=stage.data_ptr(), dst_by=pool.data_ptr() - int(dst.base.min())))
    ts = keep["src_tensors"]
    positions = range(tokens)
    want = sglang_kv(ts[:layers], ts[layers:], keep["src_pages"], page, positions)
    got = trtllm_kv(pool, dblocks, tpb, hd, positions)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "the repacked bytes are not the source's K/V"
    untouched = torch.ones(dst.num_blocks, dtype=torch.bool)
    untouched[torch.as_tensor(dblocks)] = False
    assert (pool.view(torch.int16)[untouched] == -1).all(), "bytes outside the destination blocks changed"
    assert res["repack_bytes_verified"] is True and res["repack_bytes"] == stage.numel() == want.numel() * 2


def test_alias_memory_is_the_memory_itself():
    """``alias_memory``: a uint8 view of host memory at an address (no copy): writes through
    either side are seen by the other; a device it cannot alias is named."""
    from kvbridge.layout import LayoutError, alias_memory

    t = torch.arange(64, dtype=torch.int32)
    a = alias_memory(t.data_ptr() + 16, 32)
    assert a.dtype == torch.uint8 and a.shape == (32,)
    assert a.view(torch.int32).tolist() == list(range(4, 12))
    a.view(torch.int32)[0] = -7
    assert int(t[4]) == -7
    t[11] = 99
    assert int(a.view(torch.int32)[7]) == 99
    with pytest.raises(LayoutError, match="meta"):
        alias_memory(t.data_ptr(), 4, "meta")


# -- fp8 scales ----------------------------------------------------------------------------
def _fp8(engine, tp=1, rank=0, **kw):
    from kvbridge.layout.pools import allocate_pool

    return allocate_pool(engine, layers=3, total_heads=4, head_dim=16, dtype="fp8", tokens_per_block=16,
                         num_blocks=8, tp_size=tp, tp_rank=rank, **kw)


def test_fp8_scales_must_agree_on_every_head_both_hold():
    """Per-tensor scales broadcast over heads; a scale that differs on a head both layouts
    hold is named (layer, K/V, head, both values); heads only one side holds are not
    compared; float32-rounded scales agree with float64 ones; no scales means 1.0."""
    from kvbridge.layout import check_compatible

    src = _fp8("sglang").with_scales(np.full((3, 2), 0.5))
    assert src.scales.shape == (3, 2, 4) and (src.scales == 0.5).all()
    check_compatible(src, _fp8("trtllm").with_scales(np.float32(0.5) * np.ones((3, 2))))
    other = np.full((3, 2, 4), 0.5)
    other[2, 0, 3] = 0.25  # layer 2, K, head 3
    with pytest.raises(LayoutMismatchError, match=r"layer 2 K head 3: source 0.5 != destination 0.25"):
        check_compatible(src, _fp8("trtllm").with_scales(other))
    with pytest.raises(LayoutMismatchError, match="layer 0 K head 0: source 0.5 != destination 1"):
        check_compatible(src, _fp8("trtllm"))  # an unscaled cache reads the same bytes as other numbers
    # TP: decode rank 0 of 2 holds heads 0-1, where the scales agree; rank 1 holds head 3
    check_compatible(src, _fp8("trtllm", tp=2, rank=0).with_scales(other[:, :, :2]))
    with pytest.raises(LayoutMismatchError, match="head 3"):
        check_compatible(src, _fp8("trtllm", tp=2, rank=1).with_scales(other[:, :, 2:]))
    # a per-layer view keeps its layers' scales
    assert (src.with_scales(other).layer_range(2, 3).scales == other[2:]).all()


def test_fp8_scales_cross_the_wire_and_bad_ones_are_refused():
    """``describe`` carries scales only when some differ from 1.0; a description's scales
    must be a [layers, K/V, heads] float array; scales are finite and positive; a cache
    that is not fp8 carries none."""
    lay = _fp8("sglang").with_scales([[1.0, 2.0], [0.5, 0.5], [1.0, 1.0]])
    d = json.loads(json.dumps(lay.describe()))
    assert KVLayout.from_description(d).scales.tolist() == lay.scales.tolist()
    assert "kv_scales" not in _fp8("sglang").describe()
    for bad in ([[1.0, 2.0]], [[[1, 2]]], "x"):
        with pytest.raises(LayoutError, match="kv_scales"):
            KVLayout.from_description(dict(d, kv_scales=bad))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(LayoutError, match="finite and positive"):
            lay.with_scales(bad)
    from kvbridge.layout.pools import allocate_pool

    bf16 = allocate_pool("sglang", layers=3, total_heads=4, head_dim=16, dtype="bf16", tokens_per_block=16,
                         num_blocks=8)
    assert bf16.with_scales(1.0).kv_scales is None
    with pytest.raises(LayoutError, match="carries no scales"):
        bf16.with_scales(0.5)


def _with(desc, **over):
    return {**desc, **over}


TRT = fake_trtllm().describe()  # block = 2 layers x K/V x 2 heads x 32 tokens x 16 B: tiles of 1 KiB, 4 KiB apart
SGL = fake_sglang().describe()  # one tensor per (layer, kv): rows of 16 B, token_stride 32 B (2 heads)
BIG = [[r[0], 1 << 14] for r in SGL["regions"]]  # room for blocks of 1 KiB


@pytest.mark.parametrize(
    "desc, match",
    [
        # half the block stride: layer 0's K in block 1 lands on layer 1's K in block 0
        (_with(TRT, block_stride=2048), "layer 0 kv 0 and layer 1 kv 0 put rows on the same bytes"),
        (_with(TRT, block_stride=512), "(block|head)_stride=512 B does not step over"),  # blocks on heads
        (_with(TRT, base=[[TRT["base"][0][0]] * 2, TRT["base"][1]]), "layer 0 kv 0 and layer 0 kv 1"),
        (_with(TRT, head_stride=256), "head_stride=256 B does not step over the 512 B"),  # 32 tokens x 16 B
        (_with(SGL, token_stride=16), "head_stride=16 B does not step over the 256 B"),  # two heads of 16 B
        # head 1's rows apart from head 0's but between them (odd and even 16 B steps): not nested
        (_with(SGL, head_stride=48, block_stride=1024, regions=BIG), "head_stride=48 B does not step over the 496 B"),
        (_with(SGL, head_stride=0), "head_stride=0 B does not step over the 16 B"),
        # V's rows half a row after K's: they share bytes (a whole row after, as vLLM puts them, is fine)
        (_with(SGL, base=[[b, b + 8] for b, _ in SGL["base"]], region_of=[[0, 0], [1, 1]],
               regions=BIG[:2], token_stride=64, head_stride=32, block_stride=1024), "kv 0 and layer 0 kv 1 put rows"),
        (_with(SGL, regions=[[r[0], r[1] + (1 << 24)] for r in SGL["regions"]]), "regions overlap"),
    ],
)
def test_a_layout_whose_slots_share_bytes_is_refused(desc, match):
    """Geometry that would make two slots (or two blocks) write the same bytes is refused by name,
    whoever describes it: a peer's request or an adapter with a wrong stride."""
    with pytest.raises(LayoutError, match=match):
        KVLayout.from_description(desc)


def test_the_engines_own_layouts_own_their_bytes():
    """The same geometry as the engines lay it out is accepted, vLLM's K and V side by side
    in one row of 2 x 16 B included."""
    KVLayout.from_description(TRT)
    KVLayout.from_description(SGL)
    KVLayout.from_description(_with(SGL, base=[[b, b + 16] for b, _ in SGL["base"]], region_of=[[0, 0], [1, 1]],
                                    regions=BIG[:2], token_stride=64, head_stride=32, block_stride=1024))


@st.composite
def small_geometries(draw):
    """A small layout description over one region: the block, token and head axes in any order,
    strides tight for that order or drawn near and far from it, (layer, kv) offsets as the
    engines place them or anywhere."""
    item = draw(st.sampled_from([1, 2]))
    layers, kvf, heads, hd, tpb, blocks = (draw(st.integers(1, n)) for n in (2, 2, 3, 3, 4, 4))
    row = hd * item
    kv_rows = draw(st.sampled_from([1, kvf]))  # vLLM: K and V side by side in one row
    strides, step = {}, kv_rows * row
    for axis, count in draw(st.permutations([("block", blocks), ("token", tpb), ("head", heads)])):  # inner first
        strides[axis] = draw(st.one_of(st.just(step), st.just(0), st.just(row),
                                       st.integers(0, 4 * step + 8).map(lambda x: x // item * item)))
        step *= count
    tile = layers * kvf * heads * tpb * row
    offsets = draw(st.one_of(
        st.just([i * heads * tpb * row for i in range(layers * kvf)]),  # TRT-like: tiles side by side in a block
        st.just([i * blocks * tile for i in range(layers * kvf)]),      # one tensor per (layer, kv)
        st.just([(i // kvf) * blocks * tile + (i % kvf) * row for i in range(layers * kvf)]),  # vLLM: K|V rows
        st.lists(st.integers(0, 2 * blocks * tile // item), min_size=layers * kvf, max_size=layers * kvf)
        .map(lambda xs: [x * item for x in xs]),
    ))
    region = 1 << 20
    return dict(engine="trtllm", num_layers=layers, kv_factor=kvf, num_heads=heads, head_offset=0, total_heads=heads,
                head_dim=hd, dtype="bfloat16" if item == 2 else "fp8_e4m3", tokens_per_block=tpb, num_blocks=blocks,
                first_block=0, block_stride=strides["block"], token_stride=strides["token"],
                head_stride=strides["head"], base=[[region + offsets[l * kvf + k] for k in range(kvf)]
                                                   for l in range(layers)],
                region_of=[[0] * kvf for _ in range(layers)], regions=[[region, region]], layer_offset=0)


def _apart(spans) -> bool:
    """Whether half-open byte spans ``(start, end)`` share no byte."""
    spans = sorted(spans)
    return all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))


def _owns_its_bytes(d) -> bool:
    """By enumeration: the axes nest (order them by stride; with the outer ones' indices fixed,
    the spans of one axis's steps, each over every index inside it, lie apart), and no two head
    rows of the whole map share a byte."""
    row = d["head_dim"] * (2 if d["dtype"] == "bfloat16" else 1)
    axes = sorted(((c, s) for c, s in ((d["num_blocks"], d["block_stride"]), (d["tokens_per_block"], d["token_stride"]),
                                       (d["num_heads"], d["head_stride"])) if c > 1), key=lambda a: -a[1])
    rows = []
    for base in (b for per_layer in d["base"] for b in per_layer):
        at = {idx: base + sum(i * s for i, (_, s) in zip(idx, axes))
              for idx in itertools.product(*(range(c) for c, _ in axes))}
        for k in range(len(axes)):
            for outer in itertools.product(*(range(c) for c, _ in axes[:k])):
                steps = [[a for idx, a in at.items() if idx[:k] == outer and idx[k] == x] for x in range(axes[k][0])]
                if not _apart([(min(x), max(x) + row) for x in steps]):
                    return False
        rows += [(a, a + row) for a in at.values()]
    return _apart(rows)


@settings(max_examples=400, deadline=None)
@given(small_geometries())
def test_the_overlap_check_agrees_with_enumerating_every_row(desc):
    if _owns_its_bytes(desc):
        KVLayout.from_description(desc)
    else:
        with pytest.raises(LayoutError, match="does not step over|same bytes"):
            KVLayout.from_description(desc)
