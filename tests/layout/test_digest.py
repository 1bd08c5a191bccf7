"""The KV content digest (kvbridge.layout.digest) against each engine's own indexing.

For random geometry pairs (the layout properties' strategy: SGLang's real pools and
TensorRT-LLM's pool geometry, MHA/GQA/MLA, page sizes, TP both ways, fp8 to fp32), the
digest each side takes of its own pool equals one computed here from the bytes each
engine's own indexing rule reads (tests/helpers/engine_kv.py, not ``KVLayout``), after
any plan kind moved them; and one byte flipped in the destination (again through the
engine's own indexing) changes the digest at exactly that (layer, K/V, head, token). Each
of the digest's three ways of reading a pool (``PATHS``) is held to the same reference, and
the torch reduction (``TORCH_DIGEST_ALGORITHM``, what a GPU's pool is digested by) to one
written here from its definition (``reference_wsum``: numpy and Python integers, not torch).
"""

from __future__ import annotations

import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings

from kvbridge.layout import (DIGEST_ALGORITHM, TORCH_DIGEST_ALGORITHM, DigestGrid, HeadMap, LayoutError, PlanKind,
                             accepted_algorithms, digest_algorithm_for, first_difference, grid_for, kv_digest,
                             plan_transfer)
from tests.helpers.kvhelpers import fill_random
from tests.layout.test_layout_properties import engine_kv_of, make_pair, run_plan, scenarios


# how kv_digest reads a pool: the C walk over a host pool where its rows lie (what a CPU engine
# gets), the same walk in Python (where _runhash was not built), rows gathered first (a CUDA pool)
PATHS = ("walk", "python", "gathered")


@contextlib.contextmanager
def digest_path(path: str):
    """``kv_digest`` forced down one of ``PATHS``; "walk" checks that the C loop is there."""
    from kvbridge.layout import digest

    with contextlib.ExitStack() as stack:
        if path == "walk":
            assert digest.xxh3_functions() is not None, "kvbridge.layout._runhash did not load (built without gcc?)"
        elif path == "python":
            stack.enter_context(mock.patch.object(digest, "xxh3_functions", lambda: None))
        else:
            stack.enter_context(mock.patch.object(digest, "in_place", lambda layout, device: False))
        yield


def reference_digest(kv_bytes: torch.Tensor, grid: DigestGrid) -> np.ndarray:
    """XXH3-64 per unit of ``kv_bytes`` ([layers, kv, T, H, head_bytes] uint8, read by the
    engine's indexing), cut as the grid says: (layer, K/V, head, ``unit_tokens`` tokens)."""
    canon = kv_bytes.permute(0, 1, 3, 2, 4).contiguous().numpy()  # layer, kv, head, token, bytes
    out = []
    for layer in canon:
        for kv in layer:
            for head in kv:
                for a in range(0, head.shape[0], grid.unit_tokens):
                    out.append(xxhash.xxh3_64_intdigest(head[a:a + grid.unit_tokens].tobytes()))
    return np.array(out, dtype=np.uint64)


P31 = 2**31 - 1


@functools.lru_cache(maxsize=None)
def splitmix_weights(n: int, lane: int) -> tuple[int, ...]:
    """The torch reduction's weights as its definition states them: SplitMix64 of
    ``(i + 1) * golden + lane << 56`` for i < n, mod P - 1, plus 1 (Python integers)."""
    m, out = 2**64 - 1, []
    for i in range(1, n + 1):
        z = (i * 0x9E3779B97F4A7C15 + (lane << 56)) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append((z ^ (z >> 31)) % (P31 - 1) + 1)
    return tuple(out)


def reference_wsum(kv_bytes: torch.Tensor, grid: DigestGrid, seeds=None) -> np.ndarray:
    """``TORCH_DIGEST_ALGORITHM`` per unit of ``kv_bytes`` (as ``reference_digest``): the
    unit's bytes zero-padded to 4096-byte chunks, read as little-endian int16; per lane
    (weights of lanes 0 / 1 within a chunk, 2 / 3 across chunks) the chunk's exact sum of
    word x weight mod P, the chunks' sums weighted mod P, plus the seed (lane 1: seed >> 1)
    mod P; lane 0 << 32 | lane 1. ``seeds``: ``[layers, kv, heads]`` ints (default 0)."""
    canon = kv_bytes.permute(0, 1, 3, 2, 4).contiguous().numpy()
    out = []
    for li, layer in enumerate(canon):
        for ki, kv in enumerate(layer):
            for hi, head in enumerate(kv):
                seed = 0 if seeds is None else int(seeds[li][ki][hi])
                for a in range(0, head.shape[0], grid.unit_tokens):
                    b = head[a:a + grid.unit_tokens].tobytes()
                    b += bytes(-len(b) % 4096)
                    words = np.frombuffer(b, dtype="<i2").astype(np.int64).reshape(-1, 2048)
                    lanes = []
                    for lane, sd in ((0, seed), (1, seed >> 1)):
                        sums = [int(x) % P31 for x in words @ np.array(splitmix_weights(2048, lane), dtype=np.int64)]
                        across = splitmix_weights(len(sums), lane + 2)
                        lanes.append((sum(x * w % P31 for x, w in zip(sums, across)) + sd) % P31)
                    out.append(lanes[0] << 32 | lanes[1])
    return np.array(out, dtype=np.uint64)


def flip_byte(kind: str, pool, blocks, tpb: int, head_dim: int, layer: int, kv: int, t: int, h: int, j: int) -> None:
    """Flip byte ``j`` of (layer, kv, token t, local head h) through the engine's own indexing."""
    b, slot = int(blocks[t // tpb]), t % tpb
    if kind == "sglang":
        if not hasattr(pool, "k_buffer"):
            row = pool.kv_buffer[layer][b * tpb + slot, h]
        else:
            row = (pool.k_buffer if kv == 0 else pool.v_buffer)[layer][b * tpb + slot, h]
    else:
        heads = pool.shape[-1] // (tpb * head_dim)
        row = pool[b, layer, kv].view(heads, tpb, head_dim)[h, slot]
    row.view(torch.uint8)[j] ^= 0x5A


def digests(lay, blocks, grid) -> dict:
    """``kv_digest`` of ``lay``'s ``blocks`` read each of the ``PATHS`` ways, and the walk
    with its layers spread over two threads (a ``CopySplit``, as the sender's and the
    receiver's copy choice gives it on hosts where the copies take every thread)."""
    from kvbridge.layout.tiles import CopySplit

    out = {}
    for path in PATHS:
        with digest_path(path):
            out[path] = kv_digest(lay, blocks, 0, grid)
    with ThreadPoolExecutor(1) as ex:
        out["walk, two threads"] = kv_digest(lay, blocks, 0, grid, split=CopySplit(2, ex, min_bytes=1))
    out["torch"] = kv_digest(lay, blocks, 0, grid, algorithm=TORCH_DIGEST_ALGORITHM)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_both_sides_digest_the_same_content_and_name_a_flipped_byte(sglang_pools, sc):
    rng, (src, sblocks, spool), (dst, dblocks, dpool) = make_pair(sglang_pools, sc)
    heads = HeadMap.between(src, dst)
    tokens = range(sc["start"], sc["stop"])
    fill_random(src, sc["seed"])
    fill_random(dst, sc["seed"] + 1)
    # a few units per row where the seed says so, else the default cut
    grid = grid_for(src, heads=(heads.global_start, heads.count), tokens=(sc["start"], sc["stop"]),
                    max_units=[4, 64, 1024][sc["seed"] % 3])
    kvb = engine_kv_of(sc["pair"][0], spool, sblocks, sc["src_tpb"], tokens,
                       range(heads.src_start, heads.src_start + heads.count), sc["head_dim"])
    refs = {"xxh3": reference_digest(kvb, grid), "torch": reference_wsum(kvb, grid)}
    want = {path: refs["torch" if path == "torch" else "xxh3"] for path in digests(src, sblocks, grid)}
    for path, got in digests(src, sblocks, grid).items():
        assert np.array_equal(got, want[path]), f"{path}: the sender's digest differs from the engine's bytes'"
    kind = list(PlanKind)[sc["seed"] % len(PlanKind)]
    run_plan(plan_transfer(src, sblocks, dst, dblocks, (sc["start"], sc["stop"]), kinds=tuple(PlanKind), force=kind))
    for path, got in digests(dst, dblocks, grid).items():
        assert np.array_equal(got, want[path]), f"{path}, {kind.value}: the receiver's digest differs after a correct move"
        assert first_difference(grid, want[path], got) == ""

    layer, kv = int(rng.integers(sc["layers"])), int(rng.integers(src.kv_factor))
    t, i = int(rng.integers(sc["start"], sc["stop"])), int(rng.integers(heads.count))
    j = int(rng.integers(dst.head_bytes))
    flip_byte(sc["pair"][1], dpool, dblocks, sc["dst_tpb"], sc["head_dim"], layer, kv, t, heads.dst_start + i, j)
    a = sc["start"] + (t - sc["start"]) // grid.unit_tokens * grid.unit_tokens
    what = "latent" if src.kv_factor == 1 else "KV"[kv]
    for path, bad in digests(dst, dblocks, grid).items():
        where = first_difference(grid, want[path], bad)
        assert where.startswith(f"first at layer {layer} {what} head {heads.global_start + i} tokens [{a}, "), (path, where)
        assert int((bad != want[path]).sum()) == 1, path


def test_grids_are_bounded_and_checked():
    from kvbridge.layout import trtllm_pool_layout

    pool = torch.zeros(8, 4, 2, 2 * 16 * 8, dtype=torch.float16)
    lay = trtllm_pool_layout(pool, tokens_per_block=16, num_kv_heads=2, dtype="float16")
    g = grid_for(lay, heads=(0, 2), tokens=(0, 100_000))
    assert g.units <= 1024 and g.unit(g.units - 1) == (3, 1, 1, ((g.per_row - 1) * g.unit_tokens, 100_000))
    assert grid_for(lay, heads=(0, 2), tokens=(3, 5)).unit_tokens == 1
    with pytest.raises(LayoutError, match="heads"):
        kv_digest(lay, range(8), 0, DigestGrid((0, 4), 2, (1, 2), (0, 4), 1))
    with pytest.raises(LayoutError, match="layers"):
        kv_digest(lay, range(8), 0, DigestGrid((2, 5), 2, (0, 2), (0, 4), 1))
    with pytest.raises(LayoutError, match="tokens"):
        kv_digest(lay, range(2), 0, DigestGrid((0, 4), 2, (0, 2), (0, 33), 1))
    with pytest.raises(LayoutError, match="invalid digest grid"):
        DigestGrid((0, 4), 2, (0, 2), (5, 5), 1)
    assert "units" in first_difference(g, [1, 2], [1])


def test_vllm_cpu_cache_digests_as_its_own_indexing_reads_it():
    """vLLM's CPU cache stores K transposed inside a (block, head) (element-strided rows):
    its digest equals one over the bytes vLLM's own indexing reads (engine_kv.vllm_kv), by
    either algorithm, and equals a TensorRT-LLM pool's holding the same K and V."""
    from kvbridge.layout import trtllm_pool_layout, vllm_cpu_layout
    from tests.helpers.engine_kv import vllm_kv

    torch.manual_seed(0)
    layers, heads, bs, hd, nb = 2, 2, 16, 32, 6
    caches = [torch.randn(nb, heads, bs, 2 * hd, dtype=torch.bfloat16) for _ in range(layers)]
    lay = vllm_cpu_layout(caches)
    blocks, ntok = [4, 1, 3], 40
    grid = grid_for(lay, heads=(0, heads), tokens=(3, ntok), max_units=32)
    kv = vllm_kv(caches, blocks, bs, range(3, ntok))
    kvb = kv.contiguous().view(torch.uint8).view(layers, 2, ntok - 3, heads, 2 * hd)
    want = reference_digest(kvb, grid)
    assert np.array_equal(kv_digest(lay, blocks, 0, grid), want)
    assert np.array_equal(kv_digest(lay, blocks, 0, grid, algorithm=TORCH_DIGEST_ALGORITHM), reference_wsum(kvb, grid))
    pool = torch.zeros(5, layers, 2, heads * 8 * hd, dtype=torch.bfloat16)  # blocks of 8 tokens, HND
    trt = trtllm_pool_layout(pool, tokens_per_block=8, num_kv_heads=heads, dtype="bfloat16")
    for t in range(ntok):
        pool.view(5, layers, 2, heads, 8, hd)[t // 8, :, :, :, t % 8] = vllm_kv(caches, blocks, bs, [t])[:, :, 0]
    assert np.array_equal(kv_digest(trt, range(5), 0, grid), want)


@pytest.mark.parametrize("path", PATHS)
def test_head_major_blocks_digest_as_the_engines_indexing_reads_them(path):
    """A TensorRT-LLM pool (a head's tokens back to back in a block) is hashed run by run
    where it lies, or gathered first (``SPAN_MIN_BYTES`` out of reach): both equal the digest
    of the bytes TensorRT-LLM's own indexing reads, over scattered blocks, a token range
    that starts and stops inside a block and units that cross block edges."""
    from kvbridge.layout import trtllm_pool_layout

    torch.manual_seed(3)
    nb, layers, heads, tpb, hd = 9, 3, 4, 32, 64
    pool = torch.randn(nb, layers, 2, heads * tpb * hd, dtype=torch.bfloat16)
    lay = trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=heads, dtype="bfloat16")
    blocks, t0, t1 = [7, 2, 5, 0], 5, 117
    grid = grid_for(lay, heads=(1, 3), tokens=(t0, t1), max_units=3 * 2 * 3 * 5)  # 23-token units
    assert grid.unit_tokens % tpb and grid.per_row > 1
    kv = torch.stack([torch.stack([torch.stack([pool[blocks[t // tpb], lay_, k].view(heads, tpb, hd)[1:4, t % tpb]
                                                for t in range(t0, t1)]) for k in range(2)]) for lay_ in range(layers)])
    want = reference_digest(kv.view(torch.uint8), grid)
    with digest_path(path):
        assert np.array_equal(kv_digest(lay, blocks, 0, grid), want)


@pytest.mark.parametrize("path", PATHS)
def test_fp8_scales_seed_the_units_they_scale(path):
    """An fp8 unit's hash is seeded by its (layer, K/V, head)'s scale as float32 bits: equal
    bytes under another scale differ exactly in that head's units (named), a scale kept as
    float32 by one side and float64 by the other agrees, and 1.0 digests as no scale."""
    from kvbridge.layout import trtllm_pool_layout

    nb, layers, heads, tpb, hd = 4, 2, 3, 32, 64
    pool = torch.randint(0, 255, (nb, layers, 2, heads * tpb * hd), dtype=torch.uint8).view(torch.float8_e4m3fn)
    lay = trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=heads, dtype="float8_e4m3fn")
    blocks, grid = [2, 0], grid_for(lay, heads=(0, heads), tokens=(3, 50), max_units=48)
    kv = pool.view(torch.uint8).view(nb, layers, 2, heads, tpb, hd)[blocks].permute(1, 2, 0, 4, 3, 5)
    kv_bytes = kv.reshape(layers, 2, 2 * tpb, heads, hd)[:, :, 3:50]
    plain = reference_digest(kv_bytes, grid)
    with digest_path(path):
        assert np.array_equal(kv_digest(lay, blocks, 0, grid), plain)
        assert np.array_equal(kv_digest(lay.with_scales(1.0), blocks, 0, grid), plain)

        scales = np.full((layers, 2, heads), 0.1, dtype=np.float32)
        scales[1, 1, 2] = 0.5
        got32 = kv_digest(lay.with_scales(scales), blocks, 0, grid)
        assert np.array_equal(got32, kv_digest(lay.with_scales(scales.astype(np.float64) * (1 + 1e-12)), blocks, 0, grid))
        for u in range(grid.units):  # the engine's bytes, each unit's hash seeded with its scale's float32 bits
            layer, kvi, h, (a, b) = grid.unit(u)
            seed = int(np.float32(scales[layer, kvi, h]).view(np.uint32))
            assert got32[u] == xxhash.xxh3_64_intdigest(kv_bytes[layer, kvi, a - 3:b - 3, h].contiguous().numpy().tobytes(), seed)
        other = scales.copy()
        other[1, 1, 2] = 0.25
        where = first_difference(grid, got32, kv_digest(lay.with_scales(other), blocks, 0, grid))
        assert where.startswith(f"first at layer 1 V head 2 tokens [3, ") and f"({grid.per_row} of {grid.units} units" in where, where


def test_the_c_loop_is_used_only_where_it_agrees_with_the_xxhash_package(monkeypatch):
    """``xxh3_functions`` checks the C loop against the package's own ``xxh3_64_intdigest``
    before ``kv_digest`` uses it: here they agree; where they would not (the package's value
    made to differ), the digest falls back to Python rather than hash other numbers."""
    from kvbridge.layout import digest

    assert digest.xxh3_functions() is not None
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data, seed=0: 0)
    assert digest.xxh3_functions.__wrapped__() is None


def test_the_torch_reduction_sees_every_single_word_change_and_every_scale():
    """Any one 16-bit word of a unit changed by any amount changes both lanes of that unit's
    value (P is a prime above every change and every weight), at every position of a unit
    that spans several chunks and ends inside one; a head's fp8 scale changes its units
    only; the values equal ``reference_wsum``'s."""
    from kvbridge.layout import trtllm_pool_layout

    nb, layers, heads, tpb, hd = 3, 1, 2, 32, 64  # a unit of 40 tokens: 5120 bytes, two chunks, the second short
    pool = torch.randint(0, 255, (nb, layers, 2, heads * tpb * hd), dtype=torch.uint8).view(torch.float8_e4m3fn)
    lay = trtllm_pool_layout(pool, tokens_per_block=tpb, num_kv_heads=heads, dtype="float8_e4m3fn")
    grid = DigestGrid((0, 1), 2, (0, heads), (0, 80), 40)
    kvb = pool.view(torch.uint8).view(nb, layers, 2, heads, tpb, hd)[[0, 2, 1]].permute(1, 2, 0, 4, 3, 5)
    kvb = kvb.reshape(layers, 2, 3 * tpb, heads, hd)[:, :, :80]
    base = kv_digest(lay, [0, 2, 1], 0, grid, algorithm=TORCH_DIGEST_ALGORITHM)
    assert np.array_equal(base, reference_wsum(kvb, grid))
    words = pool.view(torch.int16).view(nb, layers, 2, heads, tpb, hd // 2)
    rng = np.random.default_rng(0)
    for tok in range(40):  # every word of unit 0 (layer 0, K, head 0)
        for j in range(hd // 2):
            w = words[[0, 2][tok // tpb], 0, 0, 0, tok % tpb, j]
            old = int(w)
            w.fill_((old + 32768 + int(rng.integers(1, 65536))) % 65536 - 32768)  # any other int16
            got = kv_digest(lay, [0, 2, 1], 0, grid, algorithm=TORCH_DIGEST_ALGORITHM)
            w.fill_(old)
            hi, lo = (got ^ base) >> np.uint64(32), (got ^ base) & np.uint64(0xFFFFFFFF)
            assert (hi[0] != 0) and (lo[0] != 0) and not (got[1:] != base[1:]).any(), (tok, j)
    scales = np.ones((layers, 2, heads), dtype=np.float32)
    scales[0, 1, 1] = 0.5
    scaled = kv_digest(lay.with_scales(scales), [0, 2, 1], 0, grid, algorithm=TORCH_DIGEST_ALGORITHM)
    seeds = np.where(scales == 1.0, 0, scales.view(np.uint32)).astype(np.int64).tolist()
    assert np.array_equal(scaled, reference_wsum(kvb, grid, seeds))
    assert first_difference(grid, base, scaled).startswith("first at layer 0 V head 1 tokens [0, 40) (2 of 8 units")


def test_each_side_digests_with_an_algorithm_the_receiver_accepts():
    """A receiver asks for XXH3-64 on a host pool and for the torch reduction first on a
    GPU's (a pool on the meta device stands for one: only where it lies is read); a sender
    takes the one cheapest where its own pool lies if the receiver accepts it, else the
    receiver's first; a receiver naming nothing it knows, or a setting it does not, is
    refused by name."""
    from kvbridge.layout import trtllm_pool_layout

    def lay(device):
        t = torch.empty(4, 2, 2, 2 * 16 * 8, dtype=torch.float16, device=device)
        return trtllm_pool_layout(t, tokens_per_block=16, num_kv_heads=2, dtype="float16")

    host, gpu = lay("cpu"), lay("meta")
    assert accepted_algorithms(host) == [DIGEST_ALGORITHM]
    assert accepted_algorithms(gpu) == [TORCH_DIGEST_ALGORITHM, DIGEST_ALGORITHM]
    assert accepted_algorithms(host, "torch") == [TORCH_DIGEST_ALGORITHM]
    assert accepted_algorithms(gpu, "xxh3") == [DIGEST_ALGORITHM]
    assert digest_algorithm_for(gpu, accepted_algorithms(gpu)) == TORCH_DIGEST_ALGORITHM  # two GPU pools
    assert digest_algorithm_for(host, accepted_algorithms(gpu)) == DIGEST_ALGORITHM  # a host sender: no torch pass
    assert digest_algorithm_for(gpu, accepted_algorithms(host)) == DIGEST_ALGORITHM
    assert digest_algorithm_for(host, [TORCH_DIGEST_ALGORITHM]) == TORCH_DIGEST_ALGORITHM
    assert digest_algorithm_for(host, []) == DIGEST_ALGORITHM  # a receiver that names none: XXH3-64, as before
    assert digest_algorithm_for(host, ["md5/x", TORCH_DIGEST_ALGORITHM]) == TORCH_DIGEST_ALGORITHM
    with pytest.raises(LayoutError, match="'md5/x'"):
        digest_algorithm_for(host, ["md5/x"])
    with pytest.raises(LayoutError, match="integrity hash 'sha1'"):
        accepted_algorithms(host, "sha1")
    with pytest.raises(LayoutError, match="unknown content digest algorithm 'md5/x'"):
        kv_digest(host, [0], 0, grid_for(host, heads=(0, 2), tokens=(0, 4)), algorithm="md5/x")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gpu_pool_is_reduced_where_it_lies_to_the_host_pools_values():
    """The torch reduction of a CUDA pool equals the same pool's on the host and
    ``reference_wsum`` (integer arithmetic: the same bits on every device), over scattered
    blocks and several chunks per unit; a CUDA pool asks for it first (``auto``)."""
    from kvbridge.layout import trtllm_pool_layout

    g = torch.Generator().manual_seed(5)
    nb, layers, heads, tpb, hd = 9, 3, 4, 32, 128
    host = torch.randint(0, 255, (nb, layers, 2, heads * tpb * hd), dtype=torch.uint8, generator=g)
    lays = {dev: trtllm_pool_layout(host.to(dev).view(torch.bfloat16), tokens_per_block=tpb, num_kv_heads=heads,
                                    dtype="bfloat16") for dev in ("cpu", "cuda")}
    blocks, grid = [7, 2, 5, 0], grid_for(lays["cpu"], heads=(0, heads), tokens=(3, 120), max_units=48)
    kvb = host.view(nb, layers, 2, heads, tpb, hd)[blocks].permute(1, 2, 0, 4, 3, 5)  # rows of hd bytes
    want = reference_wsum(kvb.reshape(layers, 2, 4 * tpb, heads, hd)[:, :, 3:120], grid)
    for dev, lay in lays.items():
        assert np.array_equal(kv_digest(lay, blocks, 0, grid, algorithm=TORCH_DIGEST_ALGORITHM), want), dev
    assert accepted_algorithms(lays["cuda"])[0] == TORCH_DIGEST_ALGORITHM
