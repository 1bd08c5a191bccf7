"""A digest of a request's KV content that does not depend on how a pool stores it.

The content of a handoff is a set of *rows*: one head of one token of one (layer, K/V),
``head_dim * itemsize`` bytes. Read in the **canonical order** (global layer, K/V, global
head, token), the same rows are the same bytes whatever the engine, page size, block ids,
tensor-parallel split or head-major/token-major layout that holds them. A digest cuts that
sequence into *units* (one layer, one K/V, one head, ``unit_tokens`` consecutive tokens)
and hashes each unit with xxHash's XXH3-64 (``xxhash``: ~19 GB/s on one core here, 4.5x
zlib's CRC-32; a checksum against corruption, not a MAC: the control plane's seal is what
authenticates). Sender and receiver each digest their own side of the same rows; equal
lists mean equal content, and the first unequal unit names where they differ. An fp8
unit's scale (``KVLayout.kv_scales``, as float32: what the engines keep) seeds its hash,
so a unit whose bytes or scale differ differs; a scale of 1.0 seeds 0, as other dtypes.

``DigestGrid`` says which rows (global layers, global heads, tokens) and how they are cut;
``grid_for`` picks ``unit_tokens`` so that a grid has at most ``MAX_UNITS`` units (or one
per (layer, K/V, head)). ``kv_digest(layout, blocks, first_token, grid)`` reads the grid's
rows out of a local pool (CPU or CUDA; a CUDA pool's rows are hashed on the host) and
returns one ``uint64`` per unit.

Example (two pools with different page sizes holding the same 5 tokens)::

    >>> import torch
    >>> from kvbridge.layout import trtllm_pool_layout
    >>> def pool(tpb):
    ...     t = torch.zeros(4, 2, 2, 2 * tpb * 4, dtype=torch.float16)  # [blocks, layers, kv, heads*tpb*dim]
    ...     return t, trtllm_pool_layout(t, tokens_per_block=tpb, num_kv_heads=2, dtype="float16")
    >>> (a, la), (b, lb) = pool(4), pool(8)
    >>> for l in range(2):
    ...     for kv in range(2):
    ...         for h in range(2):
    ...             for tok in range(5):
    ...                 v = torch.arange(4) + 100 * l + 10 * kv + h + 1000 * tok
    ...                 a.view(4, 2, 2, 2, 4, 4)[tok // 4, l, kv, h, tok % 4] = v
    ...                 b.view(4, 2, 2, 2, 8, 4)[3, l, kv, h, tok] = v
    >>> g = grid_for(la, heads=(0, 2), tokens=(0, 5))
    >>> bool((kv_digest(la, [0, 1], 0, g) == kv_digest(lb, [3], 0, g)).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .geometry import KVLayout, LayoutError, kv_name

__all__ = ["DIGEST_ALGORITHM", "MAX_UNITS", "DigestGrid", "grid_for", "kv_digest", "first_difference"]

DIGEST_ALGORITHM = "xxh3_64/lkht/s32"  # the hash, the canonical order (layer, K/V, head, token), fp8 scale seeds
SPAN_MIN_BYTES = 2048  # a block's run of one head at least this long: hashed in place, not gathered
MAX_UNITS = 1024  # units a grid_for grid has at most (unless there are more (layer, K/V, head) than that)


@dataclass(frozen=True)
class DigestGrid:
    """Rows of global layers ``[layers[0], layers[1])``, K/V ``0 .. kv_factor``, global
    heads ``[heads[0], heads[0] + heads[1])`` and tokens ``[tokens[0], tokens[1])``, cut
    into units of ``unit_tokens`` tokens (the last of each (layer, K/V, head) shorter)."""

    layers: tuple[int, int]
    kv_factor: int
    heads: tuple[int, int]
    tokens: tuple[int, int]
    unit_tokens: int

    def __post_init__(self) -> None:
        (l0, l1), (h0, hn), (t0, t1) = self.layers, self.heads, self.tokens
        if not (0 <= l0 < l1 and self.kv_factor in (1, 2) and h0 >= 0 and hn >= 1 and 0 <= t0 < t1
                and self.unit_tokens >= 1):
            raise LayoutError(f"invalid digest grid: layers {self.layers}, kv_factor {self.kv_factor}, heads "
                              f"{self.heads} (start, count), tokens {self.tokens}, unit_tokens {self.unit_tokens}")

    @property
    def per_row(self) -> int:
        """Units per (layer, K/V, head)."""
        return -(-(self.tokens[1] - self.tokens[0]) // self.unit_tokens)

    @property
    def units(self) -> int:
        """Number of units (the digest's length)."""
        return (self.layers[1] - self.layers[0]) * self.kv_factor * self.heads[1] * self.per_row

    def unit(self, i: int) -> tuple[int, int, int, tuple[int, int]]:
        """(global layer, K/V, global head, (first token, stop token)) of unit ``i``."""
        rest, u = divmod(int(i), self.per_row)
        rest, h = divmod(rest, self.heads[1])
        layer, kv = divmod(rest, self.kv_factor)
        a = self.tokens[0] + u * self.unit_tokens
        return self.layers[0] + layer, kv, self.heads[0] + h, (a, min(a + self.unit_tokens, self.tokens[1]))


def grid_for(layout: KVLayout, *, heads: tuple[int, int], tokens: tuple[int, int],
             layers: tuple[int, int] | None = None, max_units: int = MAX_UNITS) -> DigestGrid:
    """The grid over ``layout``'s layers (or global ``layers``), global ``heads`` (start,
    count) and ``tokens``, with the fewest tokens per unit that keep it within ``max_units``."""
    layers = layers or (layout.layer_offset, layout.layer_offset + layout.num_layers)
    rows = (layers[1] - layers[0]) * layout.kv_factor * heads[1]
    n = tokens[1] - tokens[0]
    per_row = max(1, max_units // max(1, rows))
    return DigestGrid(tuple(layers), layout.kv_factor, tuple(heads), tuple(tokens), max(1, -(-n // per_row)))


def _rows_of(layout: KVLayout):
    """The row view of ``layout``'s memory the repack kernels index (built once per layout)."""
    from .repack import _layout_unit, _row_space

    key = ("row_space", layout.head_bytes)
    space = layout.derived.get(key)
    if space is None:
        space = layout.derived[key] = _row_space(layout, layout.head_bytes, _layout_unit(layout, layout.head_bytes))
    return space


def _seeds(layout: KVLayout, grid: DigestGrid) -> np.ndarray:
    """uint64 ``[grid layers, K/V, grid heads]``: each unit's hash seed, the float32 bits of
    its fp8 scale (0 where the scale is 1.0, and for dtypes without scales)."""
    (l0, l1), (h0, hn) = grid.layers, grid.heads
    s = layout.scales[l0 - layout.layer_offset:l1 - layout.layer_offset, :,
                      h0 - layout.head_offset:h0 - layout.head_offset + hn].astype(np.float32)
    return np.where(s == 1.0, 0, s.view(np.uint32)).astype(np.uint64)


def kv_digest(layout: KVLayout, blocks, first_token: int, grid: DigestGrid) -> np.ndarray:
    """XXH3-64 of each unit of ``grid``, read from ``layout``'s local pool: ``blocks``
    (block ids in token order, entry 0 holding token ``first_token``) hold the grid's
    tokens. uint64 ``[grid.units]``. LayoutError when the grid asks for layers, heads or
    tokens this pool or block list does not hold.

    One (layer, K/V) at a time, its rows are gathered in the canonical order (one indexed
    copy over the pool's row view, as the repack kernels do) into one reused buffer, then
    hashed on the host."""
    import xxhash

    from .copyspec import as_block_ids

    blocks = as_block_ids(blocks, "blocks")
    (l0, l1), (h0, hn), (t0, t1) = grid.layers, grid.heads, grid.tokens
    if grid.kv_factor != layout.kv_factor:
        raise LayoutError(f"digest grid has kv_factor {grid.kv_factor}, the {layout.engine} pool {layout.kv_factor}")
    if l0 < layout.layer_offset or l1 > layout.layer_offset + layout.num_layers:
        raise LayoutError(f"digest grid layers [{l0}, {l1}) are not all in the {layout.engine} pool's layers "
                          f"[{layout.layer_offset}, {layout.layer_offset + layout.num_layers})")
    if h0 < layout.head_offset or h0 + hn > layout.head_offset + layout.num_heads:
        raise LayoutError(f"digest grid heads [{h0}, {h0 + hn}) are not all in the {layout.engine} pool's heads "
                          f"[{layout.head_offset}, {layout.head_offset + layout.num_heads})")
    rel = np.arange(t0, t1, dtype=np.int64) - int(first_token)
    if rel[0] < 0 or rel[-1] // layout.tokens_per_block >= blocks.size:
        raise LayoutError(f"digest grid tokens [{t0}, {t1}) are not all in {blocks.size} block(s) of "
                          f"{layout.tokens_per_block} tokens from token {first_token}")
    blk = blocks[rel // layout.tokens_per_block]
    if blk.min() < layout.first_block or blk.max() >= layout.num_blocks:
        raise LayoutError(f"block ids outside the {layout.engine} pool's [{layout.first_block}, {layout.num_blocks})")
    space = _rows_of(layout)
    dev = space.rows.device
    slot = rel % layout.tokens_per_block
    head = (np.arange(h0, h0 + hn, dtype=np.int64) - layout.head_offset) * layout.head_stride
    n = hn * (t1 - t0)
    row_bytes = layout.head_bytes
    if dev.type == "cpu" and layout.rows_contiguous and layout.token_stride == row_bytes \
            and layout.tokens_per_block * row_bytes >= SPAN_MIN_BYTES:
        # a head's tokens lie back to back in a block (head-major pages): hash each unit's
        # runs in place, no gather (the same bytes in the same order as a gathered unit)
        return _span_digest(layout, space, blk, slot, head, grid)
    buf = torch.empty((n, row_bytes // space.unit), dtype=space.rows.dtype, device=dev)  # one (layer, K/V), reused
    host = buf if dev.type == "cpu" else torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    mv = memoryview(host.view(torch.uint8).numpy().reshape(-1))
    seeds = _seeds(layout, grid).tolist()
    out = np.empty(grid.units, dtype=np.uint64)
    span, step = (t1 - t0) * row_bytes, grid.unit_tokens * row_bytes
    k = 0
    for layer in range(l0 - layout.layer_offset, l1 - layout.layer_offset):
        for kv in range(layout.kv_factor):
            tok = blk * layout.block_stride + layout.token_offsets[kv][slot]
            addr = int(layout.base[layer, kv]) + head[:, None] + tok[None, :]  # [heads, tokens]: canonical order
            idx = torch.from_numpy(((addr - space.base) // space.unit).reshape(-1)).to(dev)
            if layout.rows_contiguous:
                torch.index_select(space.rows, 0, idx, out=buf)
            else:
                buf.copy_(space.read(kv, idx))
            if host is not buf:
                host.copy_(buf)
            for h in range(hn):
                seed = seeds[layer - (l0 - layout.layer_offset)][kv][h]
                for a in range(h * span, (h + 1) * span, step):
                    out[k] = xxhash.xxh3_64_intdigest(mv[a:min(a + step, (h + 1) * span)], seed)
                    k += 1
    return out


def _span_digest(layout: KVLayout, space, blk: np.ndarray, slot: np.ndarray, head: np.ndarray,
                 grid: DigestGrid) -> np.ndarray:
    """``kv_digest`` of a CPU pool whose tokens of one head are contiguous within a block:
    each unit is hashed by streaming XXH3 over its contiguous runs (which equals one XXH3
    over the unit's rows gathered), read where they lie."""
    import xxhash

    (l0, l1), (t0, t1) = grid.layers, grid.tokens
    row_bytes, hn, nt = layout.head_bytes, grid.heads[1], t1 - t0
    pool = memoryview(_host_bytes(layout, space.base))
    # run starts within a unit's tokens: the first token, every unit boundary and every block start
    cut = (np.arange(nt, dtype=np.int64) % grid.unit_tokens == 0) | (slot == 0)
    starts = np.flatnonzero(cut)
    stops = np.append(starts[1:], nt)
    unit_of = starts // grid.unit_tokens
    first_run = np.flatnonzero(np.concatenate([[True], unit_of[1:] != unit_of[:-1]]))
    run_len = (stops - starts) * row_bytes
    run_tok = blk[starts] * layout.block_stride + slot[starts] * layout.token_stride - space.base
    out = np.empty(grid.units, dtype=np.uint64)
    bounds = np.append(first_run, starts.size).tolist()
    lens = run_len.tolist()
    seeds = _seeds(layout, grid).tolist()
    k = 0
    for li, layer in enumerate(range(l0 - layout.layer_offset, l1 - layout.layer_offset)):
        for kv in range(layout.kv_factor):
            heads = (run_tok[None, :] + (head[:, None] + int(layout.base[layer, kv]))).tolist()
            for offs, seed in zip(heads, seeds[li][kv]):
                for u in range(len(bounds) - 1):
                    x = xxhash.xxh3_64(seed=seed)
                    for r in range(bounds[u], bounds[u + 1]):
                        x.update(pool[offs[r]:offs[r] + lens[r]])
                    out[k] = x.intdigest()
                    k += 1
    return out


def _host_bytes(layout: KVLayout, lo: int) -> np.ndarray:
    """A uint8 array over ``layout``'s CPU pool memory from address ``lo`` (its lowest
    region) to its highest region's end, no copy (built once per layout)."""
    from .pools import alias_memory

    arr = layout.derived.get("host_bytes")
    if arr is None:
        hi = max(r.addr + r.nbytes for r in layout.regions)
        arr = layout.derived["host_bytes"] = alias_memory(lo, hi - lo).numpy()
    return arr


def first_difference(grid: DigestGrid, want, got) -> str:
    """'' when the digests ``want`` (the sender's) and ``got`` (ours) agree, else where they
    first differ, in words: layer, K or V, head, token range, and how many units differ."""
    want, got = np.asarray(want, dtype=np.uint64), np.asarray(got, dtype=np.uint64)
    if want.shape != got.shape:
        return f"the digest has {want.size} units, this grid {got.size}"
    bad = np.flatnonzero(want != got)
    if not bad.size:
        return ""
    layer, kv, head, (a, b) = grid.unit(int(bad[0]))
    what = kv_name(grid.kv_factor, kv)
    return (f"first at layer {layer} {what} head {head} tokens [{a}, {b}) ({bad.size} of {grid.units} units of "
            f"{grid.unit_tokens} token(s) differ)")
