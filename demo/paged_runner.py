"""What the demo's model runners share: block lookup, RMSNorm, and the greedy
prefill/decode loop over a paged pool (the forward itself is each model's)."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["PagedRunner"]


class PagedRunner:
    """Greedy float32 decoding of one request at a time over a TensorRT-LLM-geometry pool.
    A subclass sets ``eps`` and implements ``forward(token_ids, start, pool, tpb, blocks)``
    -> logits ``[T, vocab]``, which writes the new tokens' KV into ``blocks`` and reads
    positions ``[0, start + T)`` back from them."""

    eps: float

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

    def forward(self, token_ids: Sequence[int], start: int, pool: torch.Tensor, tpb: int,
                blocks: Sequence[int]) -> torch.Tensor:  # pragma: no cover - per model
        raise NotImplementedError

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
