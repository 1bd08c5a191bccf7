"""Repack kernels: move a CopySpec's head-rows between a pool and a dense staging buffer.

A *row* is one head of one token of one (layer, kv): ``head_dim * itemsize`` contiguous
bytes on both sides, the largest unit two different layouts share. A staging buffer
holds a spec's rows back to back, in the address order of one side:

- ``Gather`` (sender): source pool -> staging in the DESTINATION's address order, so
  the wire carries the destination's contiguous runs (``side_runs(spec, 'dst')``);
- ``Scatter`` (receiver): staging in the SOURCE's address order -> destination pool,
  the wire having carried the source's runs.

Each is ONE indexed copy (``index_select`` into the staging, ``index_copy_`` out of it)
over a row view of the pool's memory, on CPU or CUDA alike. Row indices are computed
once per spec with numpy (``prepare``) and reused; a pool made of several tensors (one
per layer, as SGLang's) is read through one zero-copy alias of the address span that
holds them, so any row of any layer is one index away.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from .copyspec import CopySpec
from .geometry import KVLayout, LayoutError
from .segments import side_boxes

__all__ = ["Gather", "Scatter", "row_addresses", "repack"]

_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def row_addresses(spec: CopySpec, order: str, want: str = "both"):
    """(source address, destination address) of every row of ``spec``, in increasing
    address order of side ``order`` ('src' or 'dst'). int64 arrays of ``rows`` entries.
    ``want='src'`` or ``'dst'`` computes and returns only that side's array.

    Each box of ``side_boxes`` contributes ``ntok x heads`` rows; a row's address on a
    side is (per box) + (per token) + (per head), so each array is one broadcast sum of
    small terms, laid out in ``order``'s memory order inside the box."""
    X, Y = (spec.src, spec.dst) if order == "src" else (spec.dst, spec.src)
    x_first, y_first = (spec.src_first_token, spec.dst_first_token) if order == "src" else (spec.dst_first_token, spec.src_first_token)
    y_blocks = spec.dst_blocks if order == "src" else spec.src_blocks
    hy = spec.heads.dst_start if order == "src" else spec.heads.src_start
    nh = spec.heads.count
    need_x = want in ("both", order)
    need_y = want in ("both", "dst" if order == "src" else "src")
    bx = side_boxes(spec, order)
    head_major = X.head_stride > X.token_stride  # enumerate heads outside tokens inside a box
    # per token of the request: where it lives on Y (block and slot)
    toks = np.arange(spec.start, spec.stop, dtype=np.int64)
    rel = toks - y_first
    y_tok = y_blocks[rel // Y.tokens_per_block] * Y.block_stride + (rel % Y.tokens_per_block) * Y.token_stride
    y_head = (hy + np.arange(nh, dtype=np.int64)) * Y.head_stride
    y_base = Y.base.reshape(-1)
    xs, ys, keys = [], [], []
    for n in np.unique(bx.ntok):
        n = int(n)
        sel = np.flatnonzero(bx.ntok == n)
        t = np.arange(n, dtype=np.int64)
        shape = (sel.size, nh, n) if head_major else (sel.size, n, nh)

        def grid(per_box, per_tok, per_head):
            tok_term = per_tok[:, None, :] if head_major else per_tok[:, :, None]
            head_term = per_head[None, :, None] if head_major else per_head[None, None, :]
            return np.broadcast_to(per_box[:, None, None] + tok_term + head_term, shape).reshape(-1)

        if need_x:
            xs.append(grid(bx.addr[sel], np.broadcast_to(t * X.token_stride, (sel.size, n)),
                           np.arange(nh, dtype=np.int64) * X.head_stride))
        if need_y:
            first_tok = x_first + bx.block_pos[sel] * X.tokens_per_block + bx.slot[sel] - spec.start
            ys.append(grid(y_base[bx.lk[sel]], y_tok[first_tok[:, None] + t[None, :]], y_head))
        keys.append(np.repeat(sel.astype(np.int64), n * nh))
    order_idx = np.argsort(np.concatenate(keys), kind="stable") if len(keys) > 1 else None

    def join(parts):
        if not parts:
            return None
        a = np.concatenate(parts)
        return a[order_idx] if order_idx is not None else a

    x, y = join(xs), join(ys)
    src, dst = (x, y) if order == "src" else (y, x)
    if want == "src":
        return src
    if want == "dst":
        return dst
    return src, dst


class _CudaSpan:
    """Minimal ``__cuda_array_interface__`` exporter for a zero-copy device alias."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


@dataclass
class _RowSpace:
    """Every row-start of one layout's memory as rows of ``row_units`` elements."""

    rows: torch.Tensor  # [n_units - row_units + 1, row_units], overlapping rows, stride (1, 1)
    base: int  # address of element 0
    unit: int
    keep: object  # whatever keeps the alias valid


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
    elif dev.type == "cpu":
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))
        flat = torch.from_numpy(arr)
        keep = (arr, lay.tensors)
    else:
        flat = torch.as_tensor(_CudaSpan(lo, hi - lo), device=dev)
        keep = lay.tensors
    flat = flat.view(_UNITS[unit])
    ru = row_bytes // unit
    return _RowSpace(flat.as_strided((flat.numel() - ru + 1, ru), (1, 1)), lo, unit, keep)


def _rows_of(lay: KVLayout, addrs: np.ndarray, row_bytes: int) -> tuple[_RowSpace, torch.Tensor]:
    """A row view of ``lay``'s memory and the index of each address in it (on its device)."""
    lo = min(r.addr for r in lay.regions)
    mask = int(np.bitwise_or.reduce(addrs - lo)) if addrs.size else 0
    mask |= row_bytes | 8
    unit = mask & -mask  # the coarsest element every row start is aligned to
    space = _row_space(lay, row_bytes, unit)
    index = torch.from_numpy((addrs - space.base) // unit).to(lay.tensors[0].device)
    return space, index


class _PoolRows:
    """The rows of ``spec`` on its ``pool`` side ('src' or 'dst'), listed in increasing
    address order of side ``order``, as indices into a row view of that pool's memory;
    a staging buffer of ``nbytes`` holds them back to back in that order."""

    def __init__(self, spec: CopySpec, pool: str, order: str, addr: np.ndarray | None = None):
        lay = spec.src if pool == "src" else spec.dst
        if addr is None:
            addr = row_addresses(spec, order, want=pool)
        self.spec = spec
        self.row_bytes = lay.head_bytes
        self._space, self.index = _rows_of(lay, addr, self.row_bytes)
        self.rows = int(addr.size)
        self.nbytes = self.rows * self.row_bytes

    def _gather_into(self, staging: torch.Tensor, rows: tuple[int, int] | None = None) -> int:
        a, b = rows if rows is not None else (0, self.rows)
        if not 0 <= a <= b <= self.rows:
            raise LayoutError(f"row range [{a}, {b}) outside the {self.rows} rows of this repack")
        nbytes = (b - a) * self.row_bytes
        out = _staging_rows(staging, nbytes, self.row_bytes, self._space.unit)
        index = self.index if rows is None else self.index[a:b]
        torch.index_select(self._space.rows, 0, index, out=out)
        return nbytes

    def _scatter_from(self, staging: torch.Tensor) -> int:
        src = _staging_rows(staging, self.nbytes, self.row_bytes, self._space.unit)
        self._space.rows.index_copy_(0, self.index, src)
        return self.nbytes


class Gather(_PoolRows):
    """Sender-side repack: ``spec``'s rows from the source pool into a dense staging buffer
    in the destination's address order. Prepared once; ``run`` may be called repeatedly.

    Staging: ``nbytes`` bytes, ``[rows, head_dim]`` of the KV dtype, row ``i`` = the
    ``i``-th row of the destination in increasing address order.
    """

    def __init__(self, spec: CopySpec, src_addr: np.ndarray | None = None):
        super().__init__(spec, "src", "dst", src_addr)

    def run(self, staging: torch.Tensor, rows: tuple[int, int] | None = None) -> int:
        """Fill ``staging`` (a tensor of at least ``nbytes`` bytes on the pool's device); returns bytes.
        With ``rows=(a, b)``, only staging rows ``[a, b)``, written at the START of ``staging``
        (``(b - a) * row_bytes`` bytes): one part of a pipelined gather."""
        return self._gather_into(staging, rows)


class Scatter(_PoolRows):
    """Receiver-side repack: a dense staging buffer in the source's address order into the
    destination pool. Prepared once; ``run`` may be called repeatedly.

    Staging: ``nbytes`` bytes, row ``i`` = the ``i``-th row of the source in increasing
    address order (what ``side_runs(spec, 'src')`` put on the wire).
    """

    def __init__(self, spec: CopySpec, dst_addr: np.ndarray | None = None):
        super().__init__(spec, "dst", "src", dst_addr)

    def run(self, staging: torch.Tensor) -> int:
        """Write ``staging``'s rows into the destination pool; returns bytes."""
        return self._scatter_from(staging)


def _staging_rows(staging: torch.Tensor, nbytes: int, row_bytes: int, unit: int) -> torch.Tensor:
    flat = staging.reshape(-1).view(torch.uint8)
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
