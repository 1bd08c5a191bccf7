"""The cross-engine compatibility matrix, every cell byte-exact.

{SGLang->SGLang, SGLang->TRT-LLM, TRT-LLM->SGLang, TRT-LLM->TRT-LLM} x {GQA, MLA} x
{SGLang page 1/16/64 against tokens_per_block 32/64} x {TP 1->1, 2->1, 1->2} x
{bf16, fp8}, each moved whole and layer by layer (a plan per layer between
``KVLayout.layer_range`` views, as a layer-wise send makes them), and vLLM (CPU backends) to and from each of them and itself in bf16: GQA
with blocks of 32/64 (CPU_ATTN: multiples of 32), MLA with blocks of 16 (CPU_MLA's only
size); vLLM's CPU fp8 cache is not modelled; vLLM -> vLLM of other block sizes stages on
both sides (``staged_both``). SGLang sides are SGLang's REAL pools (MHATokenToKVPool /
MLATokenToKVPool); TensorRT-LLM and vLLM sides are pools of their exact geometry (the
vLLM one read back through vLLM's own indexing rule, ``engine_kv.kv_addresses``,
and checked against vLLM's kernel in tests/vllm/test_vllm_layout.py). Each cell moves a
request (with a prefix the receiver holds) from every source rank to every destination
rank that shares heads with it, with the plan kvbridge chooses (and the gather/scatter
kernels when it stages), and checks every byte of every destination rank and that
nothing else changed. Every expected byte address comes from the engine's own indexing
over its own tensors (``tests/helpers/engine_kv.kv_addresses``), never from ``KVLayout``.
Cells that cannot apply are marked, not dropped; the matrix is printed at the end of the
run (conftest.py). The cells move bytes with memmove; every engine pair also moves them
through Mooncake TCP between OS processes, read back by each engine's own indexing rule,
once per geometry class: GQA bf16 TP 1 -> 1 whole and layer by layer
(``test_one_cell_per_engine_pair_through_mooncake``), MLA, fp8, TP 2 -> 1 and TP 1 -> 2
(``test_every_geometry_class_per_engine_pair_through_mooncake``).
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch

from kvbridge.layout import (HeadMap, PlanKind, allocate_pool, grid_for, kv_digest, plan_transfer, sglang_mha_layout,
                             sglang_mla_layout, tp_head_slice)
from tests.helpers.kvhelpers import fill_random, read_units, run_plan, snapshot, unit_addresses, written_mask

MATRIX: dict[tuple, str] = {}

PAIRS = [("sglang", "sglang"), ("sglang", "trtllm"), ("trtllm", "sglang"), ("trtllm", "trtllm"),
         ("vllm", "vllm"), ("vllm", "sglang"), ("sglang", "vllm"), ("vllm", "trtllm"), ("trtllm", "vllm")]
PAGES = {"sglang": [1, 16, 64], "trtllm": [32, 64], "vllm": [16, 32, 64]}
TPS = [(1, 1), (2, 1), (1, 2)]
LAYERS, HEADS, HEAD_DIM, MLA_DIM, TOKENS, PREFIX = 2, 4, 16, 24, 150, 20


def page_pairs(src, dst):
    if src == dst == "sglang":  # SGLang's scheduler requires equal page sizes on both sides
        return [(p, p) for p in PAGES[src]]
    return list(itertools.product(PAGES[src], PAGES[dst]))


def applies(s, d, attn, dt, sp, dp) -> bool:
    """vLLM's CPU caches: bf16; GQA with blocks of 32/64, MLA with blocks of 16 (see the
    module docstring)."""
    for eng, page in ((s, sp), (d, dp)):
        if eng == "vllm" and (dt != "bf16" or (page == 16) != (attn == "MLA")):
            return False
    return True


CELLS = [(s, d, attn, sp, dp, tp, dt) for s, d in PAIRS for attn in ("GQA", "MLA") for sp, dp in page_pairs(s, d)
         for tp in TPS for dt in ("bf16", "fp8") if applies(s, d, attn, dt, sp, dp)]
NOT_APPLICABLE = {(s, d, sp, dp) for s, d in PAIRS if s == d == "sglang"
                  for sp, dp in itertools.product(PAGES[s], PAGES[s]) if sp != dp}


def make(engine, pools, *, attn, dtype, page, tp, rank, seed):
    MHA, MLA = pools
    mla = attn == "MLA"
    blocks = -(-TOKENS // page) + 3
    if engine == "vllm":
        return allocate_pool("vllm", layers=LAYERS, total_heads=HEADS, head_dim=MLA_DIM if mla else HEAD_DIM,
                             dtype=dtype, tokens_per_block=page, num_blocks=blocks, tp_size=tp, tp_rank=rank, mla=mla,
                             seed=seed)
    if engine == "trtllm":
        return allocate_pool("trtllm", layers=LAYERS, total_heads=HEADS, head_dim=MLA_DIM if mla else HEAD_DIM,
                             dtype=dtype, tokens_per_block=page, num_blocks=blocks, tp_size=tp, tp_rank=rank, mla=mla,
                             seed=seed)
    tdtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    if mla:
        pool = MLA(size=blocks * page, page_size=page, dtype=tdtype, kv_lora_rank=MLA_DIM - 8, qk_rope_head_dim=8,
                   layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        lay = sglang_mla_layout(pool)
    else:
        pool = MHA(size=blocks * page, page_size=page, dtype=tdtype, head_num=tp_head_slice(HEADS, tp, rank)[1],
                   head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        lay = sglang_mha_layout(pool, tp_rank=rank, tp_size=tp, total_heads=HEADS)
    fill_random(lay, seed)
    return lay


def plan_layers(s, sblocks, d, dblocks, tokens, mode):
    """The plans that move ``tokens``: one for every layer (``whole``), or one per layer
    between the two pools' views of that layer (``layerwise``)."""
    if mode == "whole":
        return [plan_transfer(s, sblocks, d, dblocks, tokens, kinds=tuple(PlanKind))]
    return [plan_transfer(s.layer_range(i, i + 1), sblocks, d.layer_range(i, i + 1), dblocks, tokens,
                          kinds=tuple(PlanKind)) for i in range(s.num_layers)]


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: "-".join(map(str, c)))
def test_matrix_cell(sglang_pools, cell, mode):
    src_eng, dst_eng, attn, sp, dp, (stp, dtp), dtype = cell
    key = cell if mode == "whole" else cell + ("layerwise",)
    rng = np.random.default_rng(zlib.crc32(repr(cell).encode()))
    mla = attn == "MLA"
    srcs = [make(src_eng, sglang_pools, attn=attn, dtype=dtype, page=sp, tp=stp, rank=r, seed=10 + r) for r in range(stp)]
    dsts = [make(dst_eng, sglang_pools, attn=attn, dtype=dtype, page=dp, tp=dtp, rank=r, seed=20 + r) for r in range(dtp)]
    sblocks = [rng.permutation(np.arange(s.first_block, s.num_blocks))[: -(-TOKENS // sp)] for s in srcs]
    kinds_used = set()
    try:
        for d in dsts:
            dblocks = rng.permutation(np.arange(d.first_block, d.num_blocks))[: -(-TOKENS // dp)]
            before = snapshot(d)
            masks = None
            # each destination rank pulls its heads from every source rank that holds some
            # (MLA: the latent is replicated on every rank; one source suffices)
            senders = [i for i, s in enumerate(srcs)
                       if set(s.heads) & set(d.heads)][: 1 if mla else None]
            for i in senders:
                s = srcs[i]
                for plan in plan_layers(s, sblocks[i], d, dblocks, (PREFIX, TOKENS), mode):
                    kinds_used.add(plan.kind.value)
                    run_plan(plan)
                hm = HeadMap.between(s, d)
                so = unit_addresses(s, sblocks[i], 0, PREFIX, TOKENS, range(hm.src_start, hm.src_start + hm.count))
                do = unit_addresses(d, dblocks, 0, PREFIX, TOKENS, range(hm.dst_start, hm.dst_start + hm.count))
                assert np.array_equal(read_units(s, so), read_units(d, do)), f"rank {i} -> {d.head_offset}: wrong bytes"
                # integrity: the content digest each side takes of the moved rows agrees (per layer, layer by layer)
                spans = [(0, LAYERS)] if mode == "whole" else [(a, a + 1) for a in range(LAYERS)]
                for a, b in spans:
                    g = grid_for(s, heads=(hm.global_start, hm.count), tokens=(PREFIX, TOKENS), layers=(a, b))
                    assert np.array_equal(kv_digest(s, sblocks[i], 0, g), kv_digest(d, dblocks, 0, g)), \
                        f"rank {i} -> {d.head_offset}: content digests differ (layers {a}..{b})"
                m = written_mask(d, do)
                masks = m if masks is None else [x | y for x, y in zip(masks, m)]
            covered = sum(int(m.sum()) for m in masks)
            assert covered == LAYERS * (1 if mla else 2) * (TOKENS - PREFIX) * d.num_heads * d.head_bytes, "heads missing"
            after = snapshot(d)
            assert all(np.array_equal(a[~m], b[~m]) for a, b, m in zip(after, before, masks)), "other bytes changed"
    except AssertionError as e:
        MATRIX[key] = "FAIL"
        raise AssertionError(f"{cell}: {e}") from None
    MATRIX[key] = "ok " + "+".join(sorted(k.replace("staged_", "s_") for k in kinds_used)) + " ="


def format_matrix() -> list[str]:
    """The matrix as text: per engine pair, a row per attention x TP x dtype and a column
    per (source page, destination page) pairing."""
    if not MATRIX:
        return []
    cells = set(CELLS)
    lines = []
    for s, d in PAIRS:
        cols = list(itertools.product(PAGES[s], PAGES[d]))
        head = f"{s + ' -> ' + d:<18}{'attn':<5}{'TP':<6}{'dtype':<6}" + "".join(f"{f'page {a}->{b}':>20}" for a, b in cols)
        lines += ["", head, "-" * len(head)]
        for attn, tp, dt in itertools.product(("GQA", "MLA"), TPS, ("bf16", "fp8")):
            row = f"{'':<18}{attn:<5}{f'{tp[0]}->{tp[1]}':<6}{dt:<6}"
            for a, b in cols:
                key = (s, d, attn, a, b, tp, dt)
                v = ("n/a (pages)" if (s, d, a, b) in NOT_APPLICABLE else MATRIX.get(key, "not run") if key in cells
                     else "n/a (vLLM)" if not applies(s, d, attn, dt, a, b) else "n/a")
                lw = MATRIX.get(key + ("layerwise",))
                if key in cells and lw is not None:
                    v += " lw" if lw.startswith("ok") else " LW-FAIL"
                row += f"{v:>20}"
            lines.append(row)
    lines += ["", "ok <kinds> =: byte-exact, moved by those plan kinds (s_send = staged_send, s_recv = staged_recv, "
              "s_both = staged_both), "
              "and the content digests of both sides equal (the integrity check, kvbridge.layout.digest); "
              "lw: also byte-exact moved layer by layer (a plan per layer). "
              "n/a (pages): SGLang requires equal page sizes on both sides. "
              "n/a (vLLM): vLLM's CPU caches: no fp8; GQA blocks are multiples of 32, MLA blocks are 16."]
    return lines


# -- one cell per engine pair through Mooncake, between two OS processes -------------------
MOONCAKE_PAGE = {"sglang": 16, "trtllm": 32, "vllm": 32}  # vLLM -> vLLM needs equal blocks
MOONCAKE_TOKENS, MOONCAKE_PREFIX = 150, 20
_CFG = dict(deadline_s=20.0, heartbeat_s=0.2, peer_timeout_s=2.0, quiesce_s=1.0, chunk_bytes=1 << 20, integrity="on")


def _peer_spec(engine: str, seed: int) -> dict:
    return dict(engine=engine, layers=LAYERS, total_heads=HEADS, tp=1, rank=0, head_dim=HEAD_DIM, dtype="bf16",
                tpb=MOONCAKE_PAGE[engine], blocks=2 * (-(-MOONCAKE_TOKENS // MOONCAKE_PAGE[engine])) + 4, seed=seed)


@pytest.fixture(scope="module")
def mooncake_peers():
    """A prefill and a decode peer process per engine (tests/helpers/handoff_peers.py), each with a
    pool of that engine's format and a real Mooncake transport on 127.0.0.1."""
    from tests.helpers import handoff_peers
    from tests.helpers.kvhelpers import PipePeer

    peers: dict = {}
    try:
        for i, eng in enumerate(PAGES):
            peers["prefill", eng] = PipePeer(handoff_peers.prefill_main, _peer_spec(eng, 100 + i), _CFG)
            # a vLLM decode offers staging as its adapter does (its K rows are element-strided)
            staging = {"recv_staging_bytes": 4 << 20} if eng == "vllm" else {}
            peers["decode", eng] = PipePeer(handoff_peers.decode_main, _peer_spec(eng, 200 + i), {**_CFG, **staging})
        yield peers
    finally:
        for p in peers.values():
            p.stop()


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "->".join(p))
def test_one_cell_per_engine_pair_through_mooncake(mooncake_peers, pair, layerwise):
    """GQA bf16, TP 1 -> 1, each engine's page size: the prefill process serves a room in two
    chunks, the decode process pulls it over Mooncake TCP (holding the first 20 tokens
    already) into scattered blocks. The destination's K/V, read back by the destination
    engine's own indexing rule, equals the source's, read by the source engine's rule
    (tests/helpers/engine_kv.py, independent of ``KVLayout``); both pools get every block back.
    ``layerwise``: each chunk's layers are handed to the sender one at a time."""
    src, dst = pair
    pre, dec = mooncake_peers["prefill", src], mooncake_peers["decode", dst]
    room = 7000 + PAIRS.index(pair) + (100 if layerwise else 0)
    if layerwise:
        _, sblocks, pieces, _ = pre.call("serve_layers", room, MOONCAKE_TOKENS, 96, {})
        assert pieces == 2 * LAYERS
    else:
        sblocks = pre.call("serve", room, MOONCAKE_TOKENS, 96)[1]
    res = dec.call("pull", room, [pre.ready[1]], MOONCAKE_PREFIX, MOONCAKE_TOKENS, 1, [(pre.spec, sblocks)],
                   {"scattered": True}, timeout=90)[1]
    done = pre.call("wait", room, 30)
    assert res["state"] == "SUCCESS" and done[1] == "SUCCESS", (res["reason"], done[2])
    positions = list(range(MOONCAKE_PREFIX, MOONCAKE_TOKENS))
    want = pre.call("engine_read", sblocks, positions)[1]
    got = dec.call("engine_read", res["blocks"], positions)[1]
    assert got.shape == want.shape == (LAYERS, 2, len(positions), HEADS, HEAD_DIM * 2), got.shape
    assert np.array_equal(got, want), f"{src} -> {dst}: the decode engine reads other K/V than the prefill wrote"
    assert res["bytes_ok"] and res["untouched_ok"], res  # the decode peer's own check: nothing else changed
    assert res["record"]["bytes"] == res["written_bytes"] == want.nbytes, res["record"]
    assert res["record"]["digest_s"] > 0, "the decode did not compare the room's content digest"
    assert done[4] == pre.ready[2] and done[5] == 0, "prefill blocks not all back once"
    assert dec.call("free")[1:] == (dec.ready[2], 0), "decode blocks not all back once"


# -- every geometry class of every engine pair through Mooncake ----------------------------
CLASSES = {  # class: (prefill TP, decode TP, attention, dtype)
    "MLA": (1, 1, "MLA", "bf16"), "fp8": (1, 1, "GQA", "fp8"), "TP2->1": (2, 1, "GQA", "bf16"),
    "TP1->2": (1, 2, "GQA", "bf16")}
GEOMETRY_CELLS = [(pair, cls) for cls in CLASSES for pair in PAIRS
                  if not (cls == "fp8" and "vllm" in pair)]  # vLLM's CPU caches: no fp8


def _class_spec(engine: str, cls: str, tp: int, rank: int, seed: int) -> dict:
    mla = CLASSES[cls][2] == "MLA"
    page = 16 if mla and engine == "vllm" else MOONCAKE_PAGE[engine]  # CPU_MLA's only block size
    return dict(_peer_spec(engine, seed), tp=tp, rank=rank, mla=mla, dtype=CLASSES[cls][3], tpb=page,
                head_dim=MLA_DIM if mla else HEAD_DIM,
                blocks=2 * (-(-MOONCAKE_TOKENS // page)) + 4)


@pytest.fixture(scope="module")
def class_peers():
    """Peer processes by spec, started on first use; a class's peers are stopped when the
    next class starts (at most one class's processes alive at a time)."""
    from tests.helpers import handoff_peers
    from tests.helpers.kvhelpers import PipePeer

    live: dict = {}
    state = {"cls": None}

    def get(role: str, engine: str, cls: str, tp: int, rank: int):
        if state["cls"] != cls:
            for p in live.values():
                p.stop()
            live.clear()
            state["cls"] = cls
        key = (role, engine, tp, rank)
        if key not in live:
            spec = _class_spec(engine, cls, tp, rank, (100 if role == "prefill" else 200) + 10 * rank
                               + list(MOONCAKE_PAGE).index(engine))
            cfg = {**_CFG, **({"recv_staging_bytes": 4 << 20} if role == "decode" and engine == "vllm" else {})}
            live[key] = PipePeer(handoff_peers.prefill_main if role == "prefill" else handoff_peers.decode_main,
                                 spec, cfg)
        return live[key]

    yield get
    for p in live.values():
        p.stop()


@pytest.mark.parametrize("cell", GEOMETRY_CELLS, ids=lambda c: f"{'->'.join(c[0])}-{c[1]}")
def test_every_geometry_class_per_engine_pair_through_mooncake(class_peers, cell):
    """MLA, fp8, TP 2 -> 1 and TP 1 -> 2 for every engine pair (GQA bf16 TP 1 -> 1 is the
    test above), over Mooncake TCP between OS processes, each engine at its own page size:
    every decode rank's K/V (or latent), read by the decode engine's own indexing, equals
    the slice of heads the engines' TP rule gives it (contiguous head ranges per rank) of
    what the prefill ranks hold, read by the prefill engine's indexing; every block of
    both sides comes back once."""
    (src, dst), cls = cell
    stp, dtp, attn, _ = CLASSES[cls]
    mla = attn == "MLA"
    room = 9000 + GEOMETRY_CELLS.index(cell)
    pres = [class_peers("prefill", src, cls, stp, r) for r in range(stp)]
    decs = [class_peers("decode", dst, cls, dtp, r) for r in range(dtp)]
    sblocks = [p.call("serve", room, MOONCAKE_TOKENS, 96)[1] for p in pres]
    heads = 1 if mla else HEADS
    for r, d in enumerate(decs):  # every decode rank asks at once, as a TP group does
        own = range(r * heads // dtp, (r + 1) * heads // dtp) if not mla else range(1)
        senders = [i for i in range(stp) if mla and i == 0 or not mla and
                   set(own) & set(range(i * heads // stp, (i + 1) * heads // stp))]
        d.conn.send(("pull", room, [pres[i].ready[1] for i in senders], MOONCAKE_PREFIX, MOONCAKE_TOKENS, dtp,
                     [(pres[i].spec, sblocks[i]) for i in senders], {"scattered": True, "timeout": 60}))
    results = [d.call(timeout=90)[1] for d in decs]
    positions = list(range(MOONCAKE_PREFIX, MOONCAKE_TOKENS))
    want = np.concatenate([p.call("engine_read", b, positions)[1] for p, b in zip(pres, sblocks)][: 1 if mla else None],
                          axis=3)  # [layers, kv, T, all heads (rank order), row bytes]
    for r, (d, res) in enumerate(zip(decs, results)):
        assert res["state"] == "SUCCESS", (cls, r, res["reason"])
        got = d.call("engine_read", res["blocks"], positions)[1]
        lo, hi = (0, 1) if mla else (r * heads // dtp, (r + 1) * heads // dtp)
        assert np.array_equal(got, want[:, :, :, lo:hi]), f"{src} -> {dst} {cls}: decode rank {r} reads other KV"
        assert res["bytes_ok"] and res["untouched_ok"], res
        assert res["record"]["digest_s"] > 0, "the decode did not compare the room's content digest"
        assert d.call("free")[1:] == (d.ready[2], 0), "decode blocks not all back once"
    for p in pres:
        done = p.call("wait", room, 30)
        assert done[1] == "SUCCESS" and done[4] == p.ready[2] and done[5] == 0, done[1:3]
