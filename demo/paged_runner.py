"""What the demo's model runners share: where a request's KV lives (``PoolStore``), block
lookup, RMSNorm, and the greedy prefill/decode loop over a paged pool.

A runner computes one batch of sequences layer by layer (``forward_batch``), the way an
engine's forward does, so a caller can run hooks before and after each decoder layer
(TensorRT-LLM's ``wait_for_layer_load`` / ``save_kv_layer``). The attention cache lives
only in TensorRT-LLM primary pools: every step writes the new tokens' KV into the
request's blocks and reads positions ``[0, start)`` back from them, so a sequence
continues from whatever the pool holds, e.g. KV another engine wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

__all__ = ["PagedRunner", "PoolStore", "SeqStep"]

_FP8 = getattr(torch, "float8_e4m3fn", None)


class PoolStore:
    """A rank's view of the KV of the sequences it computes, in TensorRT-LLM primary pools.

    ``pools[r]``: rank ``r``'s pool ``[num_blocks, layers, kv_factor, heads_r *
    tokens_per_block * head_dim]``, HND inside a block (``[head][token][dim]``, the
    TRTLLM attention backend's) or NHD (``[token][head][dim]``, ``block_order="NHD"``:
    backends that use ``KVCacheManager.get_buffers``); fp8 KV is stored as uint8
    (``kv_dtype="fp8"``, e4m3; ``kv_scales[layer]`` the number a stored element is
    multiplied by to read it, 1.0 by default: written as ``value / scale``). ``head_slices[r] = (first,
    count)``: the model's KV heads rank ``r`` holds. A rank writes only its own heads
    (``own``) and reads every head from the pool that holds it: tensor-parallel ranks of
    one server compute the same sequences in lockstep, and reading another rank's heads
    stands in for the all-gather inside attention. One pool with every head is the
    single-rank case. Block ids are the same on every rank of a server.

    KV rows passed and returned: ``[kv_factor, T, total_heads, head_dim]`` float32.
    """

    def __init__(self, pools: Sequence[torch.Tensor], tokens_per_block: int,
                 head_slices: Sequence[tuple[int, int]] | None = None, own: int = 0, kv_dtype: str = "auto",
                 block_order: str = "HND", kv_scales: Sequence[float] | None = None):
        self.pools = list(pools)
        self.kv_scales = [float(x) for x in kv_scales] if kv_scales else None
        self.tpb = int(tokens_per_block)
        p0 = self.pools[0]
        if p0.dim() != 4:
            raise ValueError(f"a TensorRT-LLM primary pool is [blocks, layers, kv_factor, block_size], got {tuple(p0.shape)}")
        self.kv_factor = int(p0.shape[2])
        if head_slices is None:
            head_slices = [(0, 1)] if self.kv_factor == 1 else None
        if head_slices is None:
            raise ValueError("head_slices are needed for a pool of several heads")
        self.slices = [(int(a), int(n)) for a, n in head_slices]
        if len(self.slices) != len(self.pools):
            raise ValueError(f"{len(self.slices)} head slices for {len(self.pools)} pools")
        self.total_heads = max(a + n for a, n in self.slices)
        first, count = self.slices[own]
        self.head_dim = int(p0.shape[3]) // (count * self.tpb)
        self.own = own
        if kv_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'fp8', got {kv_dtype!r}")
        self.fp8 = kv_dtype == "fp8"
        if block_order not in ("HND", "NHD"):
            raise ValueError(f"block_order must be 'HND' or 'NHD', got {block_order!r}")
        self.nhd = block_order == "NHD"
        if self.fp8 and _FP8 is None:
            raise RuntimeError("this torch has no float8_e4m3fn")

    def _view(self, r: int) -> torch.Tensor:
        """Pool ``r`` as ``[blocks, layers, kv_factor, heads_r, tokens_per_block, head_dim]`` (HND)."""
        p = self.pools[r]
        n = self.slices[r][1]
        if self.nhd:
            return p.view(p.shape[0], p.shape[1], self.kv_factor, self.tpb, n, self.head_dim).transpose(3, 4)
        return p.view(p.shape[0], p.shape[1], self.kv_factor, n, self.tpb, self.head_dim)

    def _where(self, blocks: Sequence[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return PagedRunner._where(blocks, positions, self.tpb)

    def _scale(self, layer: int) -> float:
        return self.kv_scales[layer] if self.fp8 and self.kv_scales else 1.0

    def as_stored(self, rows: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """``rows`` rounded to what the pool keeps (fp8 when the pool is fp8), as read back."""
        s = self._scale(layer)
        return (rows / s).to(_FP8).float() * s if self.fp8 else rows

    def write(self, layer: int, blocks: Sequence[int], positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store ``rows`` ``[kv_factor, T, total_heads, head_dim]`` of ``positions`` (this
        rank's heads); returns them as stored (what attention reads back later)."""
        blk, slot = self._where(blocks, positions)
        first, count = self.slices[self.own]
        mine = rows[:, :, first:first + count, :]  # [kv, T, h, D]
        view = self._view(self.own)
        val = (mine / self._scale(layer)).to(_FP8).view(torch.uint8) if self.fp8 else mine.to(view.dtype)
        # view[blk, layer] -> [T, kv, h, tpb, D]; select each token's slot
        view[blk, layer, :, :, slot, :] = val.permute(1, 0, 2, 3)
        return self.as_stored(rows, layer)

    def read(self, layer: int, blocks: Sequence[int], n: int) -> torch.Tensor:
        """Rows ``[kv_factor, n, total_heads, head_dim]`` (float32) of positions ``[0, n)``."""
        out = torch.empty(self.kv_factor, n, self.total_heads, self.head_dim, dtype=torch.float32)
        if n == 0:
            return out
        blk, slot = self._where(blocks, torch.arange(n))
        for r, (first, count) in enumerate(self.slices):
            got = self._view(r)[blk, layer, :, :, slot, :]  # [n, kv, h, D]
            got = got.view(_FP8).float() * self._scale(layer) if self.fp8 else got.float()
            out[:, :, first:first + count, :] = got.permute(1, 0, 2, 3)
        return out


@dataclass
class SeqStep:
    """One sequence of a batch: tokens at positions ``[start, start + len(token_ids))``
    in ``blocks``; ``state`` is the runner's per-layer scratch."""

    token_ids: Sequence[int]
    start: int
    blocks: Sequence[int]
    state: dict = field(default_factory=dict)


class PagedRunner:
    """Greedy float32 decoding over TensorRT-LLM primary pools. A subclass sets ``eps``,
    ``layers`` and implements ``_embed(seq)``, ``_layer(i, seq, store)`` and
    ``_logits(seq)``; ``forward_batch`` runs them layer by layer over a batch."""

    eps: float
    layers: int
    kv_heads: int

    @staticmethod
    def _where(blocks: Sequence[int], positions: torch.Tensor, tpb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, slot in the block) of each position, ``positions`` [T] (int64)."""
        b = torch.as_tensor(list(blocks), dtype=torch.long)
        if positions.numel() and int(positions.max()) >= len(b) * tpb:
            raise ValueError(f"position {int(positions.max())} is beyond the request's {len(b)} blocks "
                             f"of {tpb} tokens")
        return b[positions // tpb], positions % tpb

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def store(self, pool: torch.Tensor, tpb: int) -> PoolStore:
        """A one-rank store over ``pool`` (every head)."""
        return PoolStore([pool], tpb, [(0, self.kv_heads)])

    def _embed(self, seq: SeqStep) -> None:  # pragma: no cover - per model
        raise NotImplementedError

    def _layer(self, i: int, seq: SeqStep, store: PoolStore) -> None:  # pragma: no cover - per model
        raise NotImplementedError

    def _logits(self, seq: SeqStep) -> torch.Tensor:  # pragma: no cover - per model
        raise NotImplementedError

    @torch.no_grad()
    def forward_batch(self, seqs: Sequence[SeqStep], store: PoolStore,
                      pre_layer: Callable[[int], Any] | None = None,
                      post_layer: Callable[[int], Any] | None = None) -> list[torch.Tensor]:
        """Every sequence through every decoder layer, layer by layer: ``pre_layer(i)``
        before layer ``i`` runs for the batch, ``post_layer(i)`` after its KV is written.
        Returns each sequence's logits ``[T, vocab]``."""
        for s in seqs:
            self._embed(s)
        for i in range(self.layers):
            if pre_layer is not None:
                pre_layer(i)
            for s in seqs:
                self._layer(i, s, store)
            if post_layer is not None:
                post_layer(i)
        return [self._logits(s) for s in seqs]

    def forward(self, token_ids: Sequence[int], start: int, pool: torch.Tensor, tpb: int,
                blocks: Sequence[int]) -> torch.Tensor:
        """Compute tokens at positions [start, start + T) over one pool: write their KV into
        ``blocks``, attend over [0, start + T). Returns logits [T, vocab]."""
        return self.forward_batch([SeqStep(list(token_ids), start, blocks)], self.store(pool, tpb))[0]

    def prefill(self, prompt: Sequence[int], pool, tpb, blocks) -> tuple[int, torch.Tensor]:
        """The prompt through the model, every layer's KV into ``blocks``; (first token, its logits [vocab])."""
        if not len(prompt):
            raise ValueError("empty prompt")
        logits = self.forward(prompt, 0, pool, tpb, blocks)[-1]
        return int(logits.argmax()), logits

    def decode(self, token: int, pos: int, n: int, pool, tpb, blocks) -> tuple[list[int], torch.Tensor]:
        """Paged greedy decode: feed ``token`` at position ``pos`` (KV of [0, pos) must be in
        the pool), then each new token; ``n`` tokens out, and the logits [vocab] of the first step."""
        out, first = [], None
        for _ in range(n):
            logits = self.forward([token], pos, pool, tpb, blocks)[-1]
            if first is None:
                first = logits
            token = int(logits.argmax())
            out.append(token)
            pos += 1
        return out, first
