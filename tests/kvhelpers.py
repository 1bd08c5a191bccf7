"""Test helpers: an independent reference reader of KV bytes, and a segment executor.

The reference reader computes every (layer, kv, token, head) address from first
principles (block id, slot, strides) with numpy, without any plan code, so tests can
check plans and repack kernels against it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvbridge.layout import KVLayout, Segments


def fill_random(layout: KVLayout, seed: int) -> None:
    """Fill every tensor of a local layout with random bytes."""
    g = torch.Generator().manual_seed(seed)
    for t in layout.tensors:
        b = t.reshape(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def snapshot(layout: KVLayout) -> list[np.ndarray]:
    """Copies of every tensor's bytes."""
    return [t.reshape(-1).view(torch.uint8).cpu().numpy().copy() for t in layout.tensors]


def unit_offsets(layout: KVLayout, blocks, first_token: int, start: int, stop: int, heads_local) -> np.ndarray:
    """Byte offsets [L, kv, T, H, head_bytes] of the given tokens and local heads,
    relative to the start of each (layer, kv)'s region tensor."""
    blocks = np.asarray(blocks, dtype=np.int64)
    t = np.arange(start, stop) - first_token
    blk = blocks[t // layout.tokens_per_block]
    slot = t % layout.tokens_per_block
    h = np.asarray(heads_local, dtype=np.int64)
    starts = np.array([r.addr for r in layout.regions], dtype=np.int64)[layout.region_of]
    rel = (layout.base - starts)[:, :, None, None, None]
    return (
        rel
        + (blk * layout.block_stride + slot * layout.token_stride)[None, None, :, None, None]
        + (h * layout.head_stride)[None, None, None, :, None]
        + np.arange(layout.head_bytes)[None, None, None, None, :]
    )


def read_units(layout: KVLayout, offsets: np.ndarray, data: list[np.ndarray] | None = None) -> np.ndarray:
    """Bytes at ``unit_offsets`` output, from the live tensors or a snapshot."""
    data = data if data is not None else snapshot(layout)
    out = np.empty(offsets.shape, dtype=np.uint8)
    for l in range(layout.num_layers):
        for k in range(layout.kv_factor):
            out[l, k] = data[layout.region_of[l, k]][offsets[l, k]]
    return out


def written_mask(layout: KVLayout, offsets: np.ndarray) -> list[np.ndarray]:
    """Per tensor, a boolean mask of the bytes ``offsets`` name."""
    masks = [np.zeros(t.numel() * t.element_size(), dtype=bool) for t in layout.tensors]
    for l in range(layout.num_layers):
        for k in range(layout.kv_factor):
            masks[layout.region_of[l, k]][offsets[l, k].reshape(-1)] = True
    return masks


def execute_segments(seg: Segments) -> None:
    """Copy each segment with memmove (test-only stand-in for a transport in one process)."""
    for s, d, n in zip(seg.src.tolist(), seg.dst.tolist(), seg.length.tolist()):
        ctypes.memmove(d, s, n)


def stop_process(conn, proc, grace_s: float = 5.0) -> None:
    """Ask a peer process driven over ``conn`` to stop, then kill it if it does not."""
    if proc.is_alive():
        try:
            conn.send(("stop",))
            conn.poll(grace_s)
        except (BrokenPipeError, OSError):
            pass
    proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(grace_s)
