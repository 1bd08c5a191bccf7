"""Repack kernels: move a CopySpec's head-rows between a pool and a dense staging buffer.

A *row* is one head of one token of one (layer, kv): ``head_dim * itemsize`` contiguous
bytes on both sides, the largest unit two different layouts share. A staging buffer
holds a spec's rows back to back, in the address order of one side:

- ``Gather`` (sender): source pool -> staging in the DESTINATION's address order, so
  the wire carries the destination's contiguous runs (``side_runs(spec, 'dst')``);
- ``Scatter`` (receiver): staging in the SOURCE's address order -> destination pool,
  the wire having carried the source's runs.

Each is ONE indexed copy (``index_select`` into the staging, ``index_copy_`` out of it)
over a row view of the pool's memory, on CPU or CUDA alike; a pool whose rows are
element-strided (``KVLayout.row_strides``: vLLM's transposed K, its 'amx' interleaved
tiles) is read or written through one strided view per K/V (its element dims), so one
indexed copy per K/V. Row indices are computed once per spec with numpy (``prepare``)
and reused; a pool made of several tensors (one per layer, as SGLang's) is read through
one zero-copy alias of the address span that holds them, so any row of any layer is one
index away.

Box path: where every box of the staging's order side (one (layer, kv, block) of the
side whose address order the staging follows) holds the same number of tokens and lies
inside ONE block of the pool side too (whole source pages -> whole destination blocks,
e.g. SGLang page 64 -> TensorRT-LLM block 32), each box is one strided tile of the pool
at a per-box offset: ``[A, C, row]`` with the pool's strides, ``(A, C)`` the order side's
(heads, tokens) or (tokens, heads). Such a copy indexes tiles, one int64 per box (256x
fewer than rows for a 64-token x 8-head box; built in microseconds), and moves each
tile with one strided copy (one memcpy where the tile is contiguous on both sides). A
part whose row range cuts a box copies the cut ends row by row. Element-strided pools
and boxes that cross a pool block boundary use the row index (the fallback).

On CPU the tiles are copied by a small C kernel (``tiles``: ``_tilecopy``, built with the
package) when it is there: it walks each tile in the POOL's address order (the source rows are
read as one stream, the staging written as A streams) and streams its stores past the
cache for copies of ``STREAM_MIN_BYTES`` or more, on the calling thread with the GIL
released. On the 2-core CI host that moved 512 MiB at 0.83-0.88 of a two-thread memcpy on
ONE thread, where torch's strided copy (which walks the staging's order) reached 0.5-0.6
on two (docs/benchmarks.md). Without it (no compiler at install time, or
``native=False``), torch's copies do the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .copyspec import CopySpec
from .geometry import KVLayout, LayoutError
from .pools import alias_memory
from .segments import SideBoxes, side_boxes
from .tiles import BoxTiles, CopySplit, native_tile_copy

__all__ = ["Gather", "Scatter", "row_addresses", "repack"]

_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
CPU_COPY_ELEMENTS = 32768  # ATen's GRAIN_SIZE: a CPU copy this small runs on the calling thread (_PoolRows._copies)
CPU_INLINE_BYTES = 1 << 20  # CPU copies up to this size are kept on the calling thread (_PoolRows._copies)


def row_addresses(spec: CopySpec, order: str, want: str = "both"):
    """(source address, destination address) of every row of ``spec``, in increasing
    address order of side ``order`` ('src' or 'dst'). int64 arrays of ``rows`` entries.
    ``want='src'`` or ``'dst'`` computes and returns only that side's array.

    Each box of ``side_boxes`` contributes ``ntok x heads`` rows; a row's address on a
    side is (per box) + (per token) + (per head), so each array is one broadcast sum of
    small terms, laid out in ``order``'s memory order inside the box."""
    return _box_rows(spec, order, want, side_boxes(spec, order))


def _box_rows(spec: CopySpec, order: str, want: str, bx: SideBoxes, origin: int = 0, unit: int = 1):
    """``row_addresses`` of the boxes ``bx`` only (a slice of ``side_boxes(spec, order)``);
    with ``want`` one side, as ``(address - origin) // unit`` (``unit`` divides every
    term of a row's address less ``origin``), computed in the same single pass."""
    if want == "both" and (origin or unit != 1):
        raise ValueError("origin and unit apply to one side's rows")
    X, Y = (spec.src, spec.dst) if order == "src" else (spec.dst, spec.src)
    x_first, y_first = (spec.src_first_token, spec.dst_first_token) if order == "src" else (spec.dst_first_token, spec.src_first_token)
    y_blocks = spec.dst_blocks if order == "src" else spec.src_blocks
    hy = spec.heads.dst_start if order == "src" else spec.heads.src_start
    nh = spec.heads.count
    need_x = want in ("both", order)
    need_y = want in ("both", "dst" if order == "src" else "src")
    head_major = X.head_stride > X.token_stride  # enumerate heads outside tokens inside a box
    # each box's first token, relative to the boxes' first one; where those tokens live on Y
    first_tok = x_first + bx.block_pos * X.tokens_per_block + bx.slot
    lo = int(first_tok.min()) if first_tok.size else spec.start
    hi = int((first_tok + bx.ntok).max()) if first_tok.size else spec.start
    first_tok = first_tok - lo
    rel = np.arange(lo, hi, dtype=np.int64) - y_first
    y_blk = y_blocks[rel // Y.tokens_per_block] * Y.block_stride
    # [kv_factor, tokens]: a token's offset in its block, by K/V (rows of a strided layout differ)
    y_tok = y_blk[None, :] + Y.token_offsets[:, rel % Y.tokens_per_block]
    y_head = (hy + np.arange(nh, dtype=np.int64)) * Y.head_stride
    y_base = Y.base.reshape(-1)
    x_addr, x_tok, x_head = bx.addr, X.token_offsets, X.head_stride
    if unit != 1 or origin:
        if need_x:
            x_addr, x_tok, x_head = (x_addr - origin) // unit, x_tok // unit, x_head // unit
        else:
            y_tok, y_head, y_base = y_tok // unit, y_head // unit, (y_base - origin) // unit
    x_plain, y_plain = X.rows_contiguous, Y.rows_contiguous
    kvf = Y.kv_factor
    classes = bx.by_length()
    xs, ys, keys = [], [], []
    for n, sel in classes:
        count = bx.ntok.size if len(classes) == 1 else sel.size
        t = np.arange(n, dtype=np.int64)

        def grid(per_box, per_tok, per_head):  # [count, nh, n] (head-major) or [count, n, nh], flattened
            box_tok = per_box[:, None] + per_tok  # [count, n]: small; the head term makes it full size
            if head_major:
                return (box_tok[:, None, :] + per_head[None, :, None]).reshape(-1)
            return (box_tok[:, :, None] + per_head[None, None, :]).reshape(-1)

        if need_x:  # a token's offset from its box's first token
            if x_plain:
                per_tok = np.broadcast_to(x_tok[0, :n], (count, n))
            else:
                kv, slot = bx.lk[sel] % kvf, bx.slot[sel]
                per_tok = x_tok[kv[:, None], slot[:, None] + t[None, :]] - x_tok[kv, slot][:, None]
            xs.append(grid(x_addr[sel], per_tok, np.arange(nh, dtype=np.int64) * x_head))
        if need_y:
            cols = first_tok[sel][:, None] + t[None, :]
            per_tok = y_tok[0][cols] if y_plain else y_tok[(bx.lk[sel] % kvf)[:, None], cols]
            ys.append(grid(y_base[bx.lk[sel]], per_tok, y_head))
        if len(classes) > 1:
            keys.append(np.repeat(sel, n * nh))
    order_idx = np.argsort(np.concatenate(keys), kind="stable") if keys else None

    def join(parts):
        if not parts:
            return None
        a = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return a[order_idx] if order_idx is not None else a

    x, y = join(xs), join(ys)
    src, dst = (x, y) if order == "src" else (y, x)
    if want == "src":
        return src
    if want == "dst":
        return dst
    return src, dst


@dataclass
class _RowSpace:
    """Every row-start of one layout's memory as rows of ``row_units`` elements; for a
    layout with element-strided rows, ``strided[kv]`` is the same memory as rows of
    ``head_dim`` elements laid out by that K/V's element dims (one view per K/V)."""

    rows: torch.Tensor  # [n_units - row_units + 1, row_units], overlapping rows, stride (1, 1)
    base: int  # address of element 0
    unit: int
    keep: object  # whatever keeps the alias valid
    strided: tuple[torch.Tensor, ...] = ()  # per K/V: [n, *counts], strides (1, *element strides / unit)

    def read(self, kv: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of K/V ``kv``'s element-strided view, as ``[len(index), head_dim]``."""
        return self.strided[kv].index_select(0, index).reshape(index.numel(), -1)

    def write(self, kv: int, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Put ``rows`` (``[len(index), head_dim]``) at rows ``index`` of K/V ``kv``'s element-strided view."""
        view = self.strided[kv]
        view.index_copy_(0, index, rows.reshape(rows.shape[0], *view.shape[1:]))


def _row_space(lay: KVLayout, row_bytes: int, unit: int) -> _RowSpace:
    if lay.tensors is None:
        raise LayoutError(f"{lay.engine} layout has no local tensors")
    starts = [r.addr for r in lay.regions]
    ends = [r.addr + r.nbytes for r in lay.regions]
    lo, hi = min(starts), max(ends)
    dev = lay.tensors[0].device
    if len(lay.tensors) == 1 and lay.tensors[0].data_ptr() == lo:
        flat = lay.tensors[0].reshape(-1).view(torch.uint8)[: hi - lo]
        keep = lay.tensors
    else:
        flat = alias_memory(lo, hi - lo, dev)
        keep = lay.tensors
    flat = flat.view(_UNITS[unit])
    ru = row_bytes // unit
    strided = ()
    if not lay.rows_contiguous:  # unit == itemsize here (_layout_unit)
        strided = []
        for kv in range(lay.kv_factor):
            dims = lay.elem_dims(kv)
            reach = sum((c - 1) * (e // unit) for c, e in dims)
            strided.append(flat.as_strided((flat.numel() - reach, *(c for c, _ in dims)),
                                           (1, *(e // unit for _, e in dims))))
        strided = tuple(strided)
    return _RowSpace(flat.as_strided((flat.numel() - ru + 1, ru), (1, 1)), lo, unit, keep, strided)


def _layout_unit(lay: KVLayout, row_bytes: int) -> int:
    """The coarsest element (8, 4, 2 or 1 bytes) every row start of ``lay`` is aligned to
    (for element-strided rows: the element itself, which must be aligned)."""
    lo = min(r.addr for r in lay.regions)
    mask = int(np.bitwise_or.reduce((lay.base - lo).reshape(-1))) if lay.base.size else 0
    mask |= lay.block_stride | lay.token_stride | lay.head_stride | row_bytes | 8
    if lay.rows_contiguous:
        return mask & -mask
    mask |= int(np.bitwise_or.reduce([st for kv in range(lay.kv_factor)
                                      for _, st in lay.token_dims(kv) + lay.elem_dims(kv)]))
    unit = mask & -mask
    if unit < lay.itemsize or lay.itemsize not in _UNITS:
        raise LayoutError(f"{lay.engine} layout: element-strided rows of {lay.itemsize}-byte elements "
                          f"that are not {lay.itemsize}-byte aligned cannot be repacked")
    return lay.itemsize


class _PoolRows:
    """The rows of ``spec`` on its ``pool`` side ('src' or 'dst'), listed in increasing
    address order of side ``order``, as indices into a row view of that pool's memory;
    a staging buffer of ``nbytes`` holds them back to back in that order.

    The index is computed on first use (``addr``, when given, is every row's address);
    a row range asked for before that computes only the boxes that hold it."""

    def __init__(self, spec: CopySpec, pool: str, order: str, addr: np.ndarray | None = None, tiles: bool = True,
                 native: bool | None = None):
        lay = spec.src if pool == "src" else spec.dst
        self.spec, self._pool, self._order = spec, pool, order
        self.row_bytes = lay.head_bytes
        key = ("row_space", self.row_bytes)
        self._space = lay.derived.get(key)
        if self._space is None:
            self._space = lay.derived[key] = _row_space(lay, self.row_bytes, _layout_unit(lay, self.row_bytes))
        self._device = lay.tensors[0].device
        self._strided = not lay.rows_contiguous
        self._kvf = lay.kv_factor
        self._boxes = side_boxes(spec, order)
        self._box_end = np.cumsum(self._boxes.ntok * spec.heads.count)
        self.rows = int(self._box_end[-1]) if self._box_end.size else 0
        self.nbytes = self.rows * self.row_bytes
        self._index = None if addr is None else self._to_index(addr)
        self._tiles = BoxTiles.of(spec, pool, order, self._boxes, self._space) if tiles else None
        if native and not native_tile_copy():
            raise LayoutError("native=True: kvbridge.layout._tilecopy was not built (no C compiler at install time?)")
        self._native = (self._tiles is not None and self._device.type == "cpu" and native_tile_copy()
                        and native is not False)

    @property
    def native(self) -> bool:
        """Whether whole tiles are copied by the C tile copy (else by torch)."""
        return self._native

    @property
    def box_path(self) -> bool:
        """Whether whole boxes are copied as strided tiles (else every row is indexed)."""
        return self._tiles is not None

    @property
    def index(self) -> torch.Tensor:
        """Every row's index into the pool's row view, int64 ``[rows]`` on the pool's device."""
        if self._index is None:
            self._index = self._rows_index(self._boxes)
        return self._index

    def prepare(self) -> "_PoolRows":
        """Build the whole row index now (for a repack that will run many times; the box
        path's tile index is built with the repack already); returns self."""
        if self._tiles is None:
            self.index
        return self

    def _rows_index(self, boxes: SideBoxes, a: int = 0, b: int | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` (counted from the first of ``boxes``) of ``boxes`` as indices."""
        units = _box_rows(self.spec, self._order, self._pool, boxes, self._space.base, self._space.unit)
        return torch.from_numpy(units[a:b]).to(self._device)

    def _to_index(self, addr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((addr - self._space.base) // self._space.unit).to(self._device)

    def _index_of(self, a: int, b: int) -> torch.Tensor:
        """The index of rows ``[a, b)``: a slice of the whole index once it exists, else
        computed from the boxes that hold those rows only."""
        if self._index is not None or (a == 0 and b == self.rows):
            return self.index[a:b]
        if b <= a:
            return torch.empty(0, dtype=torch.int64, device=self._device)
        i = int(np.searchsorted(self._box_end, a, side="right"))
        j = int(np.searchsorted(self._box_end, b - 1, side="right")) + 1
        first = int(self._box_end[i - 1]) if i else 0
        return self._rows_index(self._boxes.take(slice(i, j)), a - first, b - first)

    def _gather_into(self, staging: torch.Tensor, rows: tuple[int, int] | None = None, inline: bool | None = None,
                     split: CopySplit | None = None) -> int:
        a, b = rows if rows is not None else (0, self.rows)
        if not 0 <= a <= b <= self.rows:
            raise LayoutError(f"row range [{a}, {b}) outside the {self.rows} rows of this repack")
        nbytes = (b - a) * self.row_bytes
        t = self._tiles
        if (self._native and a % t.rows == 0 and b % t.rows == 0 and staging.dim() == 1
                and staging.is_contiguous() and staging.dtype == torch.uint8 and staging.data_ptr() % self._space.unit == 0):
            # a pipeline's part of whole boxes: one C call, no staging views (their cost per part
            # was a fifth of a 4 MiB part's copy)
            t.native_copy(a // t.rows, b // t.rows, staging, scatter=False, split=split)
            return nbytes
        out = _staging_rows(staging, nbytes, self.row_bytes, self._space.unit)
        if self._tiles is not None:
            pieces = self._tiles_pieces(out, a, b, inline)
        elif self._strided:
            index = self._index_of(a, b)
            pieces = [lambda kv=kv, pos=pos: out.index_copy_(0, pos, self._space.read(kv, index[pos]))
                      for kv, pos in self._by_kv(a, b)]
        else:
            pieces = self._rows_pieces(out, a, b, inline)
        for piece in pieces:
            piece()
        self._complete()
        return nbytes

    def _scatter_from(self, staging: torch.Tensor, split: CopySplit | None = None) -> int:
        src = _staging_rows(staging, self.nbytes, self.row_bytes, self._space.unit)
        if self._native:
            self._tiles.native_copy(0, self._tiles.count, src, scatter=True, split=split)
            return self.nbytes
        if self._tiles is not None:
            t = self._tiles
            for i, j in self._box_copies(0, t.count, None):
                t.view.index_copy_(0, t.index[i:j], src[i * t.rows:j * t.rows].view(j - i, *t.shape))
            self._complete()
            return self.nbytes
        index = self.index
        if self._strided:
            for kv, pos in self._by_kv(0, self.rows):
                self._space.write(kv, index[pos], src.index_select(0, pos))
        else:
            for i, j in self._copies(self.rows):
                self._space.rows.index_copy_(0, index[i:j], src[i:j])
        self._complete()
        return self.nbytes

    def _tiles_pieces(self, out: torch.Tensor, a: int, b: int, inline: bool | None) -> list:
        """The copies that put staging rows ``[a, b)`` into ``out`` (row 0 = row ``a``):
        whole boxes as tiles, the rows of a box the range cuts through the row index of
        those rows only. Each a thunk; they write disjoint rows (any order, any thread).
        The C copy's whole boxes go in one call."""
        t = self._tiles
        i0, i1 = -(-a // t.rows), b // t.rows  # whole boxes [i0, i1)
        if i0 >= i1:  # inside one box (or across one boundary, no whole box)
            return self._rows_pieces(out, a, b, inline)
        pieces = self._rows_pieces(out[: i0 * t.rows - a], a, i0 * t.rows, inline)
        if self._native:  # one C call (the GIL released)
            pieces.append(lambda: t.native_copy(i0, i1, out[i0 * t.rows - a:], scatter=False))
            return pieces + self._rows_pieces(out[i1 * t.rows - a:], i1 * t.rows, b, inline)
        for i, j in self._box_copies(i0, i1, inline):
            pieces.append(lambda i=i, j=j: torch.index_select(
                t.view, 0, t.index[i:j], out=out[i * t.rows - a: j * t.rows - a].view(j - i, *t.shape)))
        return pieces + self._rows_pieces(out[i1 * t.rows - a:], i1 * t.rows, b, inline)

    def _rows_pieces(self, out: torch.Tensor, a: int, b: int, inline: bool | None) -> list:
        """Rows ``[a, b)`` into ``out`` through their row index (contiguous-row pools): thunks."""
        if b <= a:
            return []
        index = self._index_of(a, b)
        return [lambda i=i, j=j: torch.index_select(self._space.rows, 0, index[i:j], out=out[i:j])
                for i, j in self._copies(b - a, inline)]

    def _box_copies(self, i0: int, i1: int, inline: bool | None) -> list[tuple[int, int]]:
        """Box ranges of one tiled copy each: ``_copies``' rule, counted in boxes."""
        rows = self._tiles.rows
        return [(i0 + i // rows, i0 + -(-j // rows)) for i, j in self._copies_aligned((i1 - i0) * rows, rows, inline)]

    def _copies_aligned(self, rows: int, align: int, inline: bool | None) -> list[tuple[int, int]]:
        cuts = self._copies(rows, inline)
        if len(cuts) == 1:
            return cuts
        step = max(align, (cuts[0][1] - cuts[0][0]) // align * align)
        return [(i, min(rows, i + step)) for i in range(0, rows, step)]

    def _by_kv(self, a: int, b: int) -> list[tuple[int, torch.Tensor]]:
        """Rows ``[a, b)`` (relative to ``a``) grouped by K/V: a strided pool reads K and V
        rows through different views. (kv, positions) for each K/V that has rows there."""
        bx = self._boxes
        kv_of_row = np.repeat(bx.lk % self._kvf, bx.ntok * self.spec.heads.count)[a:b]
        out = []
        for kv in range(self._kvf):
            pos = np.flatnonzero(kv_of_row == kv)
            if pos.size:
                out.append((kv, torch.from_numpy(pos).to(self._device)))
        return out

    def _complete(self) -> None:
        """Return only once the copy is done: on a GPU the kernels are asynchronous, and
        what comes next (the transfer engine reading the staging, the decode engine
        reading its pool) is not ordered after them by any stream."""
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _copies(self, rows: int, inline: bool | None = None) -> list[tuple[int, int]]:
        """Row ranges of one indexed copy each. On CPU, an ``inline`` copy is cut into
        copies of at most ``CPU_COPY_ELEMENTS`` elements, which ATen runs on the calling
        thread; one copy of it all enters torch's OpenMP pool (faster when cores are free,
        but its threads sleep after idle and take milliseconds to wake on this 2-core
        host: after 10 ms idle a 1 MiB part took 5.3 ms that way, 0.46 ms inline; torch
        2.14.1). ``inline=None``: inline up to ``CPU_INLINE_BYTES``. GPU copies go as one."""
        if inline is None:
            inline = rows * self.row_bytes <= CPU_INLINE_BYTES
        if self._device.type != "cpu" or not inline or not CPU_COPY_ELEMENTS:
            return [(0, rows)]
        step = max(1, CPU_COPY_ELEMENTS // (self.row_bytes // self._space.unit))
        return [(i, min(rows, i + step)) for i in range(0, rows, step)]


class Gather(_PoolRows):
    """Sender-side repack: ``spec``'s rows from the source pool into a dense staging buffer
    in the destination's address order. Prepared once; ``run`` may be called repeatedly.
    Its row index is built on first use; ``run(rows=...)`` before that builds only the
    part it needs, so a pipelined send's first part waits for a fraction of that work.
    ``tiles=False``: every row through the row index, never the box path (for comparison).

    Staging: ``nbytes`` bytes, ``[rows, head_dim]`` of the KV dtype, row ``i`` = the
    ``i``-th row of the destination in increasing address order (``order='src'``: of the
    source, what a ``Scatter`` on the other side reads: a ``staged_both`` plan).
    """

    def __init__(self, spec: CopySpec, src_addr: np.ndarray | None = None, *, tiles: bool = True,
                 native: bool | None = None, order: str = "dst"):
        if order not in ("src", "dst"):
            raise ValueError(f"order must be 'src' or 'dst', got {order!r}")
        super().__init__(spec, "src", order, src_addr, tiles, native)

    def run(self, staging: torch.Tensor, rows: tuple[int, int] | None = None, *, inline: bool | None = None,
            split: CopySplit | None = None) -> int:
        """Fill ``staging`` (a tensor of at least ``nbytes`` bytes on the pool's device); returns
        bytes once they are all in place (on a GPU too), so ``staging`` may be sent at once.
        With ``rows=(a, b)``, only staging rows ``[a, b)``, written at the START of ``staging``
        (``(b - a) * row_bytes`` bytes): one part of a pipelined gather. ``inline=True`` keeps
        a CPU gather on the calling thread (torch's intra-op threads stay out of it), False
        lets torch spread it; by default only copies up to ``CPU_INLINE_BYTES`` stay inline.
        ``split``: the C tile copy of whole boxes spread over its threads (else one)."""
        return self._gather_into(staging, rows, inline, split)


class Scatter(_PoolRows):
    """Receiver-side repack: a dense staging buffer in the source's address order into the
    destination pool. Prepared once; ``run`` may be called repeatedly.

    Staging: ``nbytes`` bytes, row ``i`` = the ``i``-th row of the source in increasing
    address order (what ``side_runs(spec, 'src')`` put on the wire).
    """

    def __init__(self, spec: CopySpec, dst_addr: np.ndarray | None = None, *, tiles: bool = True,
                 native: bool | None = None):
        super().__init__(spec, "dst", "src", dst_addr, tiles, native)

    def run(self, staging: torch.Tensor, *, split: CopySplit | None = None) -> int:
        """Write ``staging``'s rows into the destination pool; returns bytes once they are in
        place. ``split``: the C tile copy spread over its threads (else one)."""
        return self._scatter_from(staging, split)


def _staging_rows(staging: torch.Tensor, nbytes: int, row_bytes: int, unit: int) -> torch.Tensor:
    flat = staging if staging.dtype == torch.uint8 and staging.dim() == 1 else staging.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise LayoutError(f"staging buffer of {flat.numel()} B is smaller than the {nbytes} B needed")
    if flat.data_ptr() % unit:
        raise LayoutError(f"staging buffer at 0x{flat.data_ptr():x} is not {unit}-byte aligned")
    return flat[:nbytes].view(_UNITS[unit]).view(-1, row_bytes // unit)


def repack(spec: CopySpec) -> int:
    """Copy ``spec`` between two local pools (same device): gather into a temporary staging
    buffer in the destination's order, then scatter it. Returns the bytes moved."""
    if spec.src.device != spec.dst.device:
        raise LayoutError(f"repack needs both sides on one device, got {spec.src.device} and {spec.dst.device}")
    src_addr, dst_addr = row_addresses(spec, "dst")
    gather = Gather(spec, src_addr)
    tmp = torch.empty(gather.nbytes, dtype=torch.uint8, device=spec.src.device)
    gather.run(tmp)
    return _PoolRows(spec, "dst", "dst", dst_addr)._scatter_from(tmp)
