"""Which KV heads each tensor-parallel rank holds, and which move between two ranks."""

from __future__ import annotations

from dataclasses import dataclass

from .geometry import KVLayout, LayoutError

__all__ = ["tp_head_slice", "HeadMap"]


def tp_head_slice(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first global head, head count) held by ``tp_rank`` of ``tp_size``.

    Heads split evenly when ``tp_size`` divides ``total_heads``; when ``total_heads``
    divides ``tp_size`` each rank holds one head, replicated over ``tp_size //
    total_heads`` ranks (SGLang and TensorRT-LLM both do this). Other splits raise.
    """
    if total_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"bad head split: {total_heads} heads, tp_size {tp_size}, tp_rank {tp_rank}")
    if total_heads % tp_size == 0:
        per = total_heads // tp_size
        return tp_rank * per, per
    if tp_size % total_heads == 0:
        return tp_rank * total_heads // tp_size, 1
    raise LayoutError(f"{total_heads} KV heads cannot be split over tensor-parallel size {tp_size}")


@dataclass(frozen=True)
class HeadMap:
    """A contiguous run of ``count`` global heads from ``global_start``, moved from local
    head ``src_start`` on the source rank to local head ``dst_start`` on the destination."""

    global_start: int
    count: int
    src_start: int
    dst_start: int

    @classmethod
    def between(cls, src: KVLayout, dst: KVLayout) -> "HeadMap":
        """The heads both ranks hold (their intersection); raises if they share none."""
        lo = max(src.head_offset, dst.head_offset)
        hi = min(src.head_offset + src.num_heads, dst.head_offset + dst.num_heads)
        if hi <= lo:
            raise LayoutError(
                f"source heads {src.head_offset}..{src.head_offset + src.num_heads} and destination heads "
                f"{dst.head_offset}..{dst.head_offset + dst.num_heads} do not overlap"
            )
        return cls(lo, hi - lo, lo - src.head_offset, lo - dst.head_offset)

    def check(self, src: KVLayout, dst: KVLayout) -> None:
        """Raise LayoutError unless both ranks hold every head of this map."""
        for side, lay, start in (("source", src, self.src_start), ("destination", dst, self.dst_start)):
            if self.count <= 0 or start < 0 or start + self.count > lay.num_heads:
                raise LayoutError(
                    f"head map {start}..{start + self.count} outside the {lay.num_heads} heads of the {side}"
                )
            if lay.head_offset + start != self.global_start:
                raise LayoutError(
                    f"head map global start {self.global_start} is local head {start} on the {side}, "
                    f"which holds global heads from {lay.head_offset}"
                )
