"""The canonical block descriptor: one engine rank's paged KV as an affine address map.

For every (layer, kv, block, token, head) of one rank's KV cache::

    addr = base[layer, kv] + block * block_stride + token * token_stride + head * head_stride

and the ``head_dim * itemsize`` bytes at ``addr`` are contiguous. ``kv`` is 0 for K and
1 for V (``kv_factor == 2``), or always 0 for an MLA latent (``kv_factor == 1``).
Engine formats (``sglang_pool``, ``trtllm_pool``) are constructors that only compute
these numbers. Nothing here touches an engine or a network.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, replace
from functools import cached_property
from typing import Any, Sequence

import numpy as np
import torch

__all__ = [
    "KVLayout",
    "Region",
    "LayoutError",
    "LayoutMismatchError",
    "canonical_dtype",
    "dtype_itemsize",
    "check_compatible",
    "SCALED_DTYPES",
    "scale_mismatches",
]

# Logical KV dtypes by canonical name; fp8 pools may store them as uint8.
_DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


# Dtypes whose stored values an engine multiplies by a per-(layer, K/V, head) scale to read them.
SCALED_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
MAX_ROW_DIM = 1 << 16  # the most tokens per block, or elements per head row, a layout may have


class LayoutError(ValueError):
    """A layout, block list, token range or head map that cannot describe real KV."""


class LayoutMismatchError(LayoutError):
    """Two layouts that cannot exchange KV; ``mismatches`` names each difference."""

    def __init__(self, mismatches: Sequence[str]):
        self.mismatches = list(mismatches)
        super().__init__("incompatible KV layouts: " + "; ".join(self.mismatches))


def canonical_dtype(dtype: Any) -> str:
    """Canonical name of a KV dtype given as a torch dtype or a string ('bf16', 'fp8_e4m3', ...)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = str(dtype).removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    if name not in _DTYPES:
        raise LayoutError(f"unsupported KV dtype {dtype!r}; known: {sorted(_DTYPES)}")
    return name


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a KV dtype."""
    return _DTYPES[canonical_dtype(dtype)]


def _lattices_meet(e: np.ndarray, axes: list[tuple[int, int]], width: int) -> np.ndarray:
    """For each offset ``e >= 0``: does a set of rows ``width`` bytes wide at every point
    ``sum(a_k * stride_k)`` (``0 <= a_k < count_k``; ``axes`` outermost first, each stride
    at least the extent of the axes inside it) share a byte with itself shifted by ``e``?"""
    n = e.size
    which = np.arange(n)
    for count, stride in axes:
        if count <= 1 or not which.size:
            continue
        k = np.minimum(e // stride, count - 1)
        lo = e - k * stride
        up = (k + 1) * stride - e
        more = k + 1 < count
        e = np.concatenate([lo, up[more]])
        which = np.concatenate([which, which[more]])
    met = np.zeros(n, dtype=bool)
    met[which[e < width]] = True
    return met


@dataclass(frozen=True)
class Region:
    """One contiguous piece of memory that holds KV: what a transport registers."""

    addr: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Where every (layer, kv, block, token, head) of one rank's paged KV lives.

    Geometry: ``num_layers`` layers (global ids ``layer_offset ..``), ``kv_factor`` (2: K
    and V, 1: MLA latent), ``num_heads`` KV heads on this rank (global ids
    ``head_offset .. head_offset + num_heads`` of ``total_heads``), ``head_dim`` elements
    of ``dtype`` per head, ``tokens_per_block`` tokens per block (SGLang: page size).
    Valid block ids are ``first_block <= id < num_blocks`` (SGLang reserves page 0).

    Addresses: ``base`` is int64 ``[num_layers, kv_factor]``, the address of block 0,
    token 0, head 0 of that layer and K/V; ``block_stride``, ``token_stride`` and
    ``head_stride`` are in bytes. ``region_of`` ``[num_layers, kv_factor]`` says which
    entry of ``regions`` holds that (layer, kv). ``tensors`` (optional, one per region)
    are the local torch tensors behind the regions; a peer's layout has none.

    Element-strided rows: ``row_strides`` (empty for every layout whose head rows are
    ``head_dim`` contiguous elements) gives, per K/V, ``(token dims, element dims)``,
    replacing ``token_stride`` and the contiguous row. Each is a stride in bytes, or a
    mixed-radix list ``((count, stride), ...)``, outermost first, whose counts multiply
    to ``tokens_per_block`` (``head_dim``): token ``t`` sits at ``sum(((t // inner) %
    count) * stride)`` over the list (``inner`` = the product of the counts inside that
    entry), element ``j`` likewise. Element ``j`` of token ``t`` is at ``base + block *
    block_stride + head * head_stride + token_offsets[kv, t] + elem_offset(kv, j)``.
    vLLM's CPU pool stores K transposed inside a (block, head): token stride = itemsize,
    element stride = block_size * itemsize. Its 'amx' ISA interleaves: K token dims
    ``((bs/16, 16*hd), (16, 2))``, element dims ``((hd/2, 32), (2, 1))`` (in elements).
    Such a layout moves directly only to a layout with the same element dims; otherwise
    only through staging on its own side (``plan_transfer`` enforces this).

    Scales (fp8 only, ``SCALED_DTYPES``): ``kv_scales`` is float64 ``[num_layers,
    kv_factor, num_heads]``, the number the engine multiplies a stored element of that
    (layer, K/V, head) by to read it (per-tensor scales repeat over heads); given as a
    scalar, ``[num_layers, kv_factor]`` or the full shape. None means 1.0 everywhere (what
    each engine uses when the checkpoint has no KV scales). Bytes move as they are, so
    two fp8 layouts exchange KV only where their scales agree (``check_compatible``).
    Other dtypes carry no scales.
    """

    engine: str
    num_layers: int
    kv_factor: int
    num_heads: int
    head_offset: int
    total_heads: int
    head_dim: int
    dtype: str
    tokens_per_block: int
    num_blocks: int
    first_block: int
    block_stride: int
    token_stride: int
    head_stride: int
    base: np.ndarray = field(repr=False)
    region_of: np.ndarray = field(repr=False)
    regions: tuple[Region, ...] = field(repr=False)
    layer_offset: int = 0
    tensors: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    row_strides: tuple[tuple[Dims, Dims], ...] = ()
    kv_scales: np.ndarray | None = field(default=None, repr=False)
    part_of_checked: InitVar[bool] = False  # a subset of a layout already found to own its bytes

    def __post_init__(self, part_of_checked: bool) -> None:
        base = np.ascontiguousarray(self.base, dtype=np.int64)
        region_of = np.ascontiguousarray(self.region_of, dtype=np.int64)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "region_of", region_of)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        try:
            rows = tuple((_dims(t, self.tokens_per_block), _dims(e, self.head_dim)) for t, e in self.row_strides)
        except (TypeError, ValueError) as e:
            raise LayoutError(f"{self.engine} layout: row_strides must be (token, element) pairs of strides or "
                              f"((count, stride), ...) lists: {e}") from None
        object.__setattr__(self, "row_strides", rows)
        object.__setattr__(self, "kv_scales", self._scales_array(self.kv_scales))
        self._check(disjoint=not part_of_checked)

    def _scales_array(self, given: Any) -> np.ndarray | None:
        """``kv_scales`` as float64 ``[num_layers, kv_factor, num_heads]`` (None: all 1.0)."""
        if given is None:
            return None
        full = (self.num_layers, self.kv_factor, self.num_heads)
        try:
            arr = np.asarray(given, dtype=np.float64)
            if arr.ndim == 2:
                arr = arr[:, :, None]
            arr = np.ascontiguousarray(np.broadcast_to(arr, full))
        except (TypeError, ValueError) as e:
            raise LayoutError(f"{self.engine} layout: kv_scales must broadcast to [layers, K/V, heads] {full}: {e}") \
                from None
        if not np.isfinite(arr).all() or (arr <= 0).any():
            raise LayoutError(f"{self.engine} layout: kv_scales must be finite and positive")
        if self.dtype not in SCALED_DTYPES:
            if (arr != 1.0).any():
                raise LayoutError(f"{self.engine} layout: a {self.dtype} KV cache carries no scales, got "
                                  f"{sorted(set(arr.ravel().tolist()))[:4]}")
            return None
        return None if (arr == 1.0).all() else arr

    @property
    def scales(self) -> np.ndarray:
        """float64 ``[num_layers, kv_factor, num_heads]``: each (layer, K/V, head)'s scale (1.0 unscaled)."""
        if self.kv_scales is None:
            return np.ones((self.num_layers, self.kv_factor, self.num_heads))
        return self.kv_scales

    # -- derived geometry -------------------------------------------------------------
    @cached_property
    def derived(self) -> dict:
        """Objects derived from this layout, computed once by whoever needs them first
        (e.g. the row view of its memory that repacks index into)."""
        return {}

    @cached_property
    def relative_key(self) -> tuple:
        """Equal for two layouts whose addresses all differ by one constant (the same pool
        geometry in another process): the same geometry, strides and ``base`` relative to
        its lowest entry. Rows of such layouts are in the same address order."""
        rel = (self.base - self.base.min()).ravel()  # never empty: _check wants num_layers >= 1
        return (self.engine, self.num_layers, self.layer_offset, self.kv_factor, self.num_heads, self.head_offset,
                self.total_heads, self.head_dim, self.dtype, self.tokens_per_block, self.num_blocks, self.first_block,
                self.block_stride, self.token_stride, self.head_stride, tuple(rel.tolist()), self.row_strides)

    @property
    def rows_contiguous(self) -> bool:
        """True when every head row is ``head_dim`` contiguous elements (no ``row_strides``)."""
        return not self.row_strides

    def token_dims(self, kv: int) -> tuple[tuple[int, int], ...]:
        """K/V ``kv``'s tokens inside a block as ``((count, stride in bytes), ...)``, outermost first."""
        return _as_list(self.row_strides[kv][0] if self.row_strides else self.token_stride, self.tokens_per_block)

    def elem_dims(self, kv: int) -> tuple[tuple[int, int], ...]:
        """K/V ``kv``'s elements of a head row as ``((count, stride in bytes), ...)``, outermost first."""
        return _as_list(self.row_strides[kv][1] if self.row_strides else self.itemsize, self.head_dim)

    @cached_property
    def token_offsets(self) -> np.ndarray:
        """Byte offset of every slot inside its (block, head), per K/V: int64 ``[kv_factor, tokens_per_block]``."""
        return np.stack([mixed_radix_offsets(self.token_dims(kv)) for kv in range(self.kv_factor)])

    @property
    def affine_tokens(self) -> bool:
        """True when every K/V's slots are one stride apart (no mixed-radix token dims)."""
        return all(len(self.token_dims(kv)) == 1 for kv in range(self.kv_factor))

    def _tile_extents(self) -> np.ndarray:
        """Per K/V, bytes from a (layer, kv, block)'s first byte to its last one, over every head."""
        elems = np.array([sum((c - 1) * st for c, st in self.elem_dims(kv)) for kv in range(self.kv_factor)],
                         dtype=np.int64)
        return (self.num_heads - 1) * self.head_stride + self.token_offsets.max(axis=1) + elems + self.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _DTYPES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token: the innermost contiguous unit."""
        return self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one (layer, kv) on this rank (all its heads)."""
        return self.num_heads * self.head_bytes

    @property
    def is_head_major(self) -> bool:
        """True when heads are outside tokens inside a block (HND), False for NHD."""
        return self.num_heads > 1 and self.head_stride > self.token_stride

    @property
    def heads(self) -> range:
        """Global ids of the heads on this rank."""
        return range(self.head_offset, self.head_offset + self.num_heads)

    @property
    def device(self) -> torch.device | None:
        """Device of the local tensors, or None for a peer's layout."""
        return self.tensors[0].device if self.tensors else None

    def _check(self, disjoint: bool = True) -> None:
        bad = []
        if self.kv_factor not in (1, 2):
            bad.append(f"kv_factor must be 1 or 2, got {self.kv_factor}")
        for name in ("num_layers", "num_heads", "total_heads", "head_dim", "tokens_per_block", "num_blocks"):
            if getattr(self, name) <= 0:
                bad.append(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("tokens_per_block", "head_dim"):  # per-slot and per-element tables are built from these
            if getattr(self, name) > MAX_ROW_DIM:
                bad.append(f"{name} {getattr(self, name)} is over {MAX_ROW_DIM}")
        if not 0 <= self.head_offset or self.head_offset + self.num_heads > self.total_heads:
            bad.append(
                f"heads {self.head_offset}..{self.head_offset + self.num_heads} outside 0..{self.total_heads}"
            )
        if not 0 <= self.first_block < self.num_blocks:
            bad.append(f"first_block {self.first_block} outside 0..{self.num_blocks}")
        if self.base.shape != (self.num_layers, self.kv_factor):
            bad.append(f"base has shape {self.base.shape}, expected {(self.num_layers, self.kv_factor)}")
        if self.region_of.shape != self.base.shape:
            bad.append(f"region_of has shape {self.region_of.shape}, expected {self.base.shape}")
        if self.tensors is not None and len(self.tensors) != len(self.regions):
            bad.append(f"{len(self.tensors)} tensors for {len(self.regions)} regions")
        for s in ("block_stride", "token_stride", "head_stride"):
            v = getattr(self, s)
            if v < 0 or v % self.itemsize:
                bad.append(f"{s}={v} is not a non-negative multiple of itemsize {self.itemsize}")
        if self.row_strides:
            if len(self.row_strides) != self.kv_factor:
                bad.append(f"row_strides has {len(self.row_strides)} entries for kv_factor {self.kv_factor}")
            elif any(st <= 0 or st % self.itemsize for kv in range(self.kv_factor)
                     for _, st in self.token_dims(kv) + self.elem_dims(kv)):
                bad.append(f"row_strides {self.row_strides} are not positive multiples of itemsize {self.itemsize}")
        if bad:
            raise LayoutError(f"{self.engine} layout: " + "; ".join(bad))
        if not self.regions:
            return
        # every byte the map can name must lie inside the region of its (layer, kv)
        if self.row_strides:
            span = ((self.num_blocks - 1) * self.block_stride + self._tile_extents())[None, :]
        else:
            span = (
                (self.num_blocks - 1) * self.block_stride
                + (self.tokens_per_block - 1) * self.token_stride
                + (self.num_heads - 1) * self.head_stride
                + self.head_bytes
            )
        if self.region_of.min() < 0 or self.region_of.max() >= len(self.regions):
            raise LayoutError(f"{self.engine} layout: region_of names a region that does not exist")
        starts = np.array([r.addr for r in self.regions], dtype=np.int64)[self.region_of]
        ends = np.array([r.addr + r.nbytes for r in self.regions], dtype=np.int64)[self.region_of]
        if (self.base < starts).any() or (self.base + span > ends).any():
            raise LayoutError(
                f"{self.engine} layout: {self.num_blocks} blocks of {self.block_stride} B do not fit "
                "inside the memory regions given"
            )
        if disjoint:
            self._check_disjoint()

    def _check_disjoint(self) -> None:
        """Raise LayoutError unless the slots the map names own their bytes.

        The regions lie apart; the block, token and head axes nest in stride order, each
        stepping over everything inside it (HND, NHD, vLLM's orders with heads or tokens
        outside blocks); and no head row of one (layer, kv) meets a head row of another in any
        pair of blocks (vLLM's K and V share each row's bytes side by side, TensorRT-LLM's
        layers share each block's). Element-strided rows (vLLM CPU) interleave K and V element
        by element: there a block is its extent, and only blocks of the same K/V are compared.
        """
        where = f"{self.engine} layout"
        addr = np.array([r.addr for r in self.regions], dtype=np.int64)
        size = np.array([r.nbytes for r in self.regions], dtype=np.int64)
        order = np.argsort(addr, kind="stable")
        if ((addr[order] + size[order])[:-1] > addr[order][1:]).any():
            raise LayoutError(f"{where}: its memory regions overlap")
        if self.rows_contiguous:  # the block, token and head axes nest in stride order, whatever it is
            axes, inner = [], self.head_bytes
            for count, stride, name in sorted(((self.num_blocks, self.block_stride, "block_stride"),
                                               (self.tokens_per_block, self.token_stride, "token_stride"),
                                               (self.num_heads, self.head_stride, "head_stride")), key=lambda a: a[1]):
                if count > 1:
                    axes.insert(0, (count, stride, inner, name))
                    inner += (count - 1) * stride
            width = self.head_bytes
        else:  # mixed-radix rows: a block is its extent
            width = int(self._tile_extents().max())
            axes = [(self.num_blocks, self.block_stride, width, "block_stride")]
        for count, stride, inner, name in axes:
            if count > 1 and stride < inner:
                raise LayoutError(f"{where}: {name}={stride} B does not step over the {inner} B inside it, so "
                                  "rows or blocks would share bytes (each axis must nest the ones inside it)")
        base, reg = self.base.ravel(), self.region_of.ravel()
        kv = np.tile(np.arange(self.kv_factor), self.num_layers)
        i, j = np.triu_indices(base.size, k=1)
        keep = reg[i] == reg[j]
        if not self.rows_contiguous:
            keep &= kv[i] == kv[j]
        i, j = i[keep], j[keep]
        # rows of i and j (j at e bytes from i) meet iff e - (p - q) lies within a row of 0 for
        # points p, q of the nested lattice; per axis only the two multiples bracketing e can
        hit = _lattices_meet(np.abs(base[j] - base[i]), [(c, s) for c, s, _, _ in axes], width)
        if hit.any():
            a, b = int(i[hit][0]), int(j[hit][0])
            raise LayoutError(f"{where}: layer {a // self.kv_factor} kv {a % self.kv_factor} and layer "
                              f"{b // self.kv_factor} kv {b % self.kv_factor} put rows on the same bytes")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one (layer, kv) on this rank (from its first byte to its
        last, for element-strided rows)."""
        if self.row_strides:
            return int(self._tile_extents().max())
        if self.is_head_major:
            return self.num_heads * self.head_stride
        return self.tokens_per_block * self.token_stride

    @property
    def layers_inside_blocks(self) -> bool:
        """True when one block holds several layers (TensorRT-LLM), False for per-layer pools."""
        return self.block_stride > self.block_bytes

    def layer_range(self, start: int, stop: int) -> "KVLayout":
        """The same pool seen as layers ``[start, stop)`` only (indices into this layout's
        layers; global ids ``layer_offset + start ..``): ``base`` and ``region_of`` rows
        ``start:stop``, every stride, region and tensor unchanged. A plan between two
        such views moves those layers only, in as few segments as the whole-layer plan
        cuts per layer."""
        if not 0 <= start < stop <= self.num_layers:
            raise LayoutError(f"{self.engine} layout: layer range [{start}, {stop}) outside its "
                              f"{self.num_layers} layers")
        if start == 0 and stop == self.num_layers:
            return self
        return replace(self, num_layers=stop - start, layer_offset=self.layer_offset + start,
                       base=self.base[start:stop], region_of=self.region_of[start:stop],
                       kv_scales=None if self.kv_scales is None else self.kv_scales[start:stop], part_of_checked=True)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> "KVLayout":
        """The same layout with local tensors attached (their addresses must match)."""
        got = [t.data_ptr() for t in tensors]
        want = [r.addr for r in self.regions]
        if got != want:
            raise LayoutError("tensors do not sit at the layout's region addresses")
        return replace(self, tensors=tuple(tensors))

    def with_scales(self, kv_scales: Any) -> "KVLayout":
        """The same layout with the engine's KV scales (see the class docstring; None: 1.0)."""
        return replace(self, kv_scales=kv_scales)

    # -- (de)serialisation for the control protocol -------------------------------------
    def describe(self) -> dict[str, Any]:
        """Plain-data description (addresses included, tensors not) for a peer."""
        return {
            "engine": self.engine,
            "num_layers": self.num_layers,
            "kv_factor": self.kv_factor,
            "num_heads": self.num_heads,
            "head_offset": self.head_offset,
            "total_heads": self.total_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "tokens_per_block": self.tokens_per_block,
            "num_blocks": self.num_blocks,
            "first_block": self.first_block,
            "block_stride": self.block_stride,
            "token_stride": self.token_stride,
            "head_stride": self.head_stride,
            "base": self.base.tolist(),
            "region_of": self.region_of.tolist(),
            "regions": [[r.addr, r.nbytes] for r in self.regions],
            "layer_offset": self.layer_offset,
            **({"row_strides": [[_dims_plain(d) for d in p] for p in self.row_strides]} if self.row_strides else {}),
            **({"kv_scales": self.kv_scales.tolist()} if self.kv_scales is not None else {}),
        }

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> "KVLayout":
        """Rebuild a peer's layout from ``describe()`` output; raises LayoutError if malformed.

        A description comes off the network: it must have exactly ``describe()``'s fields,
        integers where integers belong (no floats, bools or values past 2**62), and the
        address arrays must be integer arrays of the right nesting."""
        if not isinstance(d, dict):
            raise LayoutError(f"malformed layout description: expected a map, got {type(d).__name__}")
        unknown, missing = set(d) - _DESC_FIELDS, _DESC_FIELDS - set(d) - {"layer_offset", "row_strides", "kv_scales"}
        if unknown or missing:
            raise LayoutError(f"malformed layout description: unknown fields {sorted(map(str, unknown))[:8]}, "
                              f"missing fields {sorted(missing)}")
        for name in _DESC_INTS:
            v = d.get(name, 0)
            if type(v) is not int or not 0 <= v < 2**62:
                raise LayoutError(f"malformed layout description: {name} must be an integer in 0..2**62, got {v!r:.40}")
        for name in ("engine", "dtype"):
            if not isinstance(d[name], str):
                raise LayoutError(f"malformed layout description: {name} must be a string, got {d[name]!r:.40}")
        try:
            fields = dict(d)
            for name, ndim in (("base", 2), ("region_of", 2), ("regions", 2)):
                arr = np.asarray(fields[name])
                if name == "regions" and arr.size == 0:
                    arr = np.zeros((0, 2), dtype=np.int64)  # a layout without registered regions
                if arr.ndim != ndim or (arr.size and arr.dtype.kind not in "iu"):
                    raise LayoutError(f"malformed layout description: {name} must be a {ndim}-d array of integers "
                                      f"(int64), got {arr.dtype} of shape {arr.shape}")
                fields[name] = arr.astype(np.int64, copy=False)
            if fields["regions"].size and fields["regions"].shape[1] != 2:
                raise LayoutError("malformed layout description: regions must be [addr, nbytes] pairs")
            if (fields["regions"] < 0).any() or (fields["base"] < 0).any():
                raise LayoutError("malformed layout description: negative address or size")
            fields["regions"] = tuple(Region(int(a), int(n)) for a, n in fields["regions"])
            if "row_strides" in fields:
                rows = fields["row_strides"]
                if (not isinstance(rows, (list, tuple)) or len(rows) > 2
                        or not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(map(_wire_dims, p))
                                   for p in rows)):
                    raise LayoutError("malformed layout description: row_strides must be up to two [token, element] "
                                      "pairs, each a positive integer or a list of [count, stride] pairs of them, "
                                      f"got {rows!r:.80}")
                fields["row_strides"] = tuple(tuple(p) for p in rows)
            if "kv_scales" in fields:
                arr = np.asarray(fields["kv_scales"])
                if arr.ndim != 3 or (arr.size and arr.dtype.kind != "f"):
                    raise LayoutError("malformed layout description: kv_scales must be a 3-d array of floats "
                                      f"[layers, K/V, heads], got {arr.dtype} of shape {arr.shape}")
                if arr.shape != (fields.get("num_layers"), fields.get("kv_factor"), fields.get("num_heads")):
                    raise LayoutError(f"malformed layout description: kv_scales has shape {arr.shape}, expected "
                                      f"[num_layers, kv_factor, num_heads]")
            return cls(**fields)
        except LayoutError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise LayoutError(f"malformed layout description: {e}") from e


Dims = "int | tuple[tuple[int, int], ...]"  # a stride, or mixed-radix (count, stride) pairs, outermost first


def _dims(d: Any, size: int) -> Any:
    """``d`` as a stride (int) or a tuple of (count, stride) pairs whose counts multiply to ``size``."""
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        return int(d)
    pairs = tuple((int(c), int(st)) for c, st in d)
    if not pairs or any(c <= 0 for c, _ in pairs) or int(np.prod([c for c, _ in pairs])) != size:
        raise ValueError(f"counts of {pairs} do not multiply to {size}")
    return pairs[0][1] if len(pairs) == 1 else pairs


def _as_list(d: Any, size: int) -> tuple[tuple[int, int], ...]:
    return ((size, d),) if isinstance(d, int) else d


def _dims_plain(d: Any) -> Any:
    return d if isinstance(d, int) else [list(p) for p in d]


def _wire_dims(d: Any) -> bool:
    """Whether ``d`` (off the network) is a positive integer or a short list of [count, stride] pairs of them."""
    if type(d) is int:
        return 0 < d < 2**62
    return (isinstance(d, (list, tuple)) and 0 < len(d) <= 8
            and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(type(v) is int and 0 < v < 2**62 for v in p)
                    for p in d))


def mixed_radix_offsets(dims: Sequence[tuple[int, int]]) -> np.ndarray:
    """Offsets of ``prod(counts)`` consecutive indices under ``((count, stride), ...)``
    (outermost first): int64, index ``i`` at ``sum(((i // inner) % count) * stride)``."""
    out = np.zeros(1, dtype=np.int64)
    for c, st in dims:
        out = (out[:, None] + np.arange(c, dtype=np.int64)[None, :] * st).reshape(-1)
    return out


_DESC_INTS = ("num_layers", "kv_factor", "num_heads", "head_offset", "total_heads", "head_dim", "tokens_per_block",
              "num_blocks", "first_block", "block_stride", "token_stride", "head_stride", "layer_offset")
_DESC_FIELDS = frozenset(_DESC_INTS + ("engine", "dtype", "base", "region_of", "regions", "row_strides", "kv_scales"))


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise LayoutMismatchError naming every difference that makes src -> dst impossible.

    Page size, head split and byte order may differ; the model geometry may not, nor (fp8)
    the scale of any (layer, K/V, head) both hold: bytes move as they are.
    """
    mism = []
    for name in ("num_layers", "layer_offset", "kv_factor", "total_heads", "head_dim", "dtype"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            mism.append(f"{name}: source {a} != destination {b}")
    if not mism and src.dtype in SCALED_DTYPES:
        mism += scale_mismatches(src, dst)
    if mism:
        raise LayoutMismatchError(mism)


def kv_name(kv_factor: int, kv: int) -> str:
    """'K' or 'V' (kv 0 or 1 of a kv_factor 2 layout), or 'latent' (kv_factor 1), for messages."""
    return "latent" if kv_factor == 1 else "KV"[kv]


def scale_mismatches(src: KVLayout, dst: KVLayout, limit: int = 3) -> list[str]:
    """Where the fp8 scales of the heads both layouts hold differ (relative 1e-6, so a
    scale kept as float32 by one engine and float64 by the other agrees), in words: the
    first head of each (layer, K/V) that differs, up to ``limit`` of them."""
    h0, h1 = max(src.head_offset, dst.head_offset), min(src.head_offset + src.num_heads,
                                                        dst.head_offset + dst.num_heads)
    if h0 >= h1 or (src.kv_scales is None and dst.kv_scales is None):
        return []
    a = src.scales[:, :, h0 - src.head_offset:h1 - src.head_offset]
    b = dst.scales[:, :, h0 - dst.head_offset:h1 - dst.head_offset]
    bad = ~np.isclose(a, b, rtol=1e-6, atol=0.0)
    pairs = np.argwhere(bad.any(axis=2))
    if not len(pairs):
        return []
    out = []
    for l, kv in pairs[:limit]:
        h = int(np.flatnonzero(bad[l, kv])[0])
        out.append(f"{src.dtype} scale of layer {src.layer_offset + int(l)} {kv_name(src.kv_factor, int(kv))} head {h0 + h}: source "
                   f"{a[l, kv, h]:g} != destination {b[l, kv, h]:g}")
    if len(pairs) > limit:
        out.append(f"and {len(pairs) - limit} more (layer, K/V) with other scales")
    out.append(f"{int(bad.sum())} of {bad.size} (layer, K/V, head) scales differ; fp8 bytes move as they are, "
               "so they would decode to other numbers")
    return out
