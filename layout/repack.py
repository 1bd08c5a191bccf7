"""Repack kernels: execute a CopySpec between local tensors with torch (CPU or CUDA).

Used to gather a sender's KV into a staging buffer already in the receiver's byte
order, and to scatter a receiver's staging buffer into its pool. Each (layer, kv) is
viewed as ``[num_blocks, tokens_per_block, heads, head_dim]`` with the layout's own
strides (no copy); runs that share (src slot, dst slot, length) form one class, and a
class moves with ONE indexed copy: ``index_select(..., out=<strided view>)`` when the
destination blocks are evenly spaced (a staging buffer), ``index_copy_`` when the
source blocks are (a staging buffer read back), both indexed otherwise. On CPU the
(layer, kv) pairs run on a thread pool (torch releases the GIL), since one indexed copy
uses one core.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from .copyspec import CopySpec
from .geometry import KVLayout, LayoutError

__all__ = ["repack"]

_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _unit(spec: CopySpec) -> int:
    """Largest element size (bytes) that divides every stride, offset and head."""
    vals = [spec.src.head_bytes]
    for lay in (spec.src, spec.dst):
        vals += [lay.block_stride, lay.token_stride, lay.head_stride]
        starts = np.array([r.addr for r in lay.regions], dtype=np.int64)[lay.region_of]
        vals += np.unique(lay.base - starts).tolist() + [r.addr for r in lay.regions]
    g = 0
    for v in vals:
        g = math.gcd(g, int(v))
    return max(u for u in _UNITS if g % u == 0)


def _region_views(lay: KVLayout, unit: int) -> Callable[[int, int], torch.Tensor]:
    """Returns f(layer, kv) -> strided view ``[num_blocks, tokens_per_block, num_heads,
    head_dim_units]`` of that (layer, kv) in elements of ``unit`` bytes."""
    if lay.tensors is None:
        raise LayoutError(f"{lay.engine} layout has no local tensors to repack from/into")
    flats = []
    for t, r in zip(lay.tensors, lay.regions):
        if t.data_ptr() != r.addr or not t.is_contiguous():
            raise LayoutError(f"{lay.engine} tensor does not match its region at 0x{r.addr:x}")
        flats.append(t.reshape(-1).view(torch.uint8).view(_UNITS[unit]))
    size = (lay.num_blocks, lay.tokens_per_block, lay.num_heads, lay.head_bytes // unit)
    stride = (lay.block_stride // unit, lay.token_stride // unit, lay.head_stride // unit, 1)

    def view(layer: int, kv: int) -> torch.Tensor:
        r = int(lay.region_of[layer, kv])
        flat = flats[r]
        off = (int(lay.base[layer, kv]) - lay.regions[r].addr) // unit
        return flat.as_strided(size, stride, flat.storage_offset() + off)

    return view


def _arith(ids: np.ndarray) -> tuple[int, int] | None:
    """(first, step) when ``ids`` is an increasing arithmetic progression, else None."""
    if ids.size == 1:
        return int(ids[0]), 1
    d = np.diff(ids)
    if d[0] > 0 and (d == d[0]).all():
        return int(ids[0]), int(d[0])
    return None


def repack(spec: CopySpec, *, threads: int | None = None) -> int:
    """Copy every byte ``spec`` names from ``spec.src``'s tensors into ``spec.dst``'s.

    Both layouts need local tensors on the same device. Returns the bytes copied. Works
    for any pair; it is one pass over the bytes when either side's blocks are evenly
    spaced (staging buffers), two otherwise.
    """
    src, dst, heads = spec.src, spec.dst, spec.heads
    if src.device != dst.device:
        raise LayoutError(f"repack needs both sides on one device, got {src.device} and {dst.device}")
    unit = _unit(spec)
    sview, dview = _region_views(src, unit), _region_views(dst, unit)
    dev = src.device
    r = spec.runs
    keys = np.stack([r.src_slot, r.dst_slot, r.length], axis=1)
    classes = np.unique(keys, axis=0)
    head_major = dst.is_head_major
    hs, hd, nh = heads.src_start, heads.dst_start, heads.count

    plans = []
    for ss, ds, n in classes.tolist():
        sel = np.flatnonzero((keys == (ss, ds, n)).all(axis=1))
        ia, ib = r.src_block[sel], r.dst_block[sel]
        plans.append((ss, ds, n, ia, ib, _arith(ia), _arith(ib), torch.from_numpy(ia).to(dev), torch.from_numpy(ib).to(dev)))

    def one(layer: int, kv: int) -> None:
        sv, dv = sview(layer, kv), dview(layer, kv)
        for ss, ds, n, ia, ib, a_ar, b_ar, ia_t, ib_t in plans:
            a = sv[:, ss : ss + n, hs : hs + nh]
            b = dv[:, ds : ds + n, hd : hd + nh]
            if head_major:  # walk the destination in its memory order: [block][head][token]
                a, b = a.transpose(1, 2), b.transpose(1, 2)
            if b_ar is not None:
                first, step = b_ar
                torch.index_select(a, 0, ia_t, out=b[first : first + step * ia.size : step])
            elif a_ar is not None:
                first, step = a_ar
                b.index_copy_(0, ib_t, a[first : first + step * ia.size : step])
            else:
                b.index_copy_(0, ib_t, torch.index_select(a, 0, ia_t))

    pairs = [(l, k) for l in range(src.num_layers) for k in range(src.kv_factor)]
    workers = threads if threads is not None else (1 if dev.type != "cpu" else min(len(pairs), torch.get_num_threads(), os.cpu_count() or 1))
    if workers <= 1:
        for l, k in pairs:
            one(l, k)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-repack") as ex:
            list(ex.map(lambda lk: one(*lk), pairs))
    return spec.nbytes
