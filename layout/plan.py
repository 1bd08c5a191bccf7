"""Compile a request's KV move into a TransferPlan: direct, or staged on either side.

- ``direct``: byte segments straight from the source pool to the destination pool.
  Few segments when the layouts agree; one per head per token when they do not.
- ``staged_send``: the sender gathers the rows into a dense staging buffer in the
  receiver's address order (one pass, ``repack.Gather``), then sends one segment per
  contiguous run of the receiver's memory.
- ``staged_recv``: the sender sends one segment per contiguous run of its own memory
  into a dense staging buffer on the receiver, which scatters it (``repack.Scatter``).
  The way to cut segments when the receiver's rows are split between senders (NHD with
  fewer heads per rank on the sender, e.g. prefill TP 2 -> decode TP 1).
- ``staged_both``: the sender gathers the rows into a dense staging buffer in its own
  address order, sends it as one run into the receiver's staging, which scatters it:
  two repacks, for two layouts that each stage only on their own side (vLLM caches of
  different block sizes or ISAs, whose rows are element-strided on both sides).

The choice is by estimated time from per-segment cost, wire bandwidth and repack
bandwidth (``PlanCosts``), and the plan says which it chose and why.

A layout with element-strided rows (vLLM's CPU pool, whose K is transposed inside a
block) limits the kinds (``refused_kinds``): ``direct`` only to a layout with the same
element dims (else it would be one segment per element), and staging only on its own
side (``staged_send`` when it sends, ``staged_recv`` when it receives, ``staged_both``
either way), where the gather or scatter reads or writes its strided rows in one indexed
copy per K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property

import numpy as np

from .copyspec import CopySpec
from .geometry import KVLayout, LayoutError
from .heads import HeadMap
from .repack import Gather, Scatter
from .segments import Segments, compile_segments, count_or_compile, side_runs

__all__ = ["PlanKind", "PlanCosts", "PlanChunk", "KindEstimate", "TransferPlan", "refused_kinds", "plan_transfer",
           "estimate_plan"]


class PlanKind(str, Enum):
    """How a plan moves bytes."""

    DIRECT = "direct"
    STAGED_SEND = "staged_send"
    STAGED_RECV = "staged_recv"
    STAGED_BOTH = "staged_both"

    @property
    def gathers(self) -> bool:
        """Whether the sender repacks into staging before the wire."""
        return self in (PlanKind.STAGED_SEND, PlanKind.STAGED_BOTH)

    @property
    def scatters(self) -> bool:
        """Whether the receiver repacks out of its staging after the wire."""
        return self in (PlanKind.STAGED_RECV, PlanKind.STAGED_BOTH)

    @property
    def gather_order(self) -> str:
        """The side whose address order the sender's staging follows: the destination's
        (``staged_send``: the wire writes its runs), else its own (what a scatter reads)."""
        return "dst" if self is PlanKind.STAGED_SEND else "src"


@dataclass(frozen=True)
class PlanCosts:
    """What moving bytes costs, for choosing a plan kind.

    Defaults are Mooncake TCP on loopback as measured on a 2-core CPU machine: ~30 us
    per segment inside a batch, ~2 GB/s, and a CPU repack at ~5 GB/s (the ``tcp`` link
    preset). A deployment's figures come from its link description:
    ``kvbridge.common.costmodel.LinkProfile.plan_costs`` (a preset per Mooncake
    protocol, or a ``kvbridge bench link --out`` file), set as ``HandoffConfig.costs``.
    """

    segment_s: float = 30e-6
    wire_bytes_per_s: float = 2e9
    repack_bytes_per_s: float = 5e9
    overlap_repack: bool = True
    # the share of the shorter of repack and wire hidden behind the other when overlapped
    # (1: all but the first of eight parts; 0: none, as where the transport's copies and the
    # gather share the same cores), measured by ``kvbridge bench link``
    repack_overlap: float = 1.0

    @staticmethod
    def hideable_s(repack_s, wire_s):
        """The most of a repack and a wire of these seconds that overlapping can hide: all
        of the shorter but its first of eight parts (before which the other cannot start)."""
        return min(repack_s, wire_s) * 7 / 8

    def seconds(self, kind: "PlanKind | str", nbytes, segments):
        """Estimated seconds of a ``kind`` plan moving ``nbytes`` in ``segments`` wire
        segments: the wire, plus for a staged kind the repack, of which ``repack_overlap``
        x 7/8 of the shorter of the two is hidden when overlapped. The one formula behind
        the plan chooser and the cost gate."""
        wire = segments * self.segment_s + nbytes / self.wire_bytes_per_s
        kind = PlanKind(kind)
        if kind is PlanKind.DIRECT:
            return wire
        rep = nbytes / self.repack_bytes_per_s
        hidden = self.repack_overlap * self.hideable_s(rep, wire) if self.overlap_repack else 0.0
        one = rep + wire - hidden
        return one + rep if kind is PlanKind.STAGED_BOTH else one  # its scatter runs once the bytes are in


@dataclass(frozen=True)
class KindEstimate:
    """One candidate plan kind: its wire segments and estimated seconds."""

    kind: PlanKind
    segments: int
    seconds: float
    staging_bytes: int


@dataclass
class TransferPlan:
    """A compiled move. Prepared once per request and reused by the transport.

    ``wire`` are the segments the transport writes. For ``staged_send`` their source
    addresses are offsets into the sender's staging buffer; for ``staged_recv`` their
    destination addresses are offsets into the receiver's staging buffer; for
    ``staged_both`` both (one run). Staging is dense: ``staging_bytes == nbytes``, rows
    of ``head_dim`` elements back to back in the address order of the side that is not
    staged (see ``repack``), the source's for ``staged_both``.
    """

    kind: PlanKind
    spec: CopySpec
    wire: Segments
    estimates: dict[PlanKind, KindEstimate]
    costs: PlanCosts = field(default_factory=PlanCosts)
    forced: bool = False  # chosen by ``force``, not by cost

    @cached_property
    def reason(self) -> str:
        """Why this kind: every candidate's segments and estimated time (built when first asked)."""
        return _reason(self.spec, self.estimates[self.kind], self.estimates, self.costs, self.forced)

    @property
    def nbytes(self) -> int:
        """Payload bytes moved."""
        return self.spec.nbytes

    @property
    def num_segments(self) -> int:
        """Segments on the wire."""
        return self.wire.count

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging buffer this plan needs (0 for direct)."""
        return 0 if self.kind is PlanKind.DIRECT else self.nbytes

    def gather(self) -> Gather:
        """The sender's repack into staging (``staged_send``, ``staged_both``); needs the source's tensors."""
        if not self.kind.gathers:
            raise LayoutError(f"a {self.kind.value} plan has no sender-side gather")
        return Gather(self.spec, order=self.kind.gather_order)

    def scatter(self) -> Scatter:
        """The receiver's repack out of staging (``staged_recv``, ``staged_both``); needs the destination's tensors."""
        if not self.kind.scatters:
            raise LayoutError(f"a {self.kind.value} plan has no receiver-side scatter")
        return Scatter(self.spec)

    def chunks(self, max_bytes: int) -> list["PlanChunk"]:
        """This plan cut into token ranges of at most ``max_bytes`` payload each (at least
        one step of both sides' blocks), each with its own wire segments relative to its
        own staging, so a sender can gather chunk i+1 into a small reused staging ring
        while chunk i is on the wire."""
        spec = self.spec
        if spec.nbytes <= max_bytes:
            return [PlanChunk(self.kind, spec, self.wire)]
        align = math.lcm(spec.src.tokens_per_block, spec.dst.tokens_per_block)
        per_token = max(spec.nbytes // spec.num_tokens, 1)
        step = max(align, (max_bytes // per_token) // align * align)
        first = (spec.start // align + 1) * align
        bounds = [spec.start] + list(range(first, spec.stop, step)) + [spec.stop]
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            sub = replace(spec, start=a, stop=b)
            out.append(PlanChunk(self.kind, sub, _wire(self.kind, sub)))
        return out

    def explain(self) -> str:
        """One paragraph a human can read: what was chosen, and the numbers why."""
        return self.reason

    def summary(self) -> dict:
        """Plain-data summary for logs, metrics and JSON output."""
        return {
            "kind": self.kind.value,
            "bytes": self.nbytes,
            "segments": self.num_segments,
            "staging_bytes": self.staging_bytes,
            "estimates": {k.value: {"segments": e.segments, "seconds": e.seconds} for k, e in self.estimates.items()},
            "reason": self.reason,
        }


@dataclass(frozen=True)
class PlanChunk:
    """Tokens ``[spec.start, spec.stop)`` of a plan, with wire segments whose staging side
    is relative to this chunk's own staging buffer (``nbytes`` bytes)."""

    kind: PlanKind
    spec: CopySpec
    wire: Segments

    @property
    def nbytes(self) -> int:
        """Payload (and staging) bytes of this chunk."""
        return self.spec.nbytes

    def gather(self) -> Gather:
        """Sender-side repack of this chunk into its staging."""
        return Gather(self.spec, order=self.kind.gather_order)

    def scatter(self) -> Scatter:
        """Receiver-side repack of this chunk out of its staging."""
        return Scatter(self.spec)


def _wire(kind: PlanKind, spec: CopySpec) -> Segments:
    """The wire segments of ``kind`` for ``spec`` (staging side as offsets from 0)."""
    if kind is PlanKind.DIRECT:
        return compile_segments(spec)
    if kind is PlanKind.STAGED_BOTH:
        zero = np.zeros(1, dtype=np.int64)
        return Segments(zero, zero, np.array([spec.nbytes], dtype=np.int64))
    side = "dst" if kind is PlanKind.STAGED_SEND else "src"
    addr, length = side_runs(spec, side)
    offs = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
    return Segments(offs, addr, length) if side == "dst" else Segments(addr, offs, length)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _estimates(spec: CopySpec, costs: PlanCosts, kinds,
               wires: dict[PlanKind, Segments] | None = None) -> dict[PlanKind, KindEstimate]:
    """Wire segments and estimated seconds of each allowed kind (direct's segment count is
    exact for small plans, an upper bound for large ones; see ``count_segments``). The wire
    segments built on the way go into ``wires`` (None: count only)."""
    out: dict[PlanKind, KindEstimate] = {}
    n = spec.nbytes
    for kind in kinds:
        if kind is PlanKind.DIRECT:
            segs, wire = count_or_compile(spec)
        elif kind is PlanKind.STAGED_BOTH:
            segs, wire = 1, _wire(kind, spec)
        elif wires is None:
            segs, wire = side_runs(spec, "dst" if kind is PlanKind.STAGED_SEND else "src")[0].size, None
        else:
            wire = _wire(kind, spec)
            segs = wire.count
        if wire is not None and wires is not None:
            wires[kind] = wire
        out[kind] = KindEstimate(kind, segs, costs.seconds(kind, n, segs), 0 if kind is PlanKind.DIRECT else n)
    return out


def _usable_kinds(src: KVLayout, dst: KVLayout, kinds, force: PlanKind | None) -> tuple[PlanKind, ...]:
    """The allowed kinds these layouts can use (``force`` added); LayoutError when none."""
    allowed = tuple(PlanKind(k) for k in kinds)
    refused = refused_kinds(src, dst)
    if force is not None:
        if force in refused:
            raise LayoutError(f"cannot force {force.value}: {refused[force]}")
        allowed = tuple(dict.fromkeys(allowed + (force,)))
    if refused:
        usable = tuple(k for k in allowed if k not in refused)
        if not usable:
            raise LayoutError(f"no plan kind among {[k.value for k in allowed]} can move {src.engine} -> "
                              f"{dst.engine}: " + "; ".join(refused[k] for k in allowed))
        allowed = usable
    if force is not PlanKind.STAGED_BOTH and len(allowed) > 1 and PlanKind.STAGED_BOTH in allowed:
        # the last resort: its scatter holds the decode back, which the estimate does not weigh
        allowed = tuple(k for k in allowed if k is not PlanKind.STAGED_BOTH)
    return allowed


def _cheapest(est: dict[PlanKind, KindEstimate]) -> KindEstimate:
    """The estimate the chooser takes: the fastest, direct on a tie."""
    return min(est.values(), key=lambda e: (e.seconds, e.kind is not PlanKind.DIRECT))


def refused_kinds(src: KVLayout, dst: KVLayout) -> dict[PlanKind, str]:
    """Plan kinds that cannot move ``src`` -> ``dst``, each with the reason (empty when
    both layouts' head rows are contiguous)."""
    out: dict[PlanKind, str] = {}
    if src.rows_contiguous and dst.rows_contiguous:
        return out
    se = [src.elem_dims(kv) for kv in range(src.kv_factor)]
    de = [dst.elem_dims(kv) for kv in range(dst.kv_factor)]
    st = [src.token_dims(kv) for kv in range(src.kv_factor)]
    dt = [dst.token_dims(kv) for kv in range(dst.kv_factor)]
    if se != de:
        out[PlanKind.DIRECT] = (f"{src.engine} -> {dst.engine}: element dims {se} -> {de} differ "
                                "(a direct plan would be one segment per element)")
    elif not (src.affine_tokens and dst.affine_tokens) and st != dt:
        out[PlanKind.DIRECT] = (f"{src.engine} -> {dst.engine}: mixed-radix token dims {st} -> {dt} differ "
                                "(a direct plan would cut every block into pieces)")
    if not dst.rows_contiguous:
        out[PlanKind.STAGED_SEND] = (f"the destination's ({dst.engine}) head rows are element-strided: "
                                     "staged bytes must be scattered on its side (staged_recv)")
    if not src.rows_contiguous:
        out[PlanKind.STAGED_RECV] = (f"the source's ({src.engine}) head rows are element-strided: "
                                     "staged bytes must be gathered on its side (staged_send)")
    return out


def plan_transfer(
    src: KVLayout,
    src_blocks,
    dst: KVLayout,
    dst_blocks,
    tokens: int | tuple[int, int],
    heads: HeadMap | None = None,
    *,
    src_first_token: int = 0,
    dst_first_token: int = 0,
    kinds: tuple[PlanKind | str, ...] = (PlanKind.DIRECT, PlanKind.STAGED_SEND),
    costs: PlanCosts | None = None,
    force: PlanKind | str | None = None,
) -> TransferPlan:
    """Compile the move of tokens ``tokens`` (``stop`` or ``(start, stop)``) of ``heads``
    (default: every head both ranks hold) from ``src``'s ``src_blocks`` to ``dst``'s
    ``dst_blocks``.

    Block lists are in token order; entry 0 holds token ``*_first_token``. ``kinds``
    are the plan kinds the deployment supports (``staged_recv`` needs a receiver that
    scatters); ``force`` picks one regardless of cost. Kinds the two layouts cannot
    use (``refused_kinds``) are left out. Raises LayoutMismatchError / LayoutError
    naming what is wrong (also when no allowed kind can move these layouts).
    """
    costs = costs or PlanCosts()
    spec = CopySpec.build(
        src, src_blocks, dst, dst_blocks, tokens, heads, src_first_token=src_first_token, dst_first_token=dst_first_token
    )
    force = PlanKind(force) if force is not None else None
    wires: dict[PlanKind, Segments] = {}
    est = _estimates(spec, costs, _usable_kinds(src, dst, kinds, force), wires)
    chosen = est[force] if force is not None else _cheapest(est)

    wire = wires[chosen.kind] if chosen.kind in wires else _wire(chosen.kind, spec)
    return TransferPlan(chosen.kind, spec, wire, est, costs, forced=force is not None)


def estimate_plan(spec: CopySpec, *, kinds: tuple[PlanKind | str, ...] = (PlanKind.DIRECT, PlanKind.STAGED_SEND),
                  costs: PlanCosts | None = None) -> KindEstimate:
    """The estimate (kind, segments, seconds) of the plan ``plan_transfer`` would choose
    for ``spec`` (``CopySpec.build`` of its arguments), without building that plan
    (segments counted as the chooser counts them)."""
    return _cheapest(_estimates(spec, costs or PlanCosts(), _usable_kinds(spec.src, spec.dst, kinds, None)))


def _reason(spec: CopySpec, chosen: KindEstimate, est: dict, costs: PlanCosts, forced: bool) -> str:
    n = spec.nbytes
    parts = []
    for e in sorted(est.values(), key=lambda e: e.seconds):
        avg = n / max(e.segments, 1)
        what = {
            PlanKind.DIRECT: "direct",
            PlanKind.STAGED_SEND: "repack on the sender, then",
            PlanKind.STAGED_RECV: "send, then scatter on the receiver:",
            PlanKind.STAGED_BOTH: "repack on the sender, send, scatter on the receiver:",
        }[e.kind]
        parts.append(f"{e.kind.value} ({what} {e.segments:,} segments of ~{_fmt_bytes(avg)}): est. {e.seconds * 1e3:.2f} ms")
    head = f"{'forced' if forced else 'chose'} {chosen.kind.value} for {_fmt_bytes(n)} "
    head += f"({spec.num_tokens} tokens x {spec.src.num_layers} layers x {spec.src.kv_factor} x {spec.heads.count} heads x {spec.src.head_bytes} B; "
    head += f"{spec.src.engine} page {spec.src.tokens_per_block} -> {spec.dst.engine} page {spec.dst.tokens_per_block})"
    model = (
        f"[{costs.segment_s * 1e6:.0f} us/segment, wire {costs.wire_bytes_per_s / 1e9:.1f} GB/s, "
        f"repack {costs.repack_bytes_per_s / 1e9:.1f} GB/s"
        f"{f', overlapped {costs.repack_overlap:g}' if costs.overlap_repack else ''}]"
    )
    return head + ": " + "; ".join(parts) + " " + model
