"""vLLM's CPU KV cache in the layout core: element-strided K rows, staged on the vLLM side.

The layout is checked against vLLM's own kernel (``cpu_attn_reshape_and_cache`` writes
known K/V in the vLLM venv, kvbridge's gather must read them back), and here against
vLLM's indexing rule (``engine_kv.kv_addresses``) for every plan kind the core picks;
refusals name what is wrong. The compatibility matrix (test_compat_matrix.py) moves vLLM
caches to and from every engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.common import protocol as P
from kvbridge.layout import (VLLM_CPU_ISAS, KVLayout, LayoutError, PlanKind, allocate_pool, plan_transfer,
                             refused_kinds, vllm_cpu_layout, vllm_cpu_layout_from_geometry)
from tests.helpers.kvhelpers import read_units, run_plan, snapshot, unit_addresses, written_mask
from tests.helpers.vllm_env import requires_vllm, run_script

L, H, HD, T = 2, 4, 32, 150


def pool(engine, page, blocks=None, seed=1, dtype="bf16"):
    return allocate_pool(engine, layers=L, total_heads=H, head_dim=HD, dtype=dtype, tokens_per_block=page,
                         num_blocks=blocks or -(-T // page) + 3, seed=seed)


@requires_vllm
def test_layout_matches_vllms_own_kernel():
    """vLLM's reshape_and_cache writes K/V with its 'vec' ISA, with 'vec16' (head sizes
    80, 48 and block size 16, as the backend picks it), float32 and bfloat16, and with
    'amx' (bfloat16, block sizes 32 and 64); kvbridge reads every element back through
    its vLLM layout. Where the backend would pick an ISA kvbridge does not know on this
    host, kvbridge refuses that one by name. vLLM's CPU build has no 'amx' kernel on a
    host without AVX-512: those cases say so (vLLM's own error) instead of running; the
    'amx' layout is then checked against the formulas of its source alone
    (``test_amx_every_byte_both_ways``)."""
    r = run_script("kernel_layout.py")
    amx = r.pop("amx")
    for case, res in amx.items():  # vLLM's 'amx' reshape, where vLLM can call it: docs/vllm.md's formulas
        assert not res["ran"] or (res["k_formula"] and res["v_formula"]), (case, res)
    want = {f"{dt} {isa} bs{bs} hd{hd}" for dt in ("torch.float32", "torch.bfloat16")
            for isa, bs, hd in (("vec", 32, 32), ("vec16", 32, 80), ("vec16", 16, 64), ("vec16", 16, 48))}
    want |= {"torch.bfloat16 amx bs32 hd64", "torch.bfloat16 amx bs64 hd128"}
    assert set(r) == want, sorted(r)
    for case, res in r.items():
        if not res["ran"]:  # this host's vLLM build has no kernel for it: only 'amx', and named by vLLM
            assert res["isa"] == "amx" and "Unsupported CPU attention configuration" in res["why"], (case, res)
            continue
        assert res["equal"] is True and res["nonzero_elems"] > 0, (case, res)
        host = res["host_isa"]  # what the backend picks here: described, or refused by name
        assert (host in VLLM_CPU_ISAS and res["refused"] is None
                or res["refused"] and f"ISA {host!r} is not supported" in res["refused"]), (case, res)


@pytest.mark.parametrize("other,page", [("sglang", 1), ("sglang", 16), ("trtllm", 32), ("trtllm", 64), ("vllm", 32)])
@pytest.mark.parametrize("vllm_sends", [True, False])
def test_every_byte_both_ways(other, page, vllm_sends):
    rng = np.random.default_rng(page + 7 * vllm_sends)
    v = pool("vllm", 32, seed=3)
    o = pool(other, page, seed=4)
    vb = rng.permutation(np.arange(1, v.num_blocks))[: -(-T // 32)]
    ob = rng.permutation(np.arange(o.first_block, o.num_blocks))[: -(-T // page)]
    src, sb, dst, db = (v, vb, o, ob) if vllm_sends else (o, ob, v, vb)
    before = snapshot(dst)
    plan = plan_transfer(src, sb, dst, db, (20, T), kinds=tuple(PlanKind))
    want = {"vllm": PlanKind.DIRECT}.get(other, PlanKind.STAGED_SEND if vllm_sends else PlanKind.STAGED_RECV)
    assert plan.kind is want, plan.explain()
    if other != "vllm":  # staged: a few large segments, never one per element
        assert plan.num_segments <= 4 * L * 2 * -(-T // min(page, 32)), plan.num_segments
    run_plan(plan)
    so, do = unit_addresses(src, sb, 0, 20, T, range(H)), unit_addresses(dst, db, 0, 20, T, range(H))
    assert np.array_equal(read_units(src, so), read_units(dst, do))
    mask = written_mask(dst, do)
    assert all(np.array_equal(a[~m], b[~m]) for a, b, m in zip(snapshot(dst), before, mask)), "other bytes changed"


AMX_CASES = [("sglang", 1, "vec"), ("sglang", 16, "vec"), ("trtllm", 32, "vec"), ("trtllm", 64, "vec"),
             ("vllm", 32, "amx"), ("vllm", 64, "amx"), ("vllm", 32, "vec"), ("vllm", 64, "vec")]


@pytest.mark.parametrize("other,page,isa", AMX_CASES)
@pytest.mark.parametrize("amx_sends", [True, False])
def test_amx_every_byte_both_ways(other, page, isa, amx_sends):
    """vLLM's bfloat16 'amx' tiles (K: runs of 16 tokens with dimension pairs interleaved,
    V: token pairs interleaved) to and from every other layout, tokens [20, T) at first
    tokens that cut blocks differently on each side: every unit equal by both engines' own
    indexing, no other byte written, and the content digest equal on both sides."""
    from kvbridge.layout import grid_for, kv_digest

    rng = np.random.default_rng(page + 7 * amx_sends + (isa == "amx"))
    a = allocate_pool("vllm", layers=L, total_heads=H, head_dim=HD, dtype="bf16", tokens_per_block=32,
                      num_blocks=-(-T // 32) + 4, seed=3, isa="amx")
    o = allocate_pool(other, layers=L, total_heads=H, head_dim=HD, dtype="bf16", tokens_per_block=page,
                      num_blocks=-(-T // page) + 4, seed=4, isa=isa)
    assert a.engine == "vllm-cpu-amx" and not a.affine_tokens
    af = of = 0
    ab = rng.permutation(np.arange(1, a.num_blocks))[: -(-(T - af) // 32) + 1]
    ob = rng.permutation(np.arange(o.first_block, o.num_blocks))[: -(-(T - of) // page) + 1]
    src, sb, sf, dst, db, df = (a, ab, af, o, ob, of) if amx_sends else (o, ob, of, a, ab, af)
    before = snapshot(dst)
    plan = plan_transfer(src, sb, dst, db, (20, T), src_first_token=sf, dst_first_token=df, kinds=tuple(PlanKind))
    want = (PlanKind.STAGED_BOTH if other == "vllm" and (isa, page) != ("amx", 32)  # element-strided both sides
            else PlanKind.DIRECT if other == "vllm" else PlanKind.STAGED_SEND if amx_sends else PlanKind.STAGED_RECV)
    assert plan.kind is want, plan.explain()
    run_plan(plan, dst_within=[(r.addr, r.nbytes) for r in dst.regions])
    so, do = unit_addresses(src, sb, sf, 20, T, range(H)), unit_addresses(dst, db, df, 20, T, range(H))
    assert np.array_equal(read_units(src, so), read_units(dst, do))
    mask = written_mask(dst, do)
    assert all(np.array_equal(x[~m], y[~m]) for x, y, m in zip(snapshot(dst), before, mask)), "other bytes changed"
    grid = grid_for(src, heads=(0, H), tokens=(20, T))
    assert np.array_equal(kv_digest(src, sb, sf, grid), kv_digest(dst, db, df, grid))


def test_amx_to_amx_is_few_segments_and_other_layouts_are_refused_directly():
    """Whole 'amx' blocks move as one segment per (layer, block) of K and V of every head;
    a partial block in pieces of 16 and 2 tokens, never one per element; an 'amx' cache
    moves to any other layout only through staging on its own side."""
    a1, a2 = (allocate_pool("vllm", layers=L, total_heads=H, head_dim=HD, dtype="bf16", tokens_per_block=32,
                            num_blocks=8, seed=s, isa="amx") for s in (1, 2))
    plan = plan_transfer(a1, [1, 2, 3, 4], a2, [4, 5, 6, 7], 128)
    assert plan.kind is PlanKind.DIRECT and plan.num_segments <= L * 4, plan.num_segments
    plan = plan_transfer(a1, [1, 2, 3, 4], a2, [4, 5, 6, 7], 127)  # the last block cut at 31 tokens
    assert plan.num_segments <= L * 4 + L * 2 * H * (1 + 15 + 8), plan.num_segments
    assert set(refused_kinds(a1, pool("vllm", 32))) == set(PlanKind) - {PlanKind.STAGED_BOTH}  # strided, differently
    assert set(refused_kinds(a1, pool("sglang", 16))) == {PlanKind.DIRECT, PlanKind.STAGED_RECV}
    with pytest.raises(LayoutError, match="element dims"):
        plan_transfer(a1, [1, 2, 3, 4, 5], pool("vllm", 32), [1, 2, 3, 4, 5], T)
    for bad, why in ((dict(dtype="float32"), "float32"), (dict(tokens_per_block=16), "block size 16"),
                     (dict(head_dim=40), "head size 40")):
        kw = {**dict(layers=1, total_heads=2, head_dim=32, dtype="bf16", tokens_per_block=32, num_blocks=2), **bad}
        with pytest.raises(LayoutError, match=why):
            allocate_pool("vllm", isa="amx", **kw)


def test_vllm_to_vllm_whole_blocks_are_few_segments():
    v1, v2 = pool("vllm", 32, seed=1), pool("vllm", 32, seed=2)
    plan = plan_transfer(v1, [1, 2, 3, 4], v2, [4, 5, 6, 7], 128)
    # one (layer, block) is K and V of every head back to back: at most one segment each
    assert plan.kind is PlanKind.DIRECT and plan.num_segments <= L * 4, plan.num_segments


def test_refusals_name_what_is_wrong():
    v32, v64, s = pool("vllm", 32), pool("vllm", 64), pool("sglang", 16)
    with pytest.raises(LayoutError, match="element dims"):
        plan_transfer(v32, [1, 2, 3, 4, 5], v64, [1, 2, 3], T)
    with pytest.raises(LayoutError, match="element-strided"):
        plan_transfer(s, np.arange(1, 11), v32, [1, 2, 3, 4, 5], T, kinds=(PlanKind.DIRECT, PlanKind.STAGED_SEND))
    with pytest.raises(LayoutError, match="cannot force direct"):
        plan_transfer(v32, [1, 2, 3, 4, 5], s, np.arange(1, 11), T, force=PlanKind.DIRECT)
    assert set(refused_kinds(v32, s)) == {PlanKind.DIRECT, PlanKind.STAGED_RECV}
    assert set(refused_kinds(s, v32)) == {PlanKind.DIRECT, PlanKind.STAGED_SEND}
    assert set(refused_kinds(v32, pool("vllm", 32))) == {PlanKind.STAGED_SEND, PlanKind.STAGED_RECV}
    t = torch.zeros(2, 4, 2, 32, 64)
    with pytest.raises(LayoutError, match="'neon' is not supported"):
        vllm_cpu_layout(list(t.unbind(0)), isa="neon")
    with pytest.raises(LayoutError, match="fp8"):
        vllm_cpu_layout_from_geometry([t.data_ptr()], t[0].numel() * 4, 4, 2, 32, 32, "fp8")
    with pytest.raises(LayoutError, match="not 4 blocks"):
        vllm_cpu_layout_from_geometry([t.data_ptr()], 12345, 4, 2, 32, 32, "float32")


def test_description_round_trip_keeps_row_strides():
    v = pool("vllm", 32)
    d = v.describe()
    assert d["row_strides"] == [[2, 64], [64, 2]]
    back = KVLayout.from_description(d)
    assert back.row_strides == v.row_strides and back.relative_key == v.relative_key
    assert "row_strides" not in pool("sglang", 16).describe()  # other layouts describe as before
    for bad in ([[2, 64]], [[2, 64], [64, 2], [2, 2]], [[0, 64], [64, 2]], [[2.0, 64], [64, 2]], "x",
                [[[[3, 64], [16, 2]], 64], [64, 2]],  # mixed-radix counts that are not the block's 32 tokens
                [[[[2, 64], [16, 2.0]], 64], [64, 2]], [[[[2, 64, 1]], 64], [64, 2]], [[[], 64], [64, 2]]):
        with pytest.raises(LayoutError):
            KVLayout.from_description({**d, "row_strides": bad})
    a = allocate_pool("vllm", layers=L, total_heads=H, head_dim=HD, dtype="bf16", tokens_per_block=32, num_blocks=4,
                      isa="amx")
    back = KVLayout.from_description(a.describe())  # 'amx': mixed-radix token and element dims
    assert back.row_strides == a.row_strides and np.array_equal(back.token_offsets, a.token_offsets)
    wire = P.decode(P.encode(P.TransferRequest(room=1, model="m", layout=P.LayoutDescription.of(a), block_ids=[0],
                                               first_token=0, token_start=0, token_stop=1, session="s", sent_at=0.0)))
    back = wire.layout.to_layout()  # the typed description off the wire carries them too
    assert back.row_strides == a.row_strides and np.array_equal(back.token_offsets, a.token_offsets)
    with pytest.raises(LayoutError, match="tokens_per_block 1099511627776 is over"):
        KVLayout.from_description({**d, "tokens_per_block": 2**40})


def test_demo_engines():
    """``kvbridge demo`` engine choice: the defaults and --reverse as before, named pairs."""
    from kvbridge.demo.run import DemoError, engines

    assert engines(None, None, False) == ("sglang", "trtllm")
    assert engines(None, None, True) == ("trtllm", "sglang")
    assert engines("sglang", "vllm", False) == ("sglang", "vllm")
    assert engines("vllm", None, False) == ("vllm", "sglang")
    assert engines(None, "vllm", False) == ("sglang", "vllm")
    with pytest.raises(DemoError, match="--reverse"):
        engines("vllm", "sglang", True)
    with pytest.raises(DemoError, match="not sglang->sglang"):
        engines("sglang", "sglang", False)


@requires_vllm
def test_bench_vllm_says_why_the_anchor_cannot_run():
    """``kvbridge bench vllm``: vLLM's MooncakeConnector cannot start on a CPU-only host;
    the suite names the line of vLLM's source and the error (not a made-up ratio)."""
    import json
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "vllm", "--json"], capture_output=True,
                         text=True, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and r["ran"] is False, r
    assert r["probe"]["uses_accelerator"] and "accelerator" in r["probe"]["error"], r
    assert "mooncake_connector.py:" in r["reason"] and "current_device_index" in r["reason"]


def test_vllm_server_asks_for_cpu_mla_for_an_mla_model(tmp_path):
    """The demo's vLLM command line names CPU_MLA for a model with latent attention (on AMX
    hosts vLLM would pick AMX_MLA: float32 weights refused at load, a cache layout kvbridge
    does not describe), and no backend for any other model or when the caller names one."""
    import json as _json

    from kvbridge.demo.vllm_server import server_argv

    def argv(config, extra_args=()):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(_json.dumps(config))
        return server_argv("python", d, 1, "kv_both", {}, block_size=16, kv_cache_bytes=1 << 20, dtype="float32",
                           failure_policy="recompute", prefix_caching=False, extra_args=extra_args)

    mla = argv({"model_type": "deepseek_v2", "kv_lora_rank": 512})
    assert mla[mla.index("--attention-backend") + 1] == "CPU_MLA"
    assert "--attention-backend" not in argv({"model_type": "llama", "num_key_value_heads": 2})
    assert "--attention-backend" not in argv({"model_type": "deepseek_v2", "kv_lora_rank": None})
    named = argv({"kv_lora_rank": 512}, extra_args=("--attention-backend", "CPU_MLA"))
    assert named.count("--attention-backend") == 1


@requires_vllm
def test_every_kv_cache_layout_of_vllm_moves_to_and_from_sglang_and_trtllm():
    """vLLM's own allocation code lays one buffer out in each of ``KVCacheLayout``'s six
    stride orders (attention and MLA); known K/V written through the logical view as
    FLASH_ATTN reads it reach an SGLang and a TensorRT-LLM pool element for element (read by
    those engines' indexing), and SGLang's KV comes back into other vLLM blocks with every
    other (block, token) untouched (tests/helpers/vllm_scripts/logical_layouts.py)."""
    r = run_script("logical_layouts.py")
    names = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
    assert set(r) == {f"{k} {n}" for k in ("mha", "mla") for n in names}, sorted(r)
    for case, res in r.items():
        assert res.pop("block_outermost") == case.split()[1].startswith("B"), case
        assert all(res.values()) and set(res) == {"to_sglang", "to_trtllm", "from_sglang", "untouched_elsewhere"}, \
            (case, res)


@requires_vllm
def test_fp8_caches_carry_the_scales_vllm_loaded():
    """An fp8 cache of a GPU backend carries the KV scales vLLM's own quantization method
    loaded into each layer: a decode whose layer 1 was calibrated at 0.5 is refused by a
    prefill at 1.0, naming the layer and both scales; equal scales are compatible
    (tests/helpers/vllm_scripts/fp8_scales.py)."""
    r = run_script("fp8_scales.py")
    assert r["dtype"] == "float8_e4m3fn" and r["decode_scales"] == [[1.0, 1.0], [0.5, 0.5]], r
    assert "layer 1 K head 0: source 1 != destination 0.5" in r["refused"], r
    assert r["same_ok"] is True, r
