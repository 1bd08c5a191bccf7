"""What one request's KV move is: two layouts, their block lists, a token range, a head map.

A block list names, in token order, the blocks that hold a request's tokens on one
side: entry ``i`` holds tokens ``first_token + i * tokens_per_block`` onward. The token
range is cut wherever either side's block changes; each piece is a *run*: ``length``
tokens that sit at consecutive slots of one block on each side. Runs are what plans and
repack kernels iterate over, vectorized.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .geometry import KVLayout, LayoutError, check_compatible
from .heads import HeadMap

__all__ = ["CopySpec", "TokenRuns", "as_block_ids"]


def as_block_ids(blocks, name: str) -> np.ndarray:
    """A block list as a 1-d int64 array (accepts lists, numpy arrays, torch tensors)."""
    if hasattr(blocks, "detach"):
        blocks = blocks.detach().cpu().numpy()
    arr = np.asarray(blocks)
    if arr.ndim != 1:
        raise LayoutError(f"{name} must be a 1-d list of block ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise LayoutError(f"{name} must hold integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True)
class TokenRuns:
    """A token range cut at every block boundary of either side.

    Arrays of equal length R, one entry per run: ``start`` (request token), ``length``
    (tokens), ``src_block`` / ``dst_block`` (block ids), ``src_slot`` / ``dst_slot``
    (slot of the run's first token inside those blocks).
    """

    start: np.ndarray
    length: np.ndarray
    src_block: np.ndarray
    src_slot: np.ndarray
    dst_block: np.ndarray
    dst_slot: np.ndarray

    @property
    def count(self) -> int:
        """Number of runs."""
        return int(self.length.size)


@dataclass(frozen=True)
class CopySpec:
    """Tokens ``[start, stop)`` of heads ``heads`` of every layer and K/V, from ``src``'s
    blocks ``src_blocks`` to ``dst``'s blocks ``dst_blocks``. Validated on construction."""

    src: KVLayout
    src_blocks: np.ndarray
    dst: KVLayout
    dst_blocks: np.ndarray
    start: int
    stop: int
    heads: HeadMap
    src_first_token: int = 0
    dst_first_token: int = 0

    @classmethod
    def build(
        cls,
        src: KVLayout,
        src_blocks,
        dst: KVLayout,
        dst_blocks,
        tokens: int | tuple[int, int],
        heads: HeadMap | None = None,
        *,
        src_first_token: int = 0,
        dst_first_token: int = 0,
    ) -> "CopySpec":
        """Validate and build; ``tokens`` is ``stop`` or ``(start, stop)``."""
        check_compatible(src, dst)
        start, stop = (0, tokens) if isinstance(tokens, (int, np.integer)) else tokens
        spec = cls(
            src,
            as_block_ids(src_blocks, "src_blocks"),
            dst,
            as_block_ids(dst_blocks, "dst_blocks"),
            int(start),
            int(stop),
            heads if heads is not None else HeadMap.between(src, dst),
            int(src_first_token),
            int(dst_first_token),
        )
        spec.validate()
        return spec

    @property
    def num_tokens(self) -> int:
        """Tokens moved."""
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        """Payload bytes moved (every layer, K/V, token and mapped head)."""
        s = self.src
        return s.num_layers * s.kv_factor * self.num_tokens * self.heads.count * s.head_bytes

    def validate(self) -> None:
        """Raise LayoutError naming what is wrong with the range, block lists or head map."""
        if not 0 <= self.start < self.stop:
            raise LayoutError(f"token range [{self.start}, {self.stop}) is empty or negative")
        self.heads.check(self.src, self.dst)
        for side, lay, blocks, first in (
            ("source", self.src, self.src_blocks, self.src_first_token),
            ("destination", self.dst, self.dst_blocks, self.dst_first_token),
        ):
            tpb = lay.tokens_per_block
            if first < 0 or first % tpb:
                raise LayoutError(f"{side} first token {first} is not a multiple of its {tpb} tokens per block")
            if self.start < first:
                raise LayoutError(f"token {self.start} precedes the {side} block list, which starts at token {first}")
            need = -(-(self.stop - first) // tpb)
            if blocks.size < need:
                raise LayoutError(
                    f"{side} has {blocks.size} blocks for tokens {first}..{self.stop}, needs {need} of {tpb} tokens"
                )
            used = blocks[(self.start - first) // tpb : need]
            bad = (used < lay.first_block) | (used >= lay.num_blocks)
            if bad.any():
                raise LayoutError(
                    f"{side} block ids {used[bad][:8].tolist()} outside the pool's valid ids "
                    f"{lay.first_block}..{lay.num_blocks - 1}"
                )
            srt = np.sort(used)
            if (srt[1:] == srt[:-1]).any():
                raise LayoutError(f"{side} block list names a block twice: {used.tolist()[:16]}")

    @cached_property
    def derived(self) -> dict:
        """Arrays derived from this spec, computed once by whoever needs them first
        (e.g. ``side_boxes``: the plan's wire and the sender's gather share them)."""
        return {}

    @cached_property
    def runs(self) -> TokenRuns:
        """The token range cut at both sides' block boundaries (vectorized)."""
        tpb_s, tpb_d = self.src.tokens_per_block, self.dst.tokens_per_block
        cuts = np.union1d(
            np.arange(self.src_first_token + tpb_s * ((self.start - self.src_first_token) // tpb_s + 1), self.stop, tpb_s),
            np.arange(self.dst_first_token + tpb_d * ((self.start - self.dst_first_token) // tpb_d + 1), self.stop, tpb_d),
        )
        starts = np.concatenate(([self.start], cuts)).astype(np.int64)
        lengths = np.diff(np.concatenate((starts, [self.stop]))).astype(np.int64)
        rel_s = starts - self.src_first_token
        rel_d = starts - self.dst_first_token
        return TokenRuns(
            start=starts,
            length=lengths,
            src_block=self.src_blocks[rel_s // tpb_s],
            src_slot=rel_s % tpb_s,
            dst_block=self.dst_blocks[rel_d // tpb_d],
            dst_slot=rel_d % tpb_d,
        )
