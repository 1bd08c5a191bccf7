"""A digest of a request's KV content that does not depend on how a pool stores it.

The content of a handoff is a set of *rows*: one head of one token of one (layer, K/V),
``head_dim * itemsize`` bytes. Read in the **canonical order** (global layer, K/V, global
head, token), the same rows are the same bytes whatever the engine, page size, block ids,
tensor-parallel split or head-major/token-major layout that holds them. A digest cuts that
sequence into *units* (one layer, one K/V, one head, ``unit_tokens`` consecutive tokens)
and hashes each unit with xxHash's XXH3-64 (``xxhash``: 25-30 GB/s on one core here, about 7x
zlib's CRC-32; a checksum against corruption, not a MAC: the control plane's seal is what
authenticates). Sender and receiver each digest their own side of the same rows; equal
lists mean equal content, and the first unequal unit names where they differ. An fp8
unit's scale (``KVLayout.kv_scales``, as float32: what the engines keep) seeds its hash,
so a unit whose bytes or scale differ differs; a scale of 1.0 seeds 0, as other dtypes.

``DigestGrid`` says which rows (global layers, global heads, tokens) and how they are cut;
``grid_for`` picks ``unit_tokens`` so that a grid has at most ``MAX_UNITS`` units (or one
per (layer, K/V, head)). ``kv_digest(layout, blocks, first_token, grid)`` reads the grid's
rows out of a local pool and returns one ``uint64`` per unit. A host pool is hashed where
its rows lie, by a C loop (``_runhash``) around the xxhash package's own functions that
walks the pool in its address order (a unit's rows still in token order): about 27 GB/s in
a TensorRT-LLM pool, 11 in an SGLang one, on one core of the 2-core CI host (``kvbridge
bench layout``, ``digest``).
``TORCH_DIGEST_ALGORITHM`` digests the same units by a torch reduction on the pool's device
(``_wsum_units``: integer arithmetic, the same bits on a GPU and on the host), so a GPU's
pool is not copied to the host; ``accepted_algorithms`` (receiver) and
``digest_algorithm_for`` (sender) pick between the two.

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

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .geometry import KVLayout, LayoutError, kv_name

if TYPE_CHECKING:
    from .tiles import CopySplit

try:
    from . import _runhash
except ImportError:  # built with the package where a C compiler was there (optional)
    _runhash = None

log = logging.getLogger(__name__)

__all__ = ["DIGEST_ALGORITHM", "DIGEST_HASHES", "MAX_UNITS", "TORCH_DIGEST_ALGORITHM", "DigestGrid", "accepted_algorithms",
           "digest_algorithm_for", "grid_for", "kv_digest", "first_difference"]

DIGEST_ALGORITHM = "xxh3_64/lkht/s32"  # the hash, the canonical order (layer, K/V, head, token), fp8 scale seeds
# the same units, hashed by a torch reduction where the pool lies (a GPU's pool: no copy to the host)
TORCH_DIGEST_ALGORITHM = "wsum31x2/lkht/s32"
DIGEST_HASHES = {"xxh3": DIGEST_ALGORITHM, "torch": TORCH_DIGEST_ALGORITHM}  # the integrity_hash setting's names
_P = (1 << 31) - 1  # the torch reduction's modulus (a prime)
_CHUNK = 2048  # 16-bit words per exact partial sum: 2048 x 2**15 x 2**31 < 2**63
# chunks widened to int64 at a time, whatever the room's size: on the host few enough that the
# temporaries stay in cache (512 KiB each: 5x the rate of one pass), on a GPU enough for few
# launches (32 MiB each)
_CHUNK_ROWS = {"cpu": 32}  # elsewhere 2048
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


def kv_digest(layout: KVLayout, blocks, first_token: int, grid: DigestGrid, *,
              split: "CopySplit | None" = None, algorithm: str = DIGEST_ALGORITHM) -> np.ndarray:
    """The hash ``algorithm`` names (``DIGEST_HASHES``) of each unit of ``grid``, read from
    ``layout``'s local pool: ``blocks`` (block ids in token order, entry 0 holding token
    ``first_token``) hold the grid's tokens. uint64 ``[grid.units]``. LayoutError when the
    grid asks for layers, heads or tokens this pool or block list does not hold, or the
    algorithm is not one of ``DIGEST_HASHES``.

    XXH3-64: rows of contiguous bytes in host memory are hashed where they lie
    (``_run_digest``; with ``split``, its layers spread over the split's threads, as a
    copy's boxes are). Others (a CUDA pool, element-strided rows) are gathered in the
    canonical order one (layer, K/V) at a time (one indexed copy over the pool's row view,
    as the repack kernels do) into one reused buffer, then hashed on the host. The torch
    reduction (``_wsum_units``) gathers the same way and reduces on the pool's device."""
    import xxhash

    from .copyspec import as_block_ids

    if algorithm not in DIGEST_HASHES.values():
        raise LayoutError(f"unknown content digest algorithm {algorithm!r}: this side knows "
                          f"{', '.join(DIGEST_HASHES.values())}")
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
    if algorithm == DIGEST_ALGORITHM and in_place(layout, dev):
        return _run_digest(layout, blk, slot, head, grid, split)
    buf = torch.empty((n, row_bytes // space.unit), dtype=space.rows.dtype, device=dev)  # one (layer, K/V), reused
    span, step = (t1 - t0) * row_bytes, grid.unit_tokens * row_bytes
    if algorithm == TORCH_DIGEST_ALGORITHM:
        torch_seeds, units = torch.from_numpy(_seeds(layout, grid).astype(np.int64)).to(dev), []
    else:  # XXH3-64 over a host copy of each (layer, K/V)'s rows
        torch_seeds = None
        host = buf if dev.type == "cpu" else torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        mv = memoryview(host.view(torch.uint8).numpy().reshape(-1))
        seeds = _seeds(layout, grid).tolist()
        out = np.empty(grid.units, dtype=np.uint64)
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
            if torch_seeds is not None:
                units.append(_wsum_units(buf.view(torch.uint8).view(hn, span), grid.per_row, step,
                                         torch_seeds[layer - (l0 - layout.layer_offset), kv]))
                continue
            if host is not buf:
                host.copy_(buf)
            for h in range(hn):
                seed = seeds[layer - (l0 - layout.layer_offset)][kv][h]
                for a in range(h * span, (h + 1) * span, step):
                    out[k] = xxhash.xxh3_64_intdigest(mv[a:min(a + step, (h + 1) * span)], seed)
                    k += 1
    if torch_seeds is not None:  # one copy to the host, of the values alone
        return torch.cat(units).cpu().numpy().view(np.uint64)
    return out


def _native(layout: KVLayout) -> str:
    """The algorithm cheapest where ``layout``'s pool lies: XXH3-64 in host memory, the
    torch reduction on a GPU (no copy of the rows to the host)."""
    return DIGEST_ALGORITHM if _rows_of(layout).rows.device.type == "cpu" else TORCH_DIGEST_ALGORITHM


def accepted_algorithms(layout: KVLayout, hash: str = "auto") -> list[str]:
    """The digest algorithms a receiver holding ``layout`` accepts, preferred first, under
    the ``integrity_hash`` setting ``hash``: "xxh3" or "torch" (``DIGEST_HASHES``) that one
    alone; "auto" XXH3-64 on a host pool, the torch reduction then XXH3-64 on a GPU's (so
    two GPU pools reduce where they lie, and a host side never reduces in torch)."""
    if hash == "auto":
        return [DIGEST_ALGORITHM] if _native(layout) == DIGEST_ALGORITHM else [TORCH_DIGEST_ALGORITHM, DIGEST_ALGORITHM]
    if hash not in DIGEST_HASHES:
        raise LayoutError(f"integrity hash {hash!r} is not one of auto, {', '.join(DIGEST_HASHES)}")
    return [DIGEST_HASHES[hash]]


def digest_algorithm_for(layout: KVLayout, accepted) -> str:
    """The algorithm a sender holding ``layout`` digests with for a receiver that accepts
    ``accepted`` (preferred first; a receiver that names none: XXH3-64 alone):
    the one cheapest where its own pool lies if accepted, else the first it knows.
    LayoutError naming them when it knows none."""
    accepted = list(accepted) or [DIGEST_ALGORITHM]
    if _native(layout) in accepted:
        return _native(layout)
    for name in accepted:
        if name in DIGEST_HASHES.values():
            return name
    raise LayoutError(f"the receiver accepts content digests by {', '.join(map(repr, accepted))}; this side "
                      f"computes {', '.join(DIGEST_HASHES.values())}")


@functools.lru_cache(maxsize=32)
def _weights(n: int, lane: int, device: str) -> torch.Tensor:
    """int64 ``[n]`` within [1, P): SplitMix64 of (lane, index), computed on the host, so
    every device reduces with the same numbers (entry i does not depend on ``n``)."""
    z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(lane << 56)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return torch.from_numpy((z % np.uint64(_P - 1) + np.uint64(1)).astype(np.int64)).to(device)


def _wsum_units(rows: torch.Tensor, per_row: int, unit_bytes: int, seeds: torch.Tensor) -> torch.Tensor:
    """The torch reduction (``TORCH_DIGEST_ALGORITHM``) of each unit of each head: int64
    ``[heads * per_row]`` (uint64 bits), on ``rows``' device.

    ``rows``: uint8 ``[heads, tokens * row_bytes]``, each head's rows in token order (one
    (layer, K/V) of a grid, canonical order); a unit is ``unit_bytes`` of them (the last
    shorter), ``seeds``: int64 ``[heads]`` (``_seeds``). A unit is read as little-endian
    16-bit words (zero-padded to chunks of ``_CHUNK``); each of two lanes sums word x weight
    exactly per chunk, takes it mod P = 2**31 - 1, weighs the chunks' sums mod P and adds
    the seed (lane 0: seed, lane 1: seed >> 1, mod P); the value is lane 0 << 32 | lane 1.
    Integer arithmetic only, so every device gives the same bits. A change to one word
    changes both lanes (P is prime and above every word's change and every weight)."""
    heads, span = rows.shape
    if span < per_row * unit_bytes:
        rows = torch.nn.functional.pad(rows, (0, per_row * unit_bytes - span))
    x = rows.reshape(heads, per_row, unit_bytes)
    padded = -(-unit_bytes // (2 * _CHUNK)) * 2 * _CHUNK
    if padded != unit_bytes:
        x = torch.nn.functional.pad(x, (0, padded - unit_bytes))
    words = x.contiguous().view(torch.int16).view(-1, _CHUNK)  # every chunk of every unit
    dev, chunks = str(rows.device), padded // (2 * _CHUNK)
    part = torch.empty((2, words.shape[0]), dtype=torch.int64, device=rows.device)
    step = _CHUNK_ROWS.get(rows.device.type, 2048)
    for a in range(0, words.shape[0], step):  # int64 temporaries of `step` chunks at most
        w = words[a:a + step].to(torch.int64)
        for lane in (0, 1):
            torch.sum(w * _weights(_CHUNK, lane, dev), -1, out=part[lane, a:a + step])
    part = torch.remainder(part, _P).view(2, heads, per_row, chunks)
    lanes = []
    for lane, seed in ((0, seeds), (1, seeds >> 1)):
        h = torch.remainder(part[lane] * _weights(chunks, lane + 2, dev), _P).sum(-1)
        lanes.append(torch.remainder(h + torch.remainder(seed, _P)[:, None], _P))
    return ((lanes[0] << 32) | lanes[1]).reshape(-1)


def in_place(layout: KVLayout, device: torch.device) -> bool:
    """Whether ``kv_digest`` hashes ``layout``'s rows where they lie (host memory, each row
    contiguous bytes); else it gathers them first (CUDA pools, element-strided rows)."""
    return device.type == "cpu" and layout.rows_contiguous


def _run_digest(layout: KVLayout, blk: np.ndarray, slot: np.ndarray, head: np.ndarray, grid: DigestGrid,
                split: "CopySplit | None" = None) -> np.ndarray:
    """``kv_digest`` of a CPU pool whose rows are contiguous: each unit hashed where its rows
    lie, a *run* (rows back to back in memory, inside one unit: a block's tokens of one head
    in a head-major pool, one row in a token-major one) at a time. Equals one XXH3 over the
    unit's rows gathered in the canonical order. ``split``: layer ranges on its threads."""
    (l0, l1), (t0, t1) = grid.layers, grid.tokens
    nt, per_row = t1 - t0, grid.per_row
    layers = np.arange(l0, l1, dtype=np.int64) - layout.layer_offset
    bases = layout.base[layers].astype(np.int64)  # [layers, K/V]
    seeds = _seeds(layout, grid)  # [layers, K/V, heads]
    unit_start = np.arange(nt, dtype=np.int64) % grid.unit_tokens == 0
    runs = []
    for kv in range(layout.kv_factor):
        tok = blk * layout.block_stride + layout.token_offsets[kv][slot]  # each token's row, from head 0 of its (layer, K/V)
        cut = unit_start.copy()
        cut[1:] |= tok[1:] != tok[:-1] + layout.head_bytes
        starts = np.flatnonzero(cut)
        runs.append((tok[starts], np.diff(np.append(starts, nt)) * layout.head_bytes, np.cumsum(unit_start[starts]) - 1))
    alike = all(np.array_equal(runs[0][0], r[0]) for r in runs[1:])  # K and V cut alike: one walk over both
    out = np.empty((layers.size, layout.kv_factor, head.size * per_row), dtype=np.uint64)

    def hash_layers(a: int, b: int) -> None:
        if alike:
            out[a:b] = _hash_grid(layout, bases[a:b], head, *runs[0], per_row, seeds[a:b]).reshape(b - a, -1, out.shape[2])
            return
        for kv, r in enumerate(runs):
            out[a:b, kv] = _hash_grid(layout, bases[a:b, kv:kv + 1], head, *r, per_row,
                                      seeds[a:b, kv:kv + 1]).reshape(b - a, -1)

    if split is None:
        hash_layers(0, layers.size)
    else:
        split.run(hash_layers, 0, layers.size, box_bytes=layout.kv_factor * head.size * nt * layout.head_bytes)
    return out.reshape(-1)


def _hash_grid(layout: KVLayout, bases: np.ndarray, head: np.ndarray, offs: np.ndarray, lens: np.ndarray,
               unit: np.ndarray, units: int, seeds: np.ndarray) -> np.ndarray:
    """uint64 ``[layers, K/V, heads, units]`` (flat): XXH3-64, seeded ``seeds[l, kv, h]``, of
    each unit of each (layer, K/V, head), whose runs ``r`` (``unit[r]`` says which unit) are
    ``lens[r]`` bytes at ``bases[l, kv] + head[h] + offs[r]`` in ``layout``'s CPU pool. In C
    (``_runhash``, around the xxhash package's own functions), the four axes walked in the
    pool's address order, where it was built; else in Python, in the canonical order."""
    L, KV = bases.shape
    H, R = head.size, offs.size
    out = np.empty(L * KV * H * units, dtype=np.uint64)
    fns = xxh3_functions()
    if fns is not None:
        strides = [np.median(np.abs(np.diff(bases[:, 0]))) if L > 1 else 0, abs(bases[0, -1] - bases[0, 0]),
                   np.median(np.abs(np.diff(head))) if H > 1 else 0, np.median(np.abs(np.diff(offs))) if R > 1 else 0]
        order = tuple(int(i) for i in np.argsort(-np.array(strides, dtype=np.float64), kind="stable"))
        i64 = [np.ascontiguousarray(a, dtype=np.int64)
               for a in (bases, head, offs, lens, unit, np.bincount(unit, minlength=units))]
        sd = np.ascontiguousarray(seeds, dtype=np.uint64)
        _runhash.hash_grid(fns, i64[0].ctypes.data, L, KV, i64[1].ctypes.data, H, i64[2].ctypes.data,
                           i64[3].ctypes.data, i64[4].ctypes.data, R, i64[5].ctypes.data, units, order,
                           sd.ctypes.data, out.ctypes.data)
        return out
    import xxhash

    mem, lo = _host_bytes(layout)
    pool = memoryview(mem)
    first = np.searchsorted(unit, np.arange(units + 1)).tolist()  # each unit's first run (runs are in unit order)
    offs, lens = offs.tolist(), lens.tolist()
    rows = (bases[:, :, None] + head[None, None, :] - lo).reshape(-1).tolist()
    k = 0
    for b, seed in zip(rows, seeds.reshape(-1).tolist()):
        for u in range(units):
            x = xxhash.xxh3_64(seed=seed)
            for r in range(first[u], first[u + 1]):
                x.update(pool[b + offs[r]:b + offs[r] + lens[r]])
            out[k] = x.intdigest()
            k += 1
    return out


@functools.cache
def xxh3_functions() -> tuple[int, ...] | None:
    """The addresses ``_runhash.hash_grid`` calls: XXH3-64's one-shot (seeded), state,
    reset, update and digest functions, from the xxhash package's own library (the
    CPU-dispatched one-shot and update where it has them). None where ``_runhash`` was not
    built, the library does not export them, or a check against the package's own
    ``xxh3_64_intdigest`` disagrees; ``kv_digest`` then hashes in Python."""
    if _runhash is None:
        log.warning("content digests hash in Python: kvbridge.layout._runhash was not built (no C compiler at install?)")
        return None
    import ctypes

    import xxhash
    from xxhash import _xxhash

    try:
        lib = ctypes.CDLL(_xxhash.__file__)

        def addr(name: str, dispatched: bool = False) -> int:
            f = getattr(lib, name + "_dispatch", None) if dispatched else None
            return ctypes.cast(f if f is not None else getattr(lib, name), ctypes.c_void_p).value

        fns = (addr("XXH3_64bits_withSeed", True), addr("XXH3_createState"), addr("XXH3_freeState"),
               addr("XXH3_64bits_reset_withSeed"), addr("XXH3_64bits_update", True), addr("XXH3_64bits_digest"))
    except (OSError, AttributeError) as e:
        log.warning("content digests hash in Python: the xxhash package's library does not give XXH3's functions (%s)", e)
        return None
    # a check against the package's own value: 2 layers x 1 x 2 heads, runs of two units (3 + 1)
    data = np.frombuffer(bytes(range(256)) * 16, dtype=np.uint8)
    bases = np.array([[data.ctypes.data], [data.ctypes.data + 1000]], dtype=np.int64)
    head, offs = np.array([0, 7], dtype=np.int64), np.array([0, 700, 1500, 40], dtype=np.int64)
    lens, unit = np.array([300, 13, 400, 2000], dtype=np.int64), np.array([0, 0, 0, 1], dtype=np.int64)
    counts, seeds = np.array([3, 1], dtype=np.int64), np.array([0, 1, 12345, 7], dtype=np.uint64)
    got = np.empty(8, dtype=np.uint64)
    _runhash.hash_grid(fns, bases.ctypes.data, 2, 1, head.ctypes.data, 2, offs.ctypes.data, lens.ctypes.data,
                       unit.ctypes.data, 4, counts.ctypes.data, 2, (3, 2, 0, 1), seeds.ctypes.data, got.ctypes.data)
    want = [xxhash.xxh3_64_intdigest(b"".join(data[d + o:d + o + n].tobytes() for o, n in runs), int(s))
            for (d, s) in zip((0, 7, 1000, 1007), seeds.tolist())
            for runs in (list(zip(offs[:3].tolist(), lens[:3].tolist())), [(40, 2000)])]
    if got.tolist() != want:
        log.warning("content digests hash in Python: the C loop over the xxhash package's functions disagrees with it")
        return None
    return fns


def _host_bytes(layout: KVLayout) -> tuple[np.ndarray, int]:
    """A uint8 array over ``layout``'s CPU pool memory from its lowest region's start to its
    highest region's end, no copy (built once per layout), and that start's address."""
    from .pools import alias_memory

    got = layout.derived.get("host_bytes")
    if got is None:
        lo = min(r.addr for r in layout.regions)
        hi = max(r.addr + r.nbytes for r in layout.regions)
        got = layout.derived["host_bytes"] = (alias_memory(lo, hi - lo).numpy(), lo)
    return got


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
