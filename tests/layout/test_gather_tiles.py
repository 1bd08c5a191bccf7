"""The gather's box path (whole boxes copied as strided tiles of the pool) against an
independent reference: staging row i must hold the source row that lands at the
destination's i-th row in address order, computed here from block ids, slots and
strides with numpy (kvhelpers), without repack code. Each case also says which path ran:
the box path where pages map regularly, the row-index fallback where they do not; and on
the box path, which copy moved the tiles: the C tile copy (``native``) or torch's."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

from kvbridge.layout import CopySpec, LayoutError, allocate_pool
from kvbridge.layout.repack import Gather, Scatter
from tests.helpers.kvhelpers import read_units, snapshot, unit_addresses, written_mask

repack = importlib.import_module("kvbridge.layout.repack")  # the module (the package exports a function of that name)
GEOM = dict(layers=2, total_heads=4, head_dim=8, dtype="bf16")


def _staged_rows(src, sb, dst, db, start, stop, order):
    """The rows of the request, in increasing address order of side ``order``: each row's
    bytes read from the source pool. ``[rows, head_bytes]`` uint8."""
    heads = range(src.num_heads)
    so = unit_addresses(src, sb, 0, start, stop, heads)
    do = unit_addresses(dst, db, 0, start, stop, heads)
    data = read_units(src, so).reshape(-1, src.head_bytes)
    key = (so if order == "src" else do)[..., 0].reshape(-1)  # addresses
    return data[np.argsort(key, kind="stable")]


CASES = {
    # name: (src engine, src page, dst engine, dst page, token range, box path expected)
    "sglang64_to_trtllm32": ("sglang", 64, "trtllm", 32, (0, 256), True),  # HND tiles, strided
    "sglang32_to_sglang16": ("sglang", 32, "sglang", 16, (0, 160), True),  # NHD -> NHD: tiles contiguous
    "trtllm32_to_sglang16": ("trtllm", 32, "sglang", 16, (32, 192), True),  # HND source, NHD order
    "sglang16_to_trtllm32": ("sglang", 16, "trtllm", 32, (0, 256), False),  # a dst block spans 2 src pages
    "partial_blocks": ("sglang", 64, "trtllm", 32, (10, 250), False),  # a partial first and last block
    "trtllm32_to_sglang64": ("trtllm", 32, "sglang", 64, (0, 256), False),  # a dst page spans 2 src blocks
}


def _pools(name):
    se, sp, de, dp, (start, stop), tiled = CASES[name]
    src = allocate_pool(se, tokens_per_block=sp, num_blocks=-(-stop // sp) * 2 + 2, seed=1, **GEOM)
    dst = allocate_pool(de, tokens_per_block=dp, num_blocks=-(-stop // dp) * 2 + 2, seed=2, **GEOM)
    rng = np.random.default_rng(7)
    sb = rng.permutation(np.arange(src.first_block, src.num_blocks))[: -(-stop // sp)]
    db = rng.permutation(np.arange(dst.first_block, dst.num_blocks))[: -(-stop // dp)]
    return src, sb, dst, db, start, stop, tiled


NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def test_the_c_tile_copy_is_built():
    """``make`` builds it (pyproject's ext-modules, optional): a machine with a compiler
    that silently fell back to torch's copies would lose the gather's speed."""
    assert repack.native_tile_copy(), "kvbridge.layout._tilecopy did not import: was the package built without gcc?"


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", sorted(CASES))
def test_gather_matches_reference_on_the_expected_path(name, native):
    src, sb, dst, db, start, stop, tiled = _pools(name)
    spec = CopySpec.build(src, sb, dst, db, (start, stop))
    g = Gather(spec, native=native)
    assert g.box_path is tiled and g.native is (tiled and native)
    want = _staged_rows(src, sb, dst, db, start, stop, "dst")
    out = torch.full((g.nbytes,), 0xAB, dtype=torch.uint8)
    assert g.run(out) == want.size
    assert np.array_equal(out.numpy().reshape(want.shape), want)
    # the row-index path on the same spec writes the same bytes
    rows = torch.zeros_like(out)
    Gather(spec, tiles=False).run(rows)
    assert torch.equal(rows, out)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", ["sglang64_to_trtllm32", "sglang32_to_sglang16"])
@pytest.mark.parametrize("part", [1, 7, 37, 64, 200])
def test_gather_in_parts_that_cut_boxes(name, part, native):
    """Parts of any row count (cutting boxes at both ends, or inside one box) and CPU copies
    cut small: the concatenated parts are the reference's rows."""
    src, sb, dst, db, start, stop, _ = _pools(name)
    g = Gather(CopySpec.build(src, sb, dst, db, (start, stop)), native=native)
    assert g.box_path
    want = _staged_rows(src, sb, dst, db, start, stop, "dst")
    rb = g.row_bytes
    out = torch.zeros(g.nbytes, dtype=torch.uint8)
    region = torch.empty(part * rb, dtype=torch.uint8)
    for a in range(0, g.rows, part):
        b = min(g.rows, a + part)
        region.fill_(0xCD)
        g.run(region, rows=(a, b), inline=True)
        out[a * rb: b * rb] = region[: (b - a) * rb]
    assert np.array_equal(out.numpy().reshape(want.shape), want)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name,tiled", [("trtllm32_to_sglang64", True), ("sglang16_to_trtllm32", True),
                                        ("sglang64_to_trtllm32", False), ("partial_blocks", False)])
def test_scatter_writes_exactly_the_request(name, tiled, native):
    """Receiver side: staging in the source's address order (built here from the reference)
    scattered into the destination: the request's bytes land, nothing else changes."""
    src, sb, dst, db, start, stop, _ = _pools(name)
    spec = CopySpec.build(src, sb, dst, db, (start, stop))
    staging = torch.from_numpy(_staged_rows(src, sb, dst, db, start, stop, "src").reshape(-1).copy())
    before = snapshot(dst)
    s = Scatter(spec, native=native)
    assert s.box_path is tiled  # a source box inside one destination block: written as one tile
    assert s.native is (tiled and native)
    assert s.run(staging) == spec.nbytes
    heads = range(src.num_heads)
    so, do = unit_addresses(src, sb, 0, start, stop, heads), unit_addresses(dst, db, 0, start, stop, heads)
    assert np.array_equal(read_units(src, so), read_units(dst, do))
    mask = written_mask(dst, do)
    assert all(np.array_equal(a[~m], b[~m]) for a, b, m in zip(snapshot(dst), before, mask))


def test_tile_pointers_built_by_two_threads_at_once_are_one_array():
    """Two threads may reach a fresh gather's first C copy together: both must use the same
    pointer array (one built over the other would be freed under the thread holding its
    address). Both threads are held inside the lazy build at once here."""
    import threading

    src, sb, dst, db, start, stop, _ = _pools("sglang64_to_trtllm32")
    tiles = Gather(CopySpec.build(src, sb, dst, db, (start, stop)))._tiles
    index, both = tiles.index, threading.Barrier(2)

    class HeldIndex:  # the index, whose host copy each thread takes only once the other one is there too
        def numpy(self):
            both.wait(5)
            return index.numpy()

    tiles.index = HeldIndex()
    got = []
    threads = [threading.Thread(target=lambda: got.append(tiles.pointers)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 2 and got[0] is got[1] and got[0] is tiles.pointers
    want = tiles.view.data_ptr() + index.numpy() * tiles.unit
    assert np.array_equal(got[0], want)


@pytest.mark.parametrize("offset", [0, 8], ids=["aligned", "staging-8-bytes-off"])
@pytest.mark.parametrize("name", ["sglang64_to_trtllm32", "sglang32_to_sglang16", "trtllm32_to_sglang16"])
def test_c_tile_copy_streamed_stores_both_ways(name, offset, monkeypatch):
    """Every C tile copy streams its stores (``STREAM_MIN_BYTES`` 0), into staging that is
    16-byte aligned or not (then plain stores): the gather gives the reference's rows, and
    a scatter of them back into a zeroed copy of the source pool restores exactly its
    request's bytes and nothing else."""
    monkeypatch.setattr(importlib.import_module("kvbridge.layout.tiles"), "STREAM_MIN_BYTES", 0)
    src, sb, dst, db, start, stop, tiled = _pools(name)
    assert tiled
    spec = CopySpec.build(src, sb, dst, db, (start, stop))
    g = Gather(spec, native=True)
    want = _staged_rows(src, sb, dst, db, start, stop, "dst")
    buf = torch.full((g.nbytes + 64,), 0x5A, dtype=torch.uint8)
    base = (-buf.data_ptr()) % 64 + offset  # 64-aligned, then shifted
    out = buf[base: base + g.nbytes]
    assert g.run(out) == want.size
    assert np.array_equal(out.numpy().reshape(want.shape), want)
    assert (buf[:base] == 0x5A).all() and (buf[base + g.nbytes:] == 0x5A).all()  # nothing around it written


def test_c_tile_copy_refuses_tiles_outside_the_pool():
    """The C copy does not check addresses: a box whose tile reaches past the pool's memory
    (a block id out of range that slipped past the plan) is refused before any copy, as
    torch's index_select would refuse it."""
    src, sb, dst, db, start, stop, _ = _pools("sglang64_to_trtllm32")
    g = Gather(CopySpec.build(src, sb, dst, db, (start, stop)), native=True)
    t = g._tiles
    t.index[-1] = t.view.shape[0]  # one tile start past the last one the memory holds
    out = torch.zeros(g.nbytes, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="outside the pool's memory"):
        g.run(out)
    assert not out.any()


# -- the C tile copy spread over several threads (CopySplit) ----------------------------

TILED = [n for n in sorted(CASES) if CASES[n][-1]]


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("name", TILED)
def test_gather_split_over_threads_matches_reference(name, threads):
    """The sender's gather with its C copy cut into ranges of whole boxes on ``threads``
    threads (pieces of any size: ``min_bytes=1``), whole and in parts that cut boxes:
    staging holds the reference's rows, exactly."""
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.layout.tiles import CopySplit

    src, sb, dst, db, start, stop, _ = _pools(name)
    g = Gather(CopySpec.build(src, sb, dst, db, (start, stop)))
    assert g.native
    want = _staged_rows(src, sb, dst, db, start, stop, "dst")
    with ThreadPoolExecutor(threads - 1) as ex:
        split = CopySplit(threads, ex, min_bytes=1)
        out = torch.full((g.nbytes,), 0xAB, dtype=torch.uint8)
        g.run(out, split=split)
        assert np.array_equal(out.numpy().reshape(want.shape), want)
        rb, box = g.row_bytes, g._tiles.rows
        parts = torch.zeros(g.nbytes, dtype=torch.uint8)
        for a in range(0, g.rows, 3 * box):  # parts of three whole boxes: the split path
            b = min(g.rows, a + 3 * box)
            region = torch.full(((b - a) * rb,), 0xCD, dtype=torch.uint8)
            g.run(region, rows=(a, b), split=split)
            parts[a * rb: b * rb] = region
        assert np.array_equal(parts.numpy().reshape(want.shape), want)


@pytest.mark.parametrize("name", ["trtllm32_to_sglang64", "sglang16_to_trtllm32"])
def test_scatter_split_over_threads_writes_exactly_the_request(name):
    """The receiver's scatter on two threads: the request's bytes land, nothing else changes."""
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.layout.tiles import CopySplit

    src, sb, dst, db, start, stop, _ = _pools(name)
    spec = CopySpec.build(src, sb, dst, db, (start, stop))
    staging = torch.from_numpy(_staged_rows(src, sb, dst, db, start, stop, "src").reshape(-1).copy())
    before = snapshot(dst)
    with ThreadPoolExecutor(1) as ex:
        s = Scatter(spec)
        assert s.native
        assert s.run(staging, split=CopySplit(2, ex, min_bytes=1)) == spec.nbytes
    heads = range(src.num_heads)
    so, do = unit_addresses(src, sb, 0, start, stop, heads), unit_addresses(dst, db, 0, start, stop, heads)
    assert np.array_equal(read_units(src, so), read_units(dst, do))
    mask = written_mask(dst, do)
    assert all(np.array_equal(a[~m], b[~m]) for a, b, m in zip(snapshot(dst), before, mask))


@given(i=st.integers(0, 50), n=st.integers(1, 300), box=st.integers(1, 1 << 16), threads=st.integers(1, 9),
       min_bytes=st.integers(1, 1 << 22))
def test_copy_split_ranges_cover_every_box_once(i, n, box, threads, min_bytes):
    """Consecutive ranges of whole boxes covering ``[i, i + n)`` exactly, at most ``threads``
    of them, each at least ``min_bytes`` unless there is only one."""
    from kvbridge.layout.tiles import CopySplit

    rs = CopySplit(threads, object(), min_bytes=min_bytes).ranges(i, i + n, box)
    assert rs[0][0] == i and rs[-1][1] == i + n and all(a < b for a, b in rs)
    assert all(p[1] == q[0] for p, q in zip(rs, rs[1:]))
    assert len(rs) <= threads
    assert len(rs) == 1 or all((b - a) * box >= min_bytes for a, b in rs)


def test_copy_split_returns_only_after_every_range_even_when_one_fails():
    """A range that raises on the calling thread still waits for the others (no worker
    writes after the call returns), and a worker's error reaches the caller."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.layout.tiles import CopySplit

    done = []

    def copy(a, b):
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("calling thread's range failed")
        time.sleep(0.2)
        done.append((a, b))

    with ThreadPoolExecutor(1) as ex:
        with pytest.raises(RuntimeError, match="calling thread"):
            CopySplit(2, ex, min_bytes=1).run(copy, 0, 4, 1)
        assert done == [(2, 4)]

        def worker_fails(a, b):
            if threading.current_thread() is not threading.main_thread():
                raise ValueError("worker's range failed")

        with pytest.raises(ValueError, match="worker"):
            CopySplit(2, ex, min_bytes=1).run(worker_fails, 0, 4, 1)
    with pytest.raises(LayoutError, match="executor"):
        CopySplit(2, None)
