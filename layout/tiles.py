"""Box tiles: the boxes of a copy as strided tiles of a pool, and the C copy that moves them.

Used by ``repack``'s box path (see its module doc). The C tile copy (``_tilecopy``, built
with the package from ``_tilecopy.c``; optional) walks each tile in the pool's address
order and, for copies of ``STREAM_MIN_BYTES`` or more, streams its stores past the cache,
on the calling thread with the GIL released; without it, ``repack`` uses torch's copies.
A ``CopySplit`` spreads one such copy over several threads, which its owner lends.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .copyspec import CopySpec
from .geometry import LayoutError
from .segments import SideBoxes

try:  # the C tile copy, built with the package (optional: pyproject's ext-modules)
    from . import _tilecopy
except ImportError:  # no compiler at install time: torch's copies do the same work
    _tilecopy = None

__all__ = ["BoxTiles", "CopySplit", "native_tile_copy", "STREAM_MIN_BYTES", "SPLIT_MIN_BYTES"]

STREAM_MIN_BYTES = 256 << 10  # C tile copies this large store past the cache (smaller ones are read back soon)
SPLIT_MIN_BYTES = 1 << 20  # a C tile copy is split only into pieces at least this large (a thread's wake-up is ~50 us)


class CopySplit:
    """One C tile copy spread over ``threads`` threads: the calling thread and
    ``threads - 1`` workers of ``executor``, which the owner creates and shuts down (the
    layout core keeps no threads). The boxes are cut into ``threads`` ranges of whole
    boxes, none under ``min_bytes``; the call returns once every range is copied.

    >>> from concurrent.futures import ThreadPoolExecutor
    >>> with ThreadPoolExecutor(1) as ex:
    ...     CopySplit(2, ex).ranges(0, 8, box_bytes=1 << 20)
    [(0, 4), (4, 8)]
    """

    def __init__(self, threads: int, executor: Executor | None, min_bytes: int = SPLIT_MIN_BYTES):
        if threads < 1:
            raise LayoutError(f"a copy split needs at least one thread, got {threads}")
        if threads > 1 and executor is None:
            raise LayoutError(f"a copy split over {threads} threads needs an executor for {threads - 1} of them")
        self.threads, self._executor, self.min_bytes = threads, executor, max(1, min_bytes)
        self._local = threading.local()  # per calling thread: the most ranges one run used (``taken``)

    def taken(self) -> int:
        """The most threads one ``run`` on the calling thread used since the last call (0: none ran)."""
        n = getattr(self._local, "most", 0)
        self._local.most = 0
        return n

    def ranges(self, i: int, j: int, box_bytes: int) -> list[tuple[int, int]]:
        """Boxes ``[i, j)`` cut into at most ``threads`` consecutive ranges of whole boxes."""
        n = j - i
        k = max(1, min(self.threads, n // -(-self.min_bytes // box_bytes)))  # each >= floor(n / k) boxes >= min_bytes
        cuts = [i + n * q // k for q in range(k + 1)]
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

    def run(self, copy: Callable[[int, int], None], i: int, j: int, box_bytes: int) -> None:
        """``copy(a, b)`` for each range of boxes ``[i, j)``: the first on the calling thread,
        the others on the executor's; every range has finished when this returns or raises
        (no worker writes after it)."""
        parts = self.ranges(i, j, box_bytes)
        self._local.most = max(getattr(self._local, "most", 0), len(parts))
        futures = [self._executor.submit(copy, a, b) for a, b in parts[1:]]
        try:
            copy(*parts[0])
        finally:
            wait(futures)
        for f in futures:
            f.result()


def native_tile_copy() -> bool:
    """Whether the C tile copy was built (CPU box-path copies use it unless told not to)."""
    return _tilecopy is not None


@dataclass
class BoxTiles:
    """The boxes of a copy as tiles of the pool: box ``i`` (in the staging's order) is
    ``view[index[i]]``, ``shape = (A, C, row_units)`` = its ``rows = A * C`` staging rows
    (A: the order side's outer dim, heads or tokens; C: the inner one)."""

    view: torch.Tensor  # [n, A, C, row_units] over the pool's memory, stride (1, sA, sC, 1) in units
    index: torch.Tensor  # int64 [boxes]: each box's first unit, on the pool's device
    shape: tuple[int, int, int]
    rows: int
    count: int
    strides: tuple[int, int]  # (sA, sC) in units
    unit: int  # bytes per unit

    @property
    def pointers(self) -> np.ndarray:
        """int64 ``[boxes]``: each box's first byte in memory (CPU pools), for the C tile copy."""
        p = self.__dict__.get("_pointers")
        if p is None:
            idx = self.index.numpy()
            # what index_select would refuse, refused here: the C copy does not check addresses
            if idx.size and (idx.min() < 0 or idx.max() >= self.view.shape[0]):
                raise LayoutError(f"box tiles reach outside the pool's memory (units {idx.min()}..{idx.max()}, "
                                  f"{self.view.shape[0]} tile starts)")
            # setdefault: threads that get here at once all keep the first array
            # (one assigned over another would free it under the thread that took its address)
            p = self.__dict__.setdefault("_pointers", self.view.data_ptr() + idx * self.unit)
        return p

    def native_copy(self, i: int, j: int, dense: torch.Tensor, *, scatter: bool, split: CopySplit | None = None) -> None:
        """Boxes ``[i, j)`` to (``scatter``: from) ``dense``, whose row 0 is box ``i``'s first
        row, through the C tile copy: each box in the pool's address order, stores past
        the cache from ``STREAM_MIN_BYTES`` on; ``split``: over its threads."""
        if j <= i:
            return
        if split is not None and split.threads > 1:
            box = self.rows * self.shape[2] * self.unit
            flat = dense.reshape(-1).view(torch.uint8)
            split.run(lambda a, b: self.native_copy(a, b, flat[(a - i) * box:], scatter=scatter), i, j, box)
            return
        A, C, ru = self.shape
        u, (sA, sC) = self.unit, self.strides
        nbytes = (j - i) * self.rows * ru * u
        if dense.numel() * dense.element_size() < nbytes:
            raise LayoutError(f"dense buffer of {dense.numel() * dense.element_size()} B is smaller than the {nbytes} B "
                              f"of boxes [{i}, {j})")
        if not 0 <= i < j <= self.count:
            raise LayoutError(f"boxes [{i}, {j}) outside the {self.count} of these tiles")
        base = self.__dict__.get("_pointers_addr")
        if base is None:  # the pointer array's address, once: a pipeline calls this per part
            base = self.__dict__.setdefault("_pointers_addr", self.pointers.ctypes.data)
        _tilecopy.tile_copy(base + 8 * i, j - i, dense.data_ptr(), A, C, ru * u, sA * u, sC * u, scatter,
                            nbytes >= STREAM_MIN_BYTES)

    @classmethod
    def of(cls, spec: CopySpec, pool: str, order: str, bx: SideBoxes, space: Any) -> "BoxTiles | None":
        """Tiles for ``spec``'s rows on ``pool`` in ``order``'s address order, or None where
        boxes differ in size, cross a pool block, or rows are element-strided."""
        P, O = (spec.src if pool == "src" else spec.dst), (spec.src if order == "src" else spec.dst)
        if not (P.rows_contiguous and O.rows_contiguous) or not bx.ntok.size:
            return None
        classes = bx.by_length()
        if len(classes) != 1:
            return None
        n, nh = classes[0][0], spec.heads.count
        o_first, p_first = ((spec.src_first_token if order == "src" else spec.dst_first_token),
                            (spec.src_first_token if pool == "src" else spec.dst_first_token))
        p_blocks = spec.src_blocks if pool == "src" else spec.dst_blocks
        p_head0 = spec.heads.src_start if pool == "src" else spec.heads.dst_start
        rel = o_first + bx.block_pos * O.tokens_per_block + bx.slot - p_first
        slot = rel % P.tokens_per_block
        if (slot + n > P.tokens_per_block).any():
            return None  # a box spans two pool blocks: rows of one box are not one tile
        addr = (P.base.reshape(-1)[bx.lk] + p_blocks[rel // P.tokens_per_block] * P.block_stride
                + slot * P.token_stride + p_head0 * P.head_stride)
        u = space.unit
        ru = P.head_bytes // u
        if O.head_stride > O.token_stride:  # the order side enumerates heads outside tokens
            (A, sA), (C, sC) = (nh, P.head_stride // u), (n, P.token_stride // u)
        else:
            (A, sA), (C, sC) = (n, P.token_stride // u), (nh, P.head_stride // u)
        if A == 1:
            sA = C * ru
        if C == 1:
            sC = ru
        flat = space.rows.as_strided((space.rows.shape[0] + ru - 1,), (1,))
        span = (A - 1) * sA + (C - 1) * sC + ru
        if sC == ru and sA == C * ru:  # a tile is contiguous: one memcpy per box
            view = flat.as_strided((flat.numel() - span + 1, A * C * ru), (1, 1)).view(-1, A, C, ru)
        else:
            view = flat.as_strided((flat.numel() - span + 1, A, C, ru), (1, sA, sC, 1))
        index = torch.from_numpy((addr - space.base) // u).to(space.rows.device)
        return cls(view, index, (A, C, ru), A * C, int(addr.size), (sA, sC), u)
