"""Property tests: any plan, executed byte for byte, moves exactly the right K and V.

One side is always a REAL SGLang pool (MHATokenToKVPool / MLATokenToKVPool, CPU);
the other is SGLang or a tensor of TensorRT-LLM's exact pool geometry. Bytes are
checked against an independent reference reader (tests/helpers/kvhelpers.py), the three plan
kinds must produce identical destination bytes, and nothing else in either pool may
change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.layout import (
    HeadMap,
    KVLayout,
    PlanKind,
    estimate_plan,
    plan_transfer,
    sglang_mha_layout,
    sglang_mla_layout,
    tp_head_slice,
    trtllm_pool_layout,
)
from kvbridge.layout.segments import _classes, count_segments
from tests.helpers.engine_kv import sglang_kv, trtllm_kv
from tests.helpers.kvhelpers import execute_segments, fill_random, read_units, snapshot, unit_addresses, written_mask

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}


def make_side(kind, pools, *, mla, dtype, layers, total_heads, head_dim, tp, rank, tpb, tokens_needed, rng):
    """A live pool of one engine, big enough for the request plus other requests' blocks.
    Returns (layout, block list in token order)."""
    MHA, MLA = pools
    nblk_needed = -(-tokens_needed // tpb)
    spare = int(rng.integers(1, 4))
    tdtype = TORCH_DTYPES[dtype]
    if kind == "sglang":
        num_pages = nblk_needed + spare
        size = num_pages * tpb  # plus SGLang's own padding page 0
        if mla:
            pool = MLA(size=size, page_size=tpb, dtype=tdtype, kv_lora_rank=head_dim - 4, qk_rope_head_dim=4,
                       layer_num=layers, device="cpu", enable_memory_saver=False)
            lay = sglang_mla_layout(pool)
        else:
            heads = tp_head_slice(total_heads, tp, rank)[1]
            pool = MHA(size=size, page_size=tpb, dtype=tdtype, head_num=heads, head_dim=head_dim,
                       layer_num=layers, device="cpu", enable_memory_saver=False)
            lay = sglang_mha_layout(pool, tp_rank=rank, tp_size=tp, total_heads=total_heads)
        ids = rng.permutation(np.arange(1, lay.num_blocks))[:nblk_needed]
    else:
        nblocks = nblk_needed + spare
        heads = 1 if mla else tp_head_slice(total_heads, tp, rank)[1]
        store = torch.uint8 if dtype == "fp8" else tdtype
        pool = torch.zeros(nblocks, layers, 1 if mla else 2, heads * tpb * head_dim, dtype=store)
        lay = trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=heads, dtype=dtype,
                                 total_heads=None if mla else total_heads, tp_rank=0 if mla else rank,
                                 tp_size=1 if mla else tp)
        ids = rng.permutation(nblocks)[:nblk_needed]
    return lay, ids, pool


@st.composite
def scenarios(draw):
    pair = draw(st.sampled_from([("sglang", "trtllm"), ("trtllm", "sglang"), ("sglang", "sglang"), ("trtllm", "trtllm")]))
    mla = draw(st.booleans())
    dtype = draw(st.sampled_from(["bfloat16", "fp8", "float16", "float32"]))
    layers = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([12, 16])) if mla else draw(st.sampled_from([4, 8, 16]))
    total_heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    tps = [1] if mla else [t for t in (1, 2, 4) if total_heads % t == 0 or t % total_heads == 0]
    src_tp, dst_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    dst_rank = draw(st.integers(0, dst_tp - 1))
    d0, dn = tp_head_slice(total_heads, dst_tp, dst_rank)
    src_ranks = [r for r in range(src_tp) if set(range(*(lambda a, b: (a, a + b))(*tp_head_slice(total_heads, src_tp, r)))) & set(range(d0, d0 + dn))]
    src_rank = draw(st.sampled_from(src_ranks))
    tpbs = {"sglang": [1, 4, 16, 64], "trtllm": [8, 16, 32, 64]}
    src_tpb = draw(st.sampled_from(tpbs[pair[0]]))
    dst_tpb = draw(st.sampled_from(tpbs[pair[1]]))
    stop = draw(st.integers(1, 160))
    start = draw(st.integers(0, stop - 1))  # tokens [0, start) the receiver already holds
    chunked = draw(st.booleans())  # sender's block list starts at its chunk (chunked prefill)
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(pair=pair, mla=mla, dtype=dtype, layers=layers, head_dim=head_dim, total_heads=total_heads,
                src_tp=src_tp, dst_tp=dst_tp, src_rank=src_rank, dst_rank=dst_rank, src_tpb=src_tpb,
                dst_tpb=dst_tpb, start=start, stop=stop, chunked=chunked, seed=seed)


def make_pair(sglang_pools, sc):
    """A scenario's two live pools: (rng, (src layout, blocks, pool), (dst layout, blocks, pool))."""
    rng = np.random.default_rng(sc["seed"])
    common = dict(mla=sc["mla"], dtype=sc["dtype"], layers=sc["layers"], total_heads=sc["total_heads"],
                  head_dim=sc["head_dim"], tokens_needed=sc["stop"], rng=rng)
    src = make_side(sc["pair"][0], sglang_pools, tp=sc["src_tp"], rank=sc["src_rank"], tpb=sc["src_tpb"], **common)
    dst = make_side(sc["pair"][1], sglang_pools, tp=sc["dst_tp"], rank=sc["dst_rank"], tpb=sc["dst_tpb"], **common)
    return rng, src, dst


def run_plan(plan, chunk_bytes=None):
    """Execute a plan in one process: repack with torch, wire segments with memmove;
    chunk by chunk through one reused staging buffer when ``chunk_bytes`` is given."""
    parts = plan.chunks(chunk_bytes) if chunk_bytes else [plan]
    stage = torch.zeros(max(p.nbytes for p in parts) + 64, dtype=torch.uint8)
    pool = [(r.addr, r.nbytes) for r in plan.spec.dst.regions]  # a wrong plan fails here, never writes past the pool
    for part in parts:
        if plan.kind is PlanKind.DIRECT:
            execute_segments(part.wire, dst_within=pool)
        elif plan.kind.gathers:
            g = part.gather()
            step = max(1, g.rows // 3 + 1)  # in row parts (as the sender pipelines), each index built lazily
            for a in range(0, g.rows, step):
                g.run(stage[a * g.row_bytes:], rows=(a, min(g.rows, a + step)))
            if plan.kind is PlanKind.STAGED_SEND:
                execute_segments(part.wire.shifted(src_by=stage.data_ptr()), dst_within=pool)
            else:  # staged_both: the sender's staging into the receiver's, then its scatter
                landed = torch.zeros_like(stage)
                execute_segments(part.wire.shifted(src_by=stage.data_ptr(), dst_by=landed.data_ptr()),
                                 dst_within=[(landed.data_ptr(), landed.numel())])
                part.scatter().run(landed)
        else:
            execute_segments(part.wire.shifted(dst_by=stage.data_ptr()), dst_within=[(stage.data_ptr(), stage.numel())])
            part.scatter().run(stage)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_every_plan_moves_exactly_the_request(sglang_pools, sc):
    rng, (src, sblocks, _), (dst, dblocks, _) = make_pair(sglang_pools, sc)
    src_first = 0
    if sc["chunked"]:
        src_first = (sc["start"] // src.tokens_per_block) * src.tokens_per_block
        sblocks = sblocks[src_first // src.tokens_per_block:]
    heads = HeadMap.between(src, dst)
    fill_random(src, sc["seed"])
    src_before = snapshot(src)
    s_off = unit_addresses(src, sblocks, src_first, sc["start"], sc["stop"], range(heads.src_start, heads.src_start + heads.count))
    d_off = unit_addresses(dst, dblocks, 0, sc["start"], sc["stop"], range(heads.dst_start, heads.dst_start + heads.count))
    expected = read_units(src, s_off)
    mask = written_mask(dst, d_off)

    results = {}
    for kind in PlanKind:
        fill_random(dst, sc["seed"] + 1)
        dst_before = snapshot(dst)
        plan = plan_transfer(src, sblocks, dst, dblocks, (sc["start"], sc["stop"]), src_first_token=src_first,
                             kinds=tuple(PlanKind), force=kind)
        assert plan.kind is kind and plan.nbytes == expected.size
        assert plan.wire.nbytes == expected.size
        chunk = None if sc["seed"] % 2 else max(1, expected.size // 3)
        run_plan(plan, chunk)
        after = snapshot(dst)
        got = read_units(dst, d_off, after)
        assert np.array_equal(got, expected), f"{kind.value}: wrong K/V bytes at the destination"
        for a, b, m in zip(after, dst_before, mask):
            assert np.array_equal(a[~m], b[~m]), f"{kind.value}: bytes outside the request changed"
        for a, b in zip(snapshot(src), src_before):
            assert np.array_equal(a, b), f"{kind.value}: the source pool changed"
        results[kind] = [a[m] for a, m in zip(after, mask)]
    for kind in (PlanKind.STAGED_SEND, PlanKind.STAGED_RECV, PlanKind.STAGED_BOTH):
        assert all(np.array_equal(x, y) for x, y in zip(results[kind], results[PlanKind.DIRECT]))
    # a large plan's direct segment count (an upper bound), taken from the geometry alone
    # where it can be, equals the count over the runs
    spec = plan.spec
    by_runs = sum(sel.size * spec.src.num_layers * spec.src.kv_factor * int(np.prod([d[0] for d in dims] or [1]))
                  for sel, _, dims in _classes(spec))
    assert count_segments(spec, exact_limit=0) == by_runs
    # the estimate the chooser picks a plan by, counted without building the plan (the cost gate's figure)
    args = (src, sblocks, dst, dblocks, (sc["start"], sc["stop"]))
    chosen = plan_transfer(*args, src_first_token=src_first, kinds=tuple(PlanKind))
    assert estimate_plan(chosen.spec, kinds=tuple(PlanKind)) == chosen.estimates[chosen.kind]


def engine_kv_of(kind: str, pool, blocks, tpb: int, tokens, heads, head_dim: int) -> torch.Tensor:
    """Bytes ``[layers, kv, T, H, head_bytes]`` of ``tokens`` and local ``heads``, read by the
    engine's own indexing rule (tests/helpers/engine_kv.py), not through ``KVLayout``."""
    if kind == "sglang":
        layers = pool.layer_num
        if not hasattr(pool, "k_buffer"):  # MLA: one latent row per token
            kv = sglang_kv([pool.kv_buffer[i] for i in range(layers)], None, blocks, tpb, tokens)
        else:
            kv = sglang_kv([pool.k_buffer[i] for i in range(layers)], [pool.v_buffer[i] for i in range(layers)],
                           blocks, tpb, tokens)
    else:
        kv = trtllm_kv(pool, blocks, tpb, head_dim, tokens)
    sel = kv[:, :, :, list(heads), :].contiguous()
    return sel.view(torch.uint8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_plans_agree_with_each_engines_own_indexing(sglang_pools, sc):
    """The same property, with the bytes read through each engine's own indexing rule
    (SGLang: ``k_buffer[l][page * page_size + t, h, :]``; TensorRT-LLM:
    ``pool[b, l, kv].view(H, T, D)[h, t, :]``), written independently of ``KVLayout``, so
    the layout constructors are checked against the engines, not against themselves."""
    rng, (src, sblocks, spool), (dst, dblocks, dpool) = make_pair(sglang_pools, sc)
    heads = HeadMap.between(src, dst)
    tokens = range(sc["start"], sc["stop"])
    fill_random(src, sc["seed"])
    want = engine_kv_of(sc["pair"][0], spool, sblocks, sc["src_tpb"], tokens, range(heads.src_start, heads.src_start + heads.count),
                        sc["head_dim"])
    for kind in PlanKind:
        fill_random(dst, sc["seed"] + 1)
        plan = plan_transfer(src, sblocks, dst, dblocks, (sc["start"], sc["stop"]), kinds=tuple(PlanKind), force=kind)
        run_plan(plan)
        got = engine_kv_of(sc["pair"][1], dpool, dblocks, sc["dst_tpb"], tokens, range(heads.dst_start, heads.dst_start + heads.count),
                           sc["head_dim"])
        assert torch.equal(got, want), f"{kind.value}: the destination engine reads other K/V than the source engine wrote"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_staged_rows_depend_on_the_order_of_destination_blocks_only(sglang_pools, sc):
    """A staged send gathers the same rows, chunk by chunk, for every ascending destination
    block list (KVSender prestages a room's first part before it knows the block ids)."""
    rng, (src, sblocks, _), (dst, dblocks, _) = make_pair(sglang_pools, sc)
    canonical = np.arange(dst.first_block, dst.first_block + dblocks.size)
    # the same pool geometry in another process: every address shifted by one constant
    d = dst.describe()
    shift = 0x7F00_0000_0000 - min(r[0] for r in d["regions"])
    moved = KVLayout.from_description({**d, "base": (dst.base + shift).tolist(),
                                       "regions": [[a + shift, n] for a, n in d["regions"]]})
    assert moved.relative_key == dst.relative_key
    plans = [plan_transfer(src, sblocks, lay, b, (sc["start"], sc["stop"]), kinds=tuple(PlanKind), force=PlanKind.STAGED_SEND)
             for lay, b in ((dst, np.sort(dblocks)), (dst, canonical), (moved, np.sort(dblocks)))]
    chunk = max(1, plans[0].nbytes // 3)
    for a, *others in zip(*(p.chunks(chunk) for p in plans), strict=True):
        for b in others:
            assert torch.equal(a.gather().index, b.gather().index)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", [PlanKind.STAGED_SEND, PlanKind.STAGED_RECV])
def test_repack_on_cuda_matches_cpu(kind):
    """The same gather/scatter on CUDA tensors gives the same bytes as on CPU."""
    g = torch.Generator().manual_seed(0)
    src_cpu = torch.randint(0, 255, (9, 3, 2, 4 * 32 * 16), dtype=torch.uint8, generator=g)
    outs = []
    for dev in ("cpu", "cuda"):
        sp = src_cpu.to(dev)
        dp = torch.zeros(40, 3, 2, 4 * 8 * 16, dtype=torch.uint8, device=dev)
        s = trtllm_pool_layout(sp, tokens_per_block=32, num_kv_heads=4, dtype="fp8")
        d = trtllm_pool_layout(dp, tokens_per_block=8, num_kv_heads=4, dtype="fp8")
        plan = plan_transfer(s, [3, 1, 7], d, list(range(39, 27, -1)), (5, 90), force=kind, kinds=tuple(PlanKind))
        stage = torch.zeros(plan.staging_bytes, dtype=torch.uint8, device=dev)
        if kind is PlanKind.STAGED_SEND:
            plan.gather().run(stage)
        else:
            stage.copy_(torch.arange(plan.staging_bytes, device=dev).to(torch.uint8))
            plan.scatter().run(stage)
        outs.append((stage.cpu(), dp.cpu()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
