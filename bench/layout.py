"""``kvbridge bench layout``: plan compile time and repack bandwidth, as ratios from one run.

Geometry of the headline case: 32 layers, 8 KV heads, head_dim 128, bf16, SGLang page
64 (NHD, per-layer K/V tensors) -> TensorRT-LLM tokens_per_block 32 (HND, one pool).
Plans are compiled over addresses only (no memory needed for 32K tokens); the repack
runs on real tensors of a smaller request and is compared with a memcpy of the same
bytes by as many threads (the sender's gather, one thread: a one-thread copy of the same
parts into the same ring; a gather spread over every core: torch's copy on all of them),
interleaved in the same run (the order rotated each repetition, after ``warmup_reps``
untimed ones): every ratio is the median of per-repetition ratios, with its p10-p90. The
cold ratio: a plan's gathers built on the spot into a staging ring never touched, against
a memcpy of the same bytes into such a ring. The content digest (``digest``: integrity on)
of the same tokens in the SGLang pool and in a TensorRT-LLM pool, on one thread and on
every thread, in GB/s. What the machine imposes (THP policy, CPUs,
governor, threads, load, the share of the memory bandwidth one thread gets) is in
``machine`` and the JSON; the ``warnings`` name it, and any ratio whose spread is wider
than its effect.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from kvbridge.bench.machine import copy_parts_one_thread, copy_parts_split, machine_notes, spread
from kvbridge.common.copy_choice import choose, copy_split
from kvbridge.common.settings import BridgeSettings, HandoffConfig
from kvbridge.layout.geometry import dtype_itemsize
from kvbridge.layout.plan import PlanKind, plan_transfer
from kvbridge.layout.repack import Gather, row_addresses
from kvbridge.layout.segments import count_segments
from kvbridge.layout.sglang_pool import sglang_layout_from_buffers
from kvbridge.layout.tiles import native_tile_copy
from kvbridge.layout.trtllm_pool import trtllm_layout_from_geometry

__all__ = ["bench_layout", "bench_vllm_cpu"]


def _sglang_buffers(layers: int, heads: int, head_dim: int, page: int, pages: int, dtype: str):
    """Per-layer K and V tensors of SGLang's MHA geometry ``[pages * page, heads, head_dim]``."""
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ts = [torch.empty(pages * page, heads, head_dim, dtype=tdtype) for _ in range(2 * layers)]
    for t in ts:
        t.view(torch.int16).random_()
    return ts


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(cases: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Each case run ``warmup`` times untimed (first touch of every page, caches and thread
    pools warm), then timed ``reps`` times, interleaved: every repetition runs every case,
    in an order rotated by one each repetition. Seconds per case."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    t: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for i in range(reps):
        for k in names[i % len(names):] + names[: i % len(names)]:
            t[k].append(_timed(cases[k]))
    return t


def bench_layout(
    *,
    layers: int = 32,
    heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    src_page: int = 64,
    dst_tokens_per_block: int = 32,
    plan_tokens: int = 32768,
    repack_tokens: int = 4096,
    reps: int = 5,
    chunk_bytes: int = BridgeSettings.chunk_bytes,  # the sender's pipeline, as it runs by default
    part_bytes: int = HandoffConfig.part_bytes,
    ring_parts: int = HandoffConfig.ring_parts,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    keep: dict | None = None,
) -> dict:
    """Run the layout benchmark; returns a JSON-ready dict (see module docstring).
    ``keep``: filled with the repack's inputs and output for a check outside the bench
    (``src_tensors``: the 2 x layers SGLang tensors ``[pages * page, heads, head_dim]``, K of
    every layer then V; ``src_pages``, ``dst_blocks``; ``plan``: the staged plan, whose
    destination is addresses only; ``staging``: what the whole-request gather wrote)."""
    say = progress or (lambda _msg: None)
    rng = np.random.default_rng(seed)
    item = dtype_itemsize(dtype)

    # -- plan compile time over addresses only (32K tokens) ---------------------------
    say(f"planning {plan_tokens} tokens")
    pages = plan_tokens // src_page + 8
    page_bytes = src_page * heads * head_dim * item
    ptrs = [0x100000000 + i * (pages * page_bytes + 4096) for i in range(2 * layers)]
    src = sglang_layout_from_buffers(ptrs, [pages * page_bytes] * (2 * layers), [page_bytes] * (2 * layers),
                                     src_page, heads, heads, dtype)
    nblk = plan_tokens // dst_tokens_per_block + 8
    dst = trtllm_layout_from_geometry(0x7F0000000000, nblk, layers, 2, heads, dst_tokens_per_block, head_dim, dtype)
    sb = rng.permutation(np.arange(1, pages))[: plan_tokens // src_page]
    db = rng.permutation(np.arange(nblk))[: plan_tokens // dst_tokens_per_block]
    plan = plan_transfer(src, sb, dst, db, plan_tokens)  # warm-up
    times = [_timed(lambda: plan_transfer(src, sb, dst, db, plan_tokens)) for _ in range(max(reps, 5))]
    direct = plan.estimates.get(PlanKind.DIRECT)
    seg_direct = direct.segments if direct else count_segments(plan.spec)
    seg_staged = plan.estimates[PlanKind.STAGED_SEND].segments
    contiguous = plan_transfer(src, sb, dst, np.arange(plan_tokens // dst_tokens_per_block), plan_tokens)

    # -- repack bandwidth on real tensors, against a torch copy of the same bytes ------
    say(f"repacking {repack_tokens} tokens")
    rpages = repack_tokens // src_page + 2
    ts = _sglang_buffers(layers, heads, head_dim, src_page, rpages, dtype)
    rsrc = sglang_layout_from_buffers([t.data_ptr() for t in ts], [t.nbytes for t in ts],
                                      [page_bytes] * (2 * layers), src_page, heads, heads, dtype, tensors=ts)
    rnblk = repack_tokens // dst_tokens_per_block
    rdst = trtllm_layout_from_geometry(0x7F0000000000, rnblk + 4, layers, 2, heads, dst_tokens_per_block, head_dim, dtype)
    rsb = rng.permutation(np.arange(1, rpages))[: repack_tokens // src_page]
    rdb = rng.permutation(np.arange(rnblk + 4))[:rnblk]
    rplan = plan_transfer(rsrc, rsb, rdst, rdb, repack_tokens, force=PlanKind.STAGED_SEND)
    nbytes = rplan.nbytes
    t0 = time.perf_counter()
    chunks = rplan.chunks(chunk_bytes)
    gathers = [c.gather().prepare() for c in chunks]  # every row index up front: prepare_ms, not repack time
    prepare_s = time.perf_counter() - t0
    ring = torch.empty(ring_parts * part_bytes, dtype=torch.uint8)

    def parts_of(gs):
        return [(g, a, min(g.rows, a + part_bytes // g.row_bytes)) for g in gs
                for a in range(0, g.rows, part_bytes // g.row_bytes)]

    parts = parts_of(gathers)
    rows_only = parts_of([Gather(c.spec, tiles=False).prepare() for c in chunks])  # the fallback, same bytes
    torch_tiles = parts_of([Gather(c.spec, native=False).prepare() for c in chunks])  # box path, torch's copies
    whole = rplan.gather()
    whole_stage = torch.empty(nbytes, dtype=torch.uint8)
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    b.random_(0, 255)

    def chunked(inline: bool | None = None, ps=parts, into=ring, split=None) -> None:
        for k, (g, a, b) in enumerate(ps):  # as KVSender's pipeline: parts into the regions of its ring in turn
            g.run(into[(k % ring_parts) * part_bytes:], rows=(a, b), inline=inline, split=split)

    def memcpy_one(into=ring) -> None:  # the same bytes part by part into the same ring, one thread
        copy_parts_one_thread(into, b, part_bytes, ring_parts)

    # every thread on the C copies: the gather as the sender runs it where the transport leaves
    # the CPU free (copy_choice), and the same streamed memcpy split the same way
    threads = torch.get_num_threads()
    split, split_pool = copy_split(threads, "bench-split")

    def memcpy_split(into=ring) -> None:
        copy_parts_split(into, b, part_bytes, ring_parts, split)

    cases = {"memcpy": lambda: a.copy_(b), "memcpy_one": memcpy_one, "memcpy_split": memcpy_split,
             "repack_split": lambda: chunked(split=split),  # KVSender's gather on every thread
             "repack": chunked,  # KVSender's gather
             "repack_rows": lambda: chunked(ps=rows_only),
             "repack_torch": lambda: chunked(ps=torch_tiles),
             "repack_inline": lambda: chunked(inline=True), "repack_whole": lambda: whole.run(whole_stage)}
    warmup = max(1, reps // 5)  # reported, not timed
    t = _interleaved(cases, reps, warmup)
    names = list(cases)

    # cold: a plan's gathers built on the spot into a staging ring never touched, against a
    # memcpy into a buffer never touched (both pay first-touch faults), interleaved
    cold_reps = max(3, reps // 3)
    t_cold = {"memcpy": [], "repack": []}
    for i in range(cold_reps):
        def cold_copy():  # the same bytes through a fresh ring of the same size, part by part, one thread
            memcpy_one(into=torch.empty(ring_parts * part_bytes, dtype=torch.uint8))

        def cold_repack():  # as the sender's: one thread
            fresh = torch.empty(ring_parts * part_bytes, dtype=torch.uint8)
            chunked(ps=parts_of([c.gather() for c in rplan.chunks(chunk_bytes)]), into=fresh)
        for k, fn in ((("memcpy", cold_copy), ("repack", cold_repack)) if i % 2 == 0 else
                      (("repack", cold_repack), ("memcpy", cold_copy))):
            t_cold[k].append(_timed(fn))
    digest = _bench_digest(rsrc, rsb, layers, heads, head_dim, dtype, dst_tokens_per_block, repack_tokens, reps, split)
    copy_s, rep_s, whole_s = (statistics.median(t[k]) for k in ("memcpy", "repack", "repack_whole"))
    inline_s, rows_s = statistics.median(t["repack_inline"]), statistics.median(t["repack_rows"])
    # each gather against a memcpy by as many threads: the sender's (one thread) and the inline
    # one against a one-thread copy of the same parts into the same ring; the others, which
    # spread over every core, against torch's copy on all of them
    if split_pool is not None:
        split_pool.shutdown()
    one_thread = ("repack", "repack_inline")
    ratios = {k: spread([c / r for c, r in zip(t["memcpy_one" if k in one_thread else "memcpy"], t[k])], 1.0)
              for k in names if not k.startswith("memcpy")}
    # the gather at its fastest (every thread where there are several: the choice beside RDMA /
    # NVLink) against the fastest copy of the same bytes this host offers, per repetition
    copies = ("memcpy", "memcpy_one", "memcpy_split")
    fastest = [min(t[k][i] for k in copies) for i in range(reps)]
    best_gather = "repack_split" if split is not None else "repack"
    ratios["gather_best"] = spread([f / r for f, r in zip(fastest, t[best_gather])], 1.0)
    fastest_copy = min(copies, key=lambda k: statistics.median(t[k]))
    ratios["repack_all_threads"] = spread([c / r for c, r in zip(t["memcpy"], t["repack"])], 1.0)
    one_s = statistics.median(t["memcpy_one"])
    one_share = spread([c / o for c, o in zip(t["memcpy"], t["memcpy_one"])], 1.0)  # one thread's share of all
    cold_ratio = spread([c / r for c, r in zip(t_cold["memcpy"], t_cold["repack"])], 1.0)
    warnings = [f"{k}_ratio: p10-p90 {v['p10']}-{v['p90']} is wider than its distance from 1 ({v['median']}): "
                "noise as large as the effect" for k, v in ratios.items() if v["wide"]]
    machine = machine_notes()
    if one_share["median"] < 0.8 and torch.get_num_threads() > 1:
        warnings.append(
            f"one thread copies at {one_share['median']} of {torch.get_num_threads()} threads' speed here "
            f"({nbytes / one_s / 1e9:.1f} against {nbytes / copy_s / 1e9:.1f} GB/s): the machine bounds a one-thread "
            "gather (the sender's) at that share of an all-thread memcpy; repack_ratio holds it to a one-thread "
            "memcpy, repack_all_threads_ratio to all threads")
    # the bytes are right: staging row i is the destination's i-th row, read from the source
    check = _check_gather(rplan, whole_stage)
    if keep is not None:
        keep.update(src_tensors=ts, src_pages=rsb, dst_blocks=rdb, plan=rplan, staging=whole_stage)

    say("vLLM CPU caches per ISA")
    vllm_cpu = bench_vllm_cpu(tokens=max(64, repack_tokens // 64 * 64), reps=reps, seed=seed)

    # the same repack on CUDA, when there is one
    cuda = None
    if torch.cuda.is_available():
        say("repacking on CUDA")
        cuda = _bench_cuda(rplan, nbytes, reps, whole_stage)

    return {
        "geometry": {"layers": layers, "kv_heads": heads, "head_dim": head_dim, "dtype": dtype,
                     "src": f"sglang page {src_page} (NHD)", "dst": f"trtllm tokens_per_block {dst_tokens_per_block} (HND)"},
        "plan_tokens": plan_tokens,
        "plan_ms_32k": round(statistics.median(times) * 1e3, 3),
        "plan_kind": plan.kind.value,
        "plan_reason": plan.explain(),
        "segments_direct": int(seg_direct),
        "segments_staged": int(seg_staged),
        "segments_staged_contiguous_dst": int(contiguous.num_segments),
        "repack_tokens": repack_tokens,
        "repack_bytes": nbytes,
        "repack_mode": (f"{len(chunks)} chunks of {chunk_bytes >> 20} MiB gathered in {len(parts)} parts of "
                        f"{part_bytes >> 20} MiB into a {ring_parts} x {part_bytes >> 20} MiB staging ring (the sender's pipeline), "
                        + ("each part one call of the C tile copy on the calling thread (as KVSender's gather); "
                           if gathers[0].native else "parts over 1 MiB through torch's OpenMP pool (as KVSender's gather); ") +
                        "repack_rows: the row-index fallback; repack_torch: the box path with torch's copies "
                        "(no C tile copy); repack_inline: every copy on the calling thread; "
                        "repack_whole: the whole request in one gather"),
        "repack_path": "box tiles" if gathers[0].box_path else "row index",
        # who copies the tiles: the C tile copy (one thread, pool address order, streamed stores) or torch
        "repack_copy": "C tile copy" if gathers[0].native else "torch",
        "repack_torch_gbps": round(nbytes / statistics.median(t["repack_torch"]) / 1e9, 3),  # box path, torch's copies
        "repack_torch_ratio_spread": ratios["repack_torch"],
        "repack_gbps": round(nbytes / rep_s / 1e9, 3),
        "memcpy_gbps": round(nbytes / copy_s / 1e9, 3),  # torch's copy, all threads
        # the same parts into the same ring, one thread, streamed stores (numpy's memcpy without the C copy)
        "memcpy_one_thread_gbps": round(nbytes / one_s / 1e9, 3),
        "memcpy_one_thread": "C tile copy, streamed stores" if native_tile_copy() else "numpy.copyto",
        "one_thread_copy_share_spread": one_share,  # memcpy time / one-thread memcpy time: what one core can move
        # each ratio: the median over repetitions of (memcpy time / repack time) in the same repetition,
        # against a memcpy by as many threads as the gather uses (see above)
        # the gather on every thread against the fastest copy of the same bytes (any thread count)
        "gather_best_ratio": ratios["gather_best"]["median"],
        "gather_best_ratio_spread": ratios["gather_best"],
        "gather_best": (f"{best_gather}: the sender's gather on {threads if split else 1} thread(s), against the "
                        f"fastest of a torch copy (all threads), a one-thread and a {threads}-thread streamed memcpy "
                        f"of the same parts, per repetition (fastest by median: {fastest_copy})"),
        "repack_split_gbps": round(nbytes / statistics.median(t["repack_split"]) / 1e9, 3),
        "memcpy_split_gbps": round(nbytes / statistics.median(t["memcpy_split"]) / 1e9, 3),
        "gather_choice": {p: vars(choose(p, 0)) for p in ("tcp", "rdma")},
        "repack_ratio": ratios["repack"]["median"],
        "repack_ratio_spread": ratios["repack"],
        "repack_all_threads_ratio": ratios["repack_all_threads"]["median"],  # the sender's gather against all threads
        "repack_all_threads_ratio_spread": ratios["repack_all_threads"],
        "repack_rows_gbps": round(nbytes / rows_s / 1e9, 3),  # the row-index fallback on the same bytes
        "repack_rows_ratio_spread": ratios["repack_rows"],
        "repack_inline_gbps": round(nbytes / inline_s / 1e9, 3),  # every copy on the calling thread
        "repack_inline_ratio_spread": ratios["repack_inline"],
        "repack_whole_gbps": round(nbytes / whole_s / 1e9, 3),
        "repack_whole_ratio": ratios["repack_whole"]["median"],
        "repack_whole_ratio_spread": ratios["repack_whole"],
        "repack_cold_ratio_spread": cold_ratio,
        "cold": ("first run of a plan's gathers built on the spot into a staging ring never touched (one thread, "
                 "as the sender's), against a one-thread memcpy of the same bytes part by part into a ring of the "
                 "same size never touched"),
        "repack_prepare_ms": round(prepare_s * 1e3, 2),
        "digest": digest,
        "reps": reps,
        "warmup_reps": warmup,
        "cold_reps": cold_reps,
        "machine": machine,
        "warnings": machine["warnings"] + warnings,
        "repack_bytes_verified": check,
        "threads": torch.get_num_threads(),
        "cuda": cuda,
        "vllm_cpu": vllm_cpu,
    }


def bench_vllm_cpu(*, layers: int = 8, heads: int = 8, head_dim: int = 128, block_size: int = 32,
                   tokens: int = 4096, reps: int = 5, seed: int = 0) -> dict:
    """vLLM's CPU caches (bfloat16) staged to and from SGLang page 64, per ISA ('vec':
    K transposed; 'amx': tokens and dimensions interleaved), and vLLM 'amx' -> 'vec' of
    the same block size (``staged_both``: a gather and a scatter): each repack's time
    against torch's copy of the same bytes (all threads, as the strided repacks use),
    interleaved in the same run, order rotated each repetition. Every ratio is the median
    of per-repetition ratios (memcpy time / repack time) with its p10-p90; bytes checked
    equal through both sides' digests."""
    from kvbridge.layout import allocate_pool, grid_for, kv_digest

    rng = np.random.default_rng(seed)
    nblk = tokens // block_size
    mk = dict(layers=layers, total_heads=heads, head_dim=head_dim, dtype="bf16")
    vec = allocate_pool("vllm", tokens_per_block=block_size, num_blocks=nblk + 2, seed=seed, isa="vec", **mk)
    amx = allocate_pool("vllm", tokens_per_block=block_size, num_blocks=nblk + 2, seed=seed + 1, isa="amx", **mk)
    sgl = allocate_pool("sglang", tokens_per_block=64, num_blocks=tokens // 64 + 2, seed=seed + 2, **mk)
    vb = {k: rng.permutation(np.arange(1, nblk + 2))[:nblk] for k in ("vec", "amx", "dst")}
    sb = rng.permutation(np.arange(1, tokens // 64 + 2))[: tokens // 64]
    plans = {f"{isa}_gather": plan_transfer(lay, vb[isa], sgl, sb, tokens, force=PlanKind.STAGED_SEND, kinds=tuple(PlanKind))
             for isa, lay in (("vec", vec), ("amx", amx))}
    plans.update({f"{isa}_scatter": plan_transfer(sgl, sb, lay, vb["dst"], tokens, force=PlanKind.STAGED_RECV,
                                                  kinds=tuple(PlanKind)) for isa, lay in (("vec", vec), ("amx", amx))})
    both = plan_transfer(amx, vb["amx"], vec, vb["dst"], tokens, kinds=tuple(PlanKind))
    nbytes = both.nbytes
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a.random_()
    ops = {k: (p.gather() if k.endswith("gather") else p.scatter()) for k, p in plans.items()}
    g_both, s_both = both.gather(), both.scatter()
    work = {k: (lambda op=op: op.run(a)) for k, op in ops.items()}
    work["amx_to_vec_both"] = lambda: (g_both.run(a), b.copy_(a), s_both.run(b))  # the wire as a copy
    work["memcpy"] = lambda: b.copy_(a)
    t = _interleaved(work, reps)
    grid = grid_for(amx, heads=(0, heads), tokens=(0, tokens))
    same = bool(np.array_equal(kv_digest(amx, vb["amx"], 0, grid), kv_digest(vec, vb["dst"], 0, grid)))
    return {
        "geometry": f"{layers} layers x {heads} heads x {head_dim}, bf16, vLLM block {block_size}, SGLang page 64, "
                    f"{tokens} tokens ({nbytes >> 20} MiB)",
        "memcpy_gbps": round(nbytes / statistics.median(t["memcpy"]) / 1e9, 3),
        **{f"{k}_gbps": round(nbytes / statistics.median(v) / 1e9, 3) for k, v in t.items() if k != "memcpy"},
        **{f"{k}_ratio_spread": spread([c / r for c, r in zip(t["memcpy"], v)], 1.0) for k, v in t.items()
           if k != "memcpy"},
        "amx_to_vec_plan": both.kind.value,
        "amx_to_vec_bytes_verified": same,
        "reps": reps,
    }


def _bench_digest(src, src_pages, layers: int, heads: int, head_dim: int, dtype: str, dst_tpb: int, tokens: int,
                  reps: int, split) -> dict:
    """The content digest (``kv_digest``, integrity on) of the repack's tokens in the SGLang
    pool (NHD: one row per run) and in a TensorRT-LLM pool of the same geometry (HND: a
    block's tokens of one head per run), on one thread and on the split's, interleaved:
    GB/s medians with p10-p90."""
    from kvbridge.layout import TORCH_DIGEST_ALGORITHM, allocate_pool, grid_for, kv_digest
    from kvbridge.layout.digest import xxh3_functions

    nblk = -(-tokens // dst_tpb)
    dst = allocate_pool("trtllm", layers=layers, total_heads=heads, head_dim=head_dim, dtype=dtype,
                        tokens_per_block=dst_tpb, num_blocks=nblk, seed=1)
    pools = {"sglang": (src, src_pages), "trtllm": (dst, np.arange(nblk))}
    grid = grid_for(src, heads=(0, heads), tokens=(0, tokens))
    nbytes = tokens * layers * 2 * heads * head_dim * dtype_itemsize(dtype)
    cases = {f"{name}{tag}": (lambda lay=lay, b=b, sp=sp: kv_digest(lay, b, 0, grid, split=sp))
             for name, (lay, b) in pools.items() for tag, sp in (("", None), ("_split", split)) if tag == "" or sp}
    # the torch reduction a GPU's pool is digested by, here on the host (what a host sender pays
    # for a receiver that asks for it: integrity_hash "torch")
    cases["trtllm_torch"] = lambda: kv_digest(dst, np.arange(nblk), 0, grid, algorithm=TORCH_DIGEST_ALGORITHM)
    t = _interleaved(cases, reps)
    return {"gbps": {k: spread([nbytes / x / 1e9 for x in v]) for k, v in t.items()}, "bytes": nbytes,
            "hash": "XXH3-64 (xxhash), " + ("C walk in the pool's address order" if xxh3_functions() else "Python loop"),
            "split_threads": split.threads if split else 1,
            "what": (f"kv_digest of {tokens} tokens x {layers} layers x K/V x {heads} heads, grid of {grid.units} units "
                     f"of {grid.unit_tokens} tokens, in the SGLang pool and a TensorRT-LLM pool (block {dst_tpb}); "
                     "_split: the layers over every thread (the copy choice beside RDMA / NVLink); trtllm_torch: "
                     "the torch reduction (integrity_hash torch, a GPU pool's digest) on the host")}


def _check_gather(plan, staging: torch.Tensor) -> bool:
    """Staging row i must equal the source row that lands at the destination's i-th row."""
    src_addr, _ = row_addresses(plan.spec, "dst")
    lay = plan.spec.src
    row = lay.head_bytes
    pick = np.unique(np.linspace(0, src_addr.size - 1, 4096).astype(np.int64))
    got = staging.view(-1, row)[torch.from_numpy(pick)]
    want = torch.stack([_read(lay, int(src_addr[i]), row) for i in pick.tolist()])
    return bool(torch.equal(got, want))


def _read(lay, addr: int, n: int) -> torch.Tensor:
    for t, r in zip(lay.tensors, lay.regions):
        if r.addr <= addr < r.addr + r.nbytes:
            off = addr - r.addr
            return t.reshape(-1).view(torch.uint8)[off : off + n]
    raise AssertionError("address outside the pool")


def _bench_cuda(rplan, nbytes: int, reps: int, cpu_stage: torch.Tensor) -> dict:
    """The same gather on CUDA against a device copy, pools moved to the GPU."""
    src = rplan.spec.src
    dev_tensors = [t.cuda() for t in src.tensors]
    dsrc = sglang_layout_from_buffers([t.data_ptr() for t in dev_tensors], [t.nbytes for t in dev_tensors],
                                      [src.block_stride] * len(dev_tensors), src.tokens_per_block, src.num_heads,
                                      src.total_heads, src.dtype, tensors=dev_tensors)
    spec = replace(rplan.spec, src=dsrc)
    g = Gather(spec)
    stage = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    g.run(stage)
    a.copy_(b)
    torch.cuda.synchronize()

    def t(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    tc = statistics.median(t(lambda: a.copy_(b)) for _ in range(reps))
    tr = statistics.median(t(lambda: g.run(stage)) for _ in range(reps))
    return {
        "device": torch.cuda.get_device_name(),
        "repack_gbps": round(nbytes / tr / 1e9, 1),
        "memcpy_gbps": round(nbytes / tc / 1e9, 1),
        "repack_ratio": round(tc / tr, 3),
        "matches_cpu": bool(torch.equal(stage.cpu(), cpu_stage)),
    }
