"""Byte segments: the descriptor list a transport executes, compiled from a CopySpec.

Every (layer, kv, run) of a CopySpec is a *box*: ``length`` tokens x ``heads.count``
heads of ``head_bytes`` each, with a token stride and a head stride on each side.
Inside a box, dimensions whose stride equals the current contiguous run on BOTH sides
fold into it (NHD->NHD folds heads then tokens; HND->HND folds tokens, then heads for
whole blocks). Boxes are then sorted by source address and neighbours that are
adjacent on both sides are merged. All of it is numpy over boxes: no Python loop per
token, block or segment.

Layouts with element-strided rows (``KVLayout.row_strides``) fold per K/V, starting
from one element (e.g. vLLM's transposed K -> transposed K folds tokens, then the
head's elements for whole blocks); where tokens are mixed-radix (vLLM's 'amx' tiles),
runs are first cut into pieces that are one aligned sub-grid on both sides (a whole
block, 16 or 2 tokens, one token). They have no contiguous runs of their own to stage
in (``side_runs`` refuses them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .copyspec import CopySpec, TokenRuns
from .geometry import KVLayout, LayoutError

__all__ = [
    "Segments",
    "SideBoxes",
    "block_ranges",
    "check_segments_inside",
    "coalesce",
    "compile_segments",
    "count_segments",
    "side_boxes",
    "side_runs",
]


@dataclass(frozen=True)
class Segments:
    """Pieces to copy: ``length[i]`` bytes from ``src[i]`` to ``dst[i]`` (int64 arrays).

    Addresses are absolute, except on a staging side where they are offsets into the
    staging buffer until ``shifted`` adds its address.
    """

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    @property
    def count(self) -> int:
        """Number of segments."""
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        """Total bytes."""
        return int(self.length.sum())

    def shifted(self, src_by: int = 0, dst_by: int = 0) -> "Segments":
        """The same segments with ``src_by`` / ``dst_by`` added to every address."""
        return Segments(self.src + src_by, self.dst + dst_by, self.length)

    def split(self, max_count: int) -> list["Segments"]:
        """Consecutive slices of at most ``max_count`` segments (for bounded batches)."""
        n = self.count
        return [
            Segments(self.src[i : i + max_count], self.dst[i : i + max_count], self.length[i : i + max_count])
            for i in range(0, n, max_count)
        ] or [self]

    def window(self, lo: int, hi: int) -> "Segments":
        """The bytes ``[lo, hi)`` of a staging-source wire (``src`` = staging offsets,
        increasing and non-overlapping), cut at both ends, with ``src`` rebased so that
        offset ``lo`` becomes 0: the wire of one part of a pipelined send."""
        if not 0 <= lo <= hi:
            raise ValueError(f"bad window [{lo}, {hi})")
        if lo == hi:
            return Segments.empty()
        end = self.src + self.length
        i = int(np.searchsorted(end, lo, side="right"))
        j = int(np.searchsorted(self.src, hi, side="left"))
        src, dst, length = self.src[i:j].copy(), self.dst[i:j].copy(), self.length[i:j].copy()
        if src.size:
            cut = max(0, lo - int(src[0]))
            src[0] += cut
            dst[0] += cut
            length[0] -= cut
            length[-1] = min(int(src[-1] + length[-1]), hi) - src[-1]
        return Segments(src - lo, dst, length)

    @classmethod
    def empty(cls) -> "Segments":
        """No segments."""
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Segments:
    """Merge each segment into its predecessor when it continues it on both sides (in order)."""
    if src.size == 0:
        return Segments.empty()
    cont = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    heads = np.flatnonzero(np.concatenate(([True], ~cont)))
    return Segments(src[heads], dst[heads], np.add.reduceat(length, heads))


def _fold(dims: list[tuple[int, int, int]], elem: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Fold (size, src_stride, dst_stride) dims into a contiguous run of ``elem`` bytes
    while some dim's stride equals the run on both sides; return (run, the rest, outer first)."""
    dims = [d for d in dims if d[0] > 1]
    run = elem
    while True:
        hit = next((d for d in dims if d[1] == run and d[2] == run), None)
        if hit is None:
            break
        run *= hit[0]
        dims.remove(hit)
    dims.sort(key=lambda d: (-d[1], -d[2]))
    return run, dims


def _box_starts(spec: CopySpec, runs: TokenRuns, sel: np.ndarray, kv: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Start address of every (layer, kv, run in ``sel`` of ``runs``) box on each side,
    shape [L*kv*R] (only K/V ``kv`` when given: [L*R])."""
    r = runs
    out = []
    for lay, blk, slot, h0 in (
        (spec.src, r.src_block[sel], r.src_slot[sel], spec.heads.src_start),
        (spec.dst, r.dst_block[sel], r.dst_slot[sel], spec.heads.dst_start),
    ):
        tok = slot * lay.token_stride if kv is None else lay.token_offsets[kv][slot]
        base = lay.base if kv is None else lay.base[:, kv]
        per_run = blk * lay.block_stride + tok + h0 * lay.head_stride
        out.append((base.reshape(-1, 1) + per_run[None, :]).reshape(-1))
    return out[0], out[1]


def _classes(spec: CopySpec):
    """Group runs by length (the only per-run input to folding): yields (sel, run, dims).
    Both sides' head rows contiguous (see ``_kv_classes`` for any layouts)."""
    s, d, h = spec.src, spec.dst, spec.heads
    lengths = spec.runs.length
    for n in np.unique(lengths):
        sel = np.flatnonzero(lengths == n)
        run, dims = _fold(
            [(int(n), s.token_stride, d.token_stride), (h.count, s.head_stride, d.head_stride)], s.head_bytes
        )
        yield sel, run, dims


def _kv_classes(spec: CopySpec):
    """``_classes`` for any layouts: yields (runs, sel, kv, run, dims), ``kv`` None for every
    K/V at once (both sides' rows contiguous), else one K/V folded from one element. Where
    a side's tokens are mixed-radix, ``runs`` are the runs cut into ``_token_pieces``."""
    s, d, h = spec.src, spec.dst, spec.heads
    if s.rows_contiguous and d.rows_contiguous:
        for sel, run, dims in _classes(spec):
            yield spec.runs, sel, None, run, dims
        return
    for kv in range(s.kv_factor):
        elems = _paired(s.elem_dims(kv), d.elem_dims(kv))
        runs = spec.runs if s.affine_tokens and d.affine_tokens else _token_pieces(spec, kv)
        for n in np.unique(runs.length).tolist():
            sel = np.flatnonzero(runs.length == n)
            toks = _paired(_inner_dims(s.token_dims(kv), n), _inner_dims(d.token_dims(kv), n))
            run, dims = _fold(elems + toks + [(h.count, s.head_stride, d.head_stride)], s.itemsize)
            yield runs, sel, kv, run, dims


def _inner_dims(dims: tuple[tuple[int, int], ...], n: int) -> tuple[tuple[int, int], ...]:
    """The innermost token dims of ``dims`` that cover ``n`` aligned tokens (an affine
    dim is cut to ``n``)."""
    if len(dims) == 1:
        return ((n, dims[0][1]),) if n > 1 else ()
    out, left = [], n
    for c, st in reversed(dims):
        if left == 1:
            break
        out.append((c, st))
        left //= c
    return tuple(reversed(out))


def _paired(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """(count, src stride, dst stride) dims of two dim lists of the same counts (what
    ``refused_kinds`` lets a direct plan join)."""
    if [c for c, _ in a] != [c for c, _ in b]:
        raise LayoutError(f"dims {a} and {b} differ in their counts: no direct copy between them")
    return [(c, sa, sb) for (c, sa), (_, sb) in zip(a, b)]


def _groups(dims: tuple[tuple[int, int], ...]) -> list[int]:
    """Token counts that form one aligned mixed-radix sub-grid of ``dims``: 1, the innermost
    count, the two innermost ones' product, ..."""
    out = [1]
    for c, _ in reversed(dims):
        out.append(out[-1] * c)
    return out


def _token_pieces(spec: CopySpec, kv: int) -> TokenRuns:
    """The runs of ``spec`` cut into pieces whose tokens are one aligned sub-grid of K/V
    ``kv``'s token dims on both sides (greedy, largest first). Whole blocks of equal size
    on both sides stay whole, vectorized; only runs that cut a block are walked."""
    sizes = sorted(set(_groups(spec.src.token_dims(kv))) & set(_groups(spec.dst.token_dims(kv))), reverse=True)
    r = spec.runs
    whole = (r.src_slot == 0) & (r.dst_slot == 0) & (r.length == sizes[0])
    parts = [(r.start[whole], r.length[whole], r.src_block[whole], r.src_slot[whole], r.dst_block[whole],
              r.dst_slot[whole])]
    rest = []
    for i in np.flatnonzero(~whole).tolist():
        pos, left, ss, dsl = int(r.start[i]), int(r.length[i]), int(r.src_slot[i]), int(r.dst_slot[i])
        while left:
            g = next(g for g in sizes if g <= left and ss % g == 0 and dsl % g == 0)
            rest.append((pos, g, int(r.src_block[i]), ss, int(r.dst_block[i]), dsl))
            pos, left, ss, dsl = pos + g, left - g, ss + g, dsl + g
    if rest:
        parts.append(tuple(np.asarray(col, dtype=np.int64) for col in zip(*rest)))
    cols = [np.concatenate(c) for c in zip(*parts)]
    return TokenRuns(start=cols[0], length=cols[1], src_block=cols[2], src_slot=cols[3], dst_block=cols[4],
                     dst_slot=cols[5])


def count_segments(spec: CopySpec, exact_limit: int = 1 << 15) -> int:
    """Segments ``compile_segments(spec)`` yields: exact while the unmerged count is at
    most ``exact_limit``, else that count (an upper bound that ignores merges across
    boxes), computed without materializing anything."""
    return count_or_compile(spec, exact_limit)[0]


def count_or_compile(spec: CopySpec, exact_limit: int = 1 << 15) -> tuple[int, Segments | None]:
    """``count_segments``, plus the compiled segments when counting needed them (small
    plans), so a caller that then wants them does not compile twice."""
    total = _unmerged_if_token_bound(spec)
    if total is not None and total > exact_limit:  # large and one piece per token or finer: no runs needed
        return total, None
    total = 0
    for _, sel, kv, _, dims in _kv_classes(spec):
        kvs = spec.src.kv_factor if kv is None else 1
        total += sel.size * spec.src.num_layers * kvs * int(np.prod([d[0] for d in dims] or [1]))
    if total <= exact_limit:
        seg = compile_segments(spec)
        return seg.count, seg
    return total, None


def _unmerged_if_token_bound(spec: CopySpec) -> int | None:
    """The unmerged segment count when no run's tokens fold into one piece (then every
    token contributes the same pieces, whatever the runs): from the geometry alone,
    without cutting the range into runs. None when tokens fold on both sides."""
    s, d, h = spec.src, spec.dst, spec.heads
    if not (s.rows_contiguous and d.rows_contiguous):
        return None  # counted per K/V class below
    _, dims = _fold([(2, s.token_stride, d.token_stride), (h.count, s.head_stride, d.head_stride)], s.head_bytes)
    if not any(dim[0] == 2 and dim[1] == s.token_stride and dim[2] == d.token_stride for dim in dims):
        return None
    per_token = math.prod(dim[0] for dim in dims) // 2
    return s.num_layers * s.kv_factor * spec.num_tokens * per_token


def compile_segments(spec: CopySpec) -> Segments:
    """The coalesced byte segments that move ``spec`` directly from src to dst memory."""
    srcs, dsts, lens = [], [], []
    for runs, sel, kv, run, dims in _kv_classes(spec):
        a, b = _box_starts(spec, runs, sel, kv)
        if dims:
            sizes = [d[0] for d in dims]
            grid = np.indices(sizes, dtype=np.int64).reshape(len(dims), -1)
            off_a = (np.array([d[1] for d in dims], dtype=np.int64)[:, None] * grid).sum(0)
            off_b = (np.array([d[2] for d in dims], dtype=np.int64)[:, None] * grid).sum(0)
            a = (a[:, None] + off_a[None, :]).reshape(-1)
            b = (b[:, None] + off_b[None, :]).reshape(-1)
        srcs.append(a)
        dsts.append(b)
        lens.append(np.full(a.size, run, dtype=np.int64))
    src = np.concatenate(srcs)
    dst = np.concatenate(dsts)
    length = np.concatenate(lens)
    order = np.argsort(src, kind="stable")
    return coalesce(src[order], dst[order], length[order])


@dataclass(frozen=True)
class SideBoxes:
    """One side's share of a CopySpec as boxes in that side's address order.

    A box is one (layer, kv, block) of the side: slots ``slot[i] .. slot[i] + ntok[i]``
    of block ``block_pos[i]`` (index into the side's block list) of layer-and-kv
    ``lk[i]`` (= layer * kv_factor + kv), all mapped heads. Boxes are disjoint and sorted
    by ``addr`` (the box's first byte), so enumerating each box in memory order walks the
    side's bytes in increasing address order.
    """

    lk: np.ndarray
    block_pos: np.ndarray
    slot: np.ndarray
    ntok: np.ndarray
    addr: np.ndarray

    def by_length(self) -> list[tuple[int, slice | np.ndarray]]:
        """The boxes grouped by token count, as ``(ntok, selection)`` in increasing ntok: one
        group selecting all (``slice(None)``, box order kept) when every box is alike (whole
        blocks), else at most three (a partial first and last block), each an index array."""
        if self.ntok.size and (self.ntok == self.ntok[0]).all():
            return [(int(self.ntok[0]), slice(None))]
        return [(int(n), np.flatnonzero(self.ntok == n)) for n in np.unique(self.ntok)]

    def take(self, sel) -> "SideBoxes":
        """The boxes ``sel`` (a slice or index array) of these, in that order."""
        return SideBoxes(self.lk[sel], self.block_pos[sel], self.slot[sel], self.ntok[sel], self.addr[sel])


def side_boxes(spec: CopySpec, side: str) -> SideBoxes:
    """The boxes of ``side`` ('src' or 'dst'), sorted by address (computed once per spec)."""
    key = ("side_boxes", side)
    boxes = spec.derived.get(key)
    if boxes is None:
        boxes = spec.derived[key] = _side_boxes(spec, side)
    return boxes


def _side_boxes(spec: CopySpec, side: str) -> SideBoxes:
    lay, blocks, first = (
        (spec.src, spec.src_blocks, spec.src_first_token) if side == "src" else (spec.dst, spec.dst_blocks, spec.dst_first_token)
    )
    h0 = spec.heads.src_start if side == "src" else spec.heads.dst_start
    tpb = lay.tokens_per_block
    i0, i1 = (spec.start - first) // tpb, -(-(spec.stop - first) // tpb)
    pos = np.arange(i0, i1, dtype=np.int64)
    tok0 = first + pos * tpb
    a = np.maximum(spec.start, tok0) - tok0
    b = np.minimum(spec.stop, tok0 + tpb) - tok0
    if lay.rows_contiguous:
        per_block = blocks[pos] * lay.block_stride + a * lay.token_stride + h0 * lay.head_stride
        addr = (lay.base.reshape(-1, 1) + per_block[None, :]).reshape(-1)
    else:  # the token offsets are the K/V's own: lk = layer * kv_factor + kv
        per_block = blocks[pos] * lay.block_stride + h0 * lay.head_stride
        tok = lay.token_offsets[np.tile(np.arange(lay.kv_factor), lay.num_layers)][:, a]  # [L*kv, blocks]
        addr = (lay.base.reshape(-1, 1) + per_block[None, :] + tok).reshape(-1)
    order = np.argsort(addr, kind="stable")
    lk, j = np.divmod(order, pos.size)  # box k of the flat [lk, block] grid is (k // blocks, k % blocks)
    return SideBoxes(lk=lk, block_pos=pos[j], slot=a[j], ntok=(b - a)[j], addr=addr[order])


def _side_dims(lay: KVLayout, ntok: int, nheads: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(contiguous run, outer dims outer-first) of one box of ``ntok`` tokens on one side."""
    return _fold([(ntok, lay.token_stride, lay.token_stride), (nheads, lay.head_stride, lay.head_stride)], lay.head_bytes)


def side_runs(spec: CopySpec, side: str) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, lengths) of the maximal contiguous byte runs ``spec`` touches on
    ``side``, in increasing address order. A dense staging buffer laid out in this order
    holds the run bytes back to back."""
    lay = spec.src if side == "src" else spec.dst
    if not lay.rows_contiguous:
        raise LayoutError(f"the {lay.engine} layout's head rows are element-strided: it has no contiguous runs "
                          "to send or receive staged bytes in its own order")
    bx = side_boxes(spec, side)
    nh = spec.heads.count
    classes = bx.by_length()
    parts_addr, parts_len, parts_key = [], [], []
    for n, sel in classes:
        run, dims = _side_dims(lay, n, nh)
        a = bx.addr[sel]
        per_box = 1
        if dims:
            grid = np.indices([d[0] for d in dims], dtype=np.int64).reshape(len(dims), -1)
            off = (np.array([d[1] for d in dims], dtype=np.int64)[:, None] * grid).sum(0)
            a = (a[:, None] + off[None, :]).reshape(-1)
            per_box = off.size
        parts_addr.append(a)
        parts_len.append(np.full(a.size, run, dtype=np.int64))
        if len(classes) > 1:
            parts_key.append(np.repeat(sel, per_box))
    if len(classes) == 1:
        addr, length = parts_addr[0], parts_len[0]
    else:  # back to box order (the boxes are in address order)
        addr, length = np.concatenate(parts_addr), np.concatenate(parts_len)
        order = np.argsort(np.concatenate(parts_key), kind="stable")
        addr, length = addr[order], length[order]
    seg = coalesce(addr, addr, length)
    return seg.src, seg.length


def check_segments_inside(addrs: np.ndarray, lengths: np.ndarray, allowed: np.ndarray, what: str) -> None:
    """Raise LayoutError unless every ``[addr, addr + length)`` lies inside one allowed
    ``[start, end)`` row of ``allowed`` (int64 ``[n, 2]``, sorted, non-overlapping).
    The guard that runs before any byte moves into a peer's memory."""
    if addrs.size == 0:
        return
    rng = np.asarray(allowed, dtype=np.int64).reshape(-1, 2)
    if rng.size == 0:
        raise LayoutError(f"{what}: no memory is allowed")
    if rng.shape[0] == 1 and int(addrs.min()) >= rng[0, 0] and int((addrs + lengths).max()) <= rng[0, 1] \
            and int(lengths.min()) > 0:
        return  # one allowed range (contiguous blocks) and all inside: the common case, in a few calls
    idx = np.searchsorted(rng[:, 0], addrs, side="right") - 1
    ok = (idx >= 0) & (lengths > 0)
    idx = np.clip(idx, 0, None)
    ok &= addrs + lengths <= rng[idx, 1]
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise LayoutError(
            f"{what}: {int((~ok).sum())} segment(s) outside the allowed memory, first at "
            f"0x{int(addrs[i]):x} (+{int(lengths[i])} B)"
        )


def block_ranges(layout: KVLayout, blocks: np.ndarray) -> np.ndarray:
    """Sorted, merged byte ranges ``[start, end)`` (int64 ``[n, 2]``) that ``blocks`` occupy
    in ``layout`` over every (layer, kv)."""
    starts = np.sort((layout.base.reshape(-1, 1) + np.asarray(blocks, dtype=np.int64)[None, :] * layout.block_stride).reshape(-1))
    ends = starts + layout.block_bytes
    if starts.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    new = np.concatenate(([True], starts[1:] > np.maximum.accumulate(ends)[:-1]))
    heads = np.flatnonzero(new)
    return np.stack([starts[heads], np.maximum.reduceat(ends, heads)], axis=1)
