"""Is moving this request's KV worth it? Predicted handoff time against the alternatives.

For one request (model geometry, prompt length) on one link, the handoff costs

    setup (handshake, registration) + the plan chooser's estimate of the plan it would run
    (segments * per_segment + bytes / bandwidth, and a staged plan's repack beside it:
    ``kvbridge.layout.PlanCosts.seconds``, the one formula both use)

and the alternatives are recomputing the prefill on the decode worker
(``prompt_len / decode_prefill_tps``) or waiting in the prefill queue and then moving.
One ``LinkProfile`` describes the link: a preset per Mooncake protocol (``tcp``,
``rdma``, ``nvlink``; see ``LINK_PRESETS`` for where each figure comes from), a file
written by ``kvbridge bench link --out``, or the preset of the protocol the transport
runs (``load_link``; a file is read once per process and version). It yields both this
model's figures and the plan chooser's (``LinkProfile.plan_costs`` ->
``kvbridge.layout.PlanCosts``, what ``HandoffConfig.costs`` holds). Segments and staging
come from the plan the handoff would run, as the chooser estimates it over the two sides'
layouts (``request_estimate``; by default SGLang-style pools of the model's geometry,
blocks as a fresh pool hands them out).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.layout import (CopySpec, KindEstimate, KVLayout, PlanCosts, PlanKind, TransferPlan, estimate_plan,
                             sglang_layout_from_buffers)

__all__ = [
    "LINK_PRESETS",
    "MODEL_PRESETS",
    "PROTOCOL_LINKS",
    "LinkProfile",
    "ModelGeometry",
    "Decision",
    "decide",
    "LayerwiseEstimate",
    "decide_layerwise",
    "layer_plan_segments",
    "predict_handoff_s",
    "break_even_prompt_len",
    "load_link",
    "model_layout",
    "request_estimate",
]


@dataclass(frozen=True)
class LinkProfile:
    """What moving bytes between two workers costs on one link."""

    name: str
    bandwidth_bytes_per_s: float  # sustained payload bandwidth, large pieces
    per_segment_s: float  # marginal cost of one more piece inside a batch
    setup_s: float  # per handoff: control round trip + first write to a warm peer
    repack_bytes_per_s: float  # sender gather into staging (GPU: HBM copy; CPU here)
    source: str = "preset"  # "preset" or "measured: <file>"
    per_batch_s: float = 100e-6  # one more write batch: submit, completion, the sender's bookkeeping (per layer, layer-wise)
    repack_overlap: float = 1.0  # how much of the gather the wire hides (``PlanCosts.repack_overlap``), measured by bench link

    def __post_init__(self) -> None:
        if not 0.0 <= self.repack_overlap <= 1.0:
            raise ValueError(f"link {self.name}: repack_overlap must be within [0, 1], got {self.repack_overlap}")

    def plan_costs(self, overlap_repack: bool = True) -> PlanCosts:
        """The plan chooser's figures for this link (``HandoffConfig.costs``)."""
        return PlanCosts(segment_s=self.per_segment_s, wire_bytes_per_s=self.bandwidth_bytes_per_s,
                         repack_bytes_per_s=self.repack_bytes_per_s, overlap_repack=overlap_repack,
                         repack_overlap=self.repack_overlap)

    def describe(self) -> str:
        """One line: the figures and where they come from."""
        return (
            f"{self.name}: {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s, {self.per_segment_s * 1e6:.1f} us/segment, "
            f"setup {self.setup_s * 1e3:.2f} ms, repack {self.repack_bytes_per_s / 1e9:.0f} GB/s"
            f"{f' ({self.repack_overlap:g} of it overlapped)' if self.repack_overlap != 1.0 else ''} ({self.source})"
        )


# Presets. ``tcp`` is MEASURED: Mooncake TCP between two processes on 127.0.0.1 on a
# 2-core CPU machine (1 GiB as 16 x 64 MiB at 1.6-2.5
# GB/s; 1000 scattered 16 KiB pieces in one batch at 0.4-0.6 GB/s, i.e. ~25-35 us per
# piece beyond the bytes; first write to a peer 1-7 ms, later small writes 73-163 us). Its
# repack, 5 GB/s, is the CPU gather figure the plan chooser has always used; ``kvbridge
# bench layout`` measured 0.5-2.2 GB/s (4096 tokens) on that machine while shared, so
# it is optimistic there. These are also ``kvbridge.layout.PlanCosts``' defaults (a test
# keeps them equal).
# The others are NOMINAL, from public figures, not measured here: ``nvlink`` NVLink 4
# ~450 GB/s per direction (~380 measured with large copies); ``pcie5`` PCIe Gen5 x16 ~64
# GB/s per direction (~50 effective); ``rdma`` / ``ib400`` one 400G NDR InfiniBand port
# 50 GB/s (~45 effective; Mooncake's README reports 87 GB/s over 4 x 200 Gb/s RoCE). Their
# per-segment costs (a few us: one work request or copy per piece) and setup are
# estimates, and their repack is a GPU gather at HBM speed (~2 TB/s). Measure a real link
# with ``kvbridge bench link --out FILE`` and use the file instead.
# ``per_batch_s`` is what one more write batch costs beyond its segments and bytes (a
# layer-wise send writes one batch per layer): ``tcp``'s is the measured latency of later
# small writes to a warm peer (73-163 us, above); the others' 30 us are an estimate (a
# post, a completion poll and the sender's Python bookkeeping per batch).
LINK_PRESETS: dict[str, LinkProfile] = {
    "nvlink": LinkProfile("nvlink", 380e9, 2e-6, 0.3e-3, 2000e9, source="preset (nominal)", per_batch_s=30e-6),
    "pcie5": LinkProfile("pcie5", 50e9, 4e-6, 0.3e-3, 2000e9, source="preset (nominal)", per_batch_s=30e-6),
    "rdma": LinkProfile("rdma", 45e9, 5e-6, 0.5e-3, 2000e9, source="preset (nominal)", per_batch_s=30e-6),
    "ib400": LinkProfile("ib400", 45e9, 5e-6, 0.5e-3, 2000e9, source="preset (nominal)", per_batch_s=30e-6),
    "tcp": LinkProfile("tcp", 2e9, 30e-6, 1.0e-3, 5e9, source="preset (measured: Mooncake TCP on loopback, 2 cores)",
                       per_batch_s=120e-6),
}

# Mooncake's ``protocol`` argument -> the preset of that link
PROTOCOL_LINKS = {"tcp": "tcp", "rdma": "rdma", "nvlink": "nvlink", "nvlink_intra": "nvlink"}


@dataclass(frozen=True)
class ModelGeometry:
    """What sizes a request's KV and its prefill compute."""

    name: str
    layers: int
    kv_heads: int  # 1 for MLA (one latent "head")
    head_dim: int  # MLA: kv_lora_rank + qk_rope_head_dim
    kv_factor: int  # 2 (K and V) or 1 (MLA)
    dtype_bytes: int
    params: float  # parameters that run per token (active parameters for MoE)
    hidden: int
    attn_heads: int
    source: str = "preset"

    def kv_bytes(self, tokens: int) -> int:
        """KV bytes of ``tokens`` tokens (all layers, whole model, before TP split)."""
        return self.layers * self.kv_factor * self.kv_heads * self.head_dim * self.dtype_bytes * tokens

    def prefill_flops(self, tokens: int) -> float:
        """Forward FLOPs of a prefill of ``tokens`` tokens: 2 x params per token plus the
        causal attention scores and weighted sums (2 x 2 x layers x tokens^2 / 2 x hidden)."""
        return 2.0 * self.params * tokens + 2.0 * self.layers * tokens * tokens * self.hidden

    @classmethod
    def from_hf_config(cls, path: str | Path, dtype_bytes: int = 2) -> "ModelGeometry":
        """Geometry from a Hugging Face ``config.json`` (Llama/Qwen-style GQA or DeepSeek MLA)."""
        p = Path(path)
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        return cls.from_hf_dict(cfg, dtype_bytes, name=cfg.get("model_type", p.stem), source=f"config: {p}")

    @classmethod
    def from_hf_dict(cls, cfg: dict, dtype_bytes: int = 2, *, name: str = "", source: str = "config") -> "ModelGeometry":
        """Geometry from the fields of a Hugging Face config (a ``config.json`` as a dict)."""
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"model config lacks {missing}: not a decoder LLM config")
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg.get("vocab_size", 32000))
        inter = int(cfg.get("intermediate_size", 4 * hidden))
        if cfg.get("kv_lora_rank"):
            kv_heads, head_dim, kv_factor = 1, int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 64)), 1
        else:
            kv_heads = int(cfg.get("num_key_value_heads", heads))
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            kv_factor = 2
        # dense estimate: attention (4 h^2, GQA-adjusted) + gated MLP (3 h i) per layer + embeddings
        attn = hidden * (heads * (hidden // heads)) * 2 + hidden * kv_heads * head_dim * kv_factor
        params = layers * (attn + 3 * hidden * inter) + vocab * hidden
        if cfg.get("n_routed_experts"):  # MoE: only the active experts run per token
            moe_inter = int(cfg.get("moe_intermediate_size", inter))
            active = int(cfg.get("num_experts_per_tok", 8)) + int(cfg.get("n_shared_experts", 0) or 0)
            params = layers * (attn + 3 * hidden * moe_inter * active) + vocab * hidden
        return cls(name or cfg.get("model_type", "model"), layers, kv_heads, head_dim, kv_factor, dtype_bytes,
                   float(params), hidden, heads, source=source)


MODEL_PRESETS: dict[str, ModelGeometry] = {
    "llama3-8b": ModelGeometry("llama3-8b", 32, 8, 128, 2, 2, 8.0e9, 4096, 32),
    "llama3-70b": ModelGeometry("llama3-70b", 80, 8, 128, 2, 2, 70.6e9, 8192, 64),
    "qwen3-8b": ModelGeometry("qwen3-8b", 36, 8, 128, 2, 2, 8.2e9, 4096, 32),
    "deepseek-v3": ModelGeometry("deepseek-v3", 61, 1, 576, 1, 1, 37e9, 7168, 128),  # fp8 KV, 37B active
}


def load_link(spec: str = "", protocol: str = "tcp") -> LinkProfile:
    """The link: ``spec``, a preset name (``tcp``, ``rdma``, ``nvlink``, ``pcie5``,
    ``ib400``) or the path of a file written by ``kvbridge bench link --out``; when empty,
    the preset of the Mooncake ``protocol`` in use. A file is read once per process for
    as long as its modification time and size stay the same."""
    if not spec:
        name = PROTOCOL_LINKS.get(str(protocol).lower())
        if name is None:
            raise ValueError(f"no link preset for Mooncake protocol {protocol!r}; known: {sorted(PROTOCOL_LINKS)}")
        return LINK_PRESETS[name]
    if spec in LINK_PRESETS:
        return LINK_PRESETS[spec]
    try:
        st = os.stat(spec)
    except OSError:
        raise ValueError(f"unknown link {spec!r}: not a preset ({', '.join(LINK_PRESETS)}) nor a file") from None
    key, version = os.path.abspath(spec), (st.st_mtime_ns, st.st_size)
    with _LINK_FILES_LOCK:
        seen = _LINK_FILES.get(key)
        if seen is None or seen[0] != version:
            seen = _LINK_FILES[key] = (version, _read_link_file(Path(spec)))
    return seen[1]


# link file (absolute path) -> ((mtime_ns, size) when read, its LinkProfile): each version read once
_LINK_FILES: dict[str, tuple[tuple[int, int], LinkProfile]] = {}
_LINK_FILES_LOCK = threading.Lock()


def _read_link_file(p: Path) -> LinkProfile:
    """A ``kvbridge bench link --out`` file's link."""
    d = json.loads(p.read_text())
    try:
        return LinkProfile(d.get("name", p.stem), float(d["bandwidth_bytes_per_s"]), float(d["per_segment_s"]),
                           float(d["setup_s"]), float(d["repack_bytes_per_s"]), source=f"measured: {p}",
                           per_batch_s=float(d.get("per_batch_s", LinkProfile.per_batch_s)),
                           repack_overlap=float(d.get("repack_overlap", LinkProfile.repack_overlap)))
    except KeyError as e:
        raise ValueError(f"{p} lacks {e}; write it with `kvbridge bench link --out {p}`") from None


_DTYPE_OF_BYTES = {1: "fp8_e4m3", 2: "bfloat16", 4: "float32"}


def model_layout(model: "ModelGeometry", tokens: int, *, page: int = 16, base_addr: int = 1 << 40) -> KVLayout:
    """An SGLang-style pool of ``model``'s whole KV (all heads, one rank) with room for
    ``tokens`` tokens in pages of ``page`` (page 0 padding), at made-up addresses: for
    planning only (no memory behind it)."""
    if model.dtype_bytes not in _DTYPE_OF_BYTES:
        raise ValueError(f"{model.name}: no KV dtype of {model.dtype_bytes} bytes")
    pages = -(-tokens // page) + 1
    mla = model.kv_factor == 1
    item = page * model.kv_heads * model.head_dim * model.dtype_bytes
    n = model.layers * model.kv_factor
    ptrs = [base_addr + i * (pages * item + 4096) for i in range(n)]
    return sglang_layout_from_buffers(ptrs, [pages * item] * n, [item] * n, page, model.kv_heads, model.kv_heads,
                                      _DTYPE_OF_BYTES[model.dtype_bytes], is_mla=mla)


def request_estimate(src: KVLayout, dst: KVLayout, tokens: int | tuple[int, int], link: LinkProfile, *,
                     kinds: tuple[PlanKind, ...] = (PlanKind.DIRECT, PlanKind.STAGED_SEND)) -> KindEstimate:
    """The plan chooser's estimate (kind, segments, seconds) of the plan a handoff of
    ``tokens`` (``stop`` or ``(start, stop)``) from ``src`` to ``dst`` would run on
    ``link``, with blocks as a fresh pool hands them out (consecutive from each layout's
    first block)."""
    start, stop = (0, tokens) if isinstance(tokens, int) else tokens
    sb = np.arange(src.first_block, src.first_block + -(-stop // src.tokens_per_block))
    db = np.arange(dst.first_block, dst.first_block + -(-stop // dst.tokens_per_block))
    if sb[-1] >= src.num_blocks or db[-1] >= dst.num_blocks:
        raise ValueError(f"{stop} tokens do not fit the layouts ({src.num_blocks} / {dst.num_blocks} blocks)")
    return estimate_plan(CopySpec.build(src, sb, dst, db, (start, stop)), kinds=kinds, costs=link.plan_costs())


@lru_cache(maxsize=256)
def _model_estimate(model: "ModelGeometry", link: LinkProfile, start: int, stop: int) -> KindEstimate:
    lay = model_layout(model, stop)
    return request_estimate(lay, lay, (start, stop), link)


@dataclass(frozen=True)
class HandoffEstimate:
    """Predicted handoff time and its parts (seconds)."""

    bytes: int
    segments: int
    setup_s: float
    wire_s: float
    segments_s: float
    repack_s: float  # the part of the repack not hidden behind the wire
    total_s: float


def predict_handoff_s(nbytes: int, segments: int, link: LinkProfile, *, staged: bool,
                      overlapped: bool = True) -> HandoffEstimate:
    """Handoff time for ``nbytes`` in ``segments`` wire segments: the link's setup plus the
    plan chooser's estimate of a direct or staged plan (``PlanCosts.seconds``)."""
    kind = PlanKind.STAGED_SEND if staged else PlanKind.DIRECT
    plan_s = link.plan_costs(overlap_repack=overlapped).seconds(kind, nbytes, segments)
    wire = nbytes / link.bandwidth_bytes_per_s
    seg = segments * link.per_segment_s
    rep = plan_s - wire - seg if staged else 0.0
    return HandoffEstimate(nbytes, segments, link.setup_s, wire, seg, rep, link.setup_s + plan_s)


@dataclass
class Decision:
    """The verdict for one request and the numbers behind it."""

    move: bool
    verdict: str
    handoff: HandoffEstimate
    recompute_s: float
    queue_s: float
    prefill_s: float
    disaggregated_ttft_s: float
    local_ttft_s: float
    model: str
    link: str
    prompt_len: int
    output_len: int
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        d = asdict(self)
        d["handoff"] = asdict(self.handoff)
        return d


def decide(
    model: ModelGeometry,
    link: LinkProfile,
    prompt_len: int,
    *,
    output_len: int = 256,
    segments: int | None = None,
    staged: bool = True,
    prefill_tps: float | None = None,
    decode_prefill_tps: float | None = None,
    queue_s: float = 0.0,
    gpu_tflops: float = 989.0,
    mfu: float = 0.45,
    tp: int = 1,
    held_tokens: int = 0,
    plan: TransferPlan | None = None,
) -> Decision:
    """Move the KV (prefill worker computes, then hands off) or compute the prefill on the
    decode worker? ``prefill_tps`` / ``decode_prefill_tps``: prefill tokens/s on each
    worker (default: from FLOPs at ``gpu_tflops`` x ``mfu`` x ``tp``; the decode worker
    shares its GPU with running decodes, so by default it prefills at half that rate).
    ``queue_s``: time the request waits for the prefill worker. Segments and staging come
    from ``plan`` (the request's ``TransferPlan``: its own estimate), else from
    ``segments`` (counted elsewhere, e.g. a measured handoff; staging from ``staged``),
    else from the plan chooser's estimate over SGLang-style pools of the model
    (``request_estimate`` over ``model_layout``).
    ``held_tokens``: prompt tokens
    whose KV the decode worker already holds (prefix cache): only the rest is moved, or
    recomputed (attending to the held ones); the prefill worker computes the whole prompt."""
    if prompt_len <= 0:
        raise ValueError(f"prompt_len must be positive, got {prompt_len}")
    if not 0 <= held_tokens < prompt_len:
        raise ValueError(f"held_tokens must be in [0, prompt_len={prompt_len}), got {held_tokens}")
    nbytes = model.kv_bytes(prompt_len - held_tokens)
    if plan is not None:
        est = plan.estimates[plan.kind]
        segs, staged = est.segments, est.kind is not PlanKind.DIRECT
    elif segments is not None:
        segs = segments
    else:
        est = _model_estimate(model, link, held_tokens, prompt_len)
        segs, staged = est.segments, est.kind is not PlanKind.DIRECT
    flops_s = gpu_tflops * 1e12 * mfu * tp
    prefill_s = prompt_len / prefill_tps if prefill_tps else model.prefill_flops(prompt_len) / flops_s
    new_flops = model.prefill_flops(prompt_len) - model.prefill_flops(held_tokens)
    recompute_s = ((prompt_len - held_tokens) / decode_prefill_tps if decode_prefill_tps
                   else 2.0 * new_flops / flops_s)
    h = predict_handoff_s(nbytes, segs, link, staged=staged)
    disagg = queue_s + prefill_s + h.total_s
    local = recompute_s
    move = disagg < local
    why = (
        f"moving {nbytes / 2**30:.2f} GiB over {link.name} takes {h.total_s * 1e3:.1f} ms "
        f"(wire {h.wire_s * 1e3:.1f}, segments {h.segments_s * 1e3:.2f}, setup {h.setup_s * 1e3:.2f}, "
        f"repack not hidden {h.repack_s * 1e3:.1f}); with {queue_s * 1e3:.0f} ms queue and {prefill_s * 1e3:.0f} ms prefill "
        f"the first token comes after {disagg * 1e3:.0f} ms, against {local * 1e3:.0f} ms recomputing on the decode worker"
    )
    verdict = ("MOVE the KV: " if move else "RECOMPUTE locally: ") + why
    return Decision(move, verdict, h, recompute_s, queue_s, prefill_s, disagg, local, model.name, link.describe(),
                    prompt_len, output_len, {"bytes_per_token": model.kv_bytes(1), "segments": segs, "staged": staged,
                                                 "held_tokens": held_tokens})


def break_even_prompt_len(model: ModelGeometry, link: LinkProfile, *, lo: int = 16, hi: int = 1 << 18, **kw) -> int | None:
    """Smallest prompt length from which moving wins (bisection; None if it never does
    in ``[lo, hi]``, ``lo`` if it always does)."""
    if decide(model, link, lo, **kw).move:
        return lo
    if not decide(model, link, hi, **kw).move:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if decide(model, link, mid, **kw).move:
            hi = mid
        else:
            lo = mid
    return hi


# -- layer-wise sends: worth it for this request? ----------------------------------------------

@lru_cache(maxsize=256)
def layer_plan_segments(model: "ModelGeometry", link: LinkProfile, start: int, stop: int) -> tuple[np.ndarray, bool]:
    """Segments of each layer's plan (int64 ``[layers]``) for tokens ``[start, stop)`` sent
    layer by layer, and whether those plans stage: ``request_estimate`` between
    ``KVLayout.layer_range(l, l + 1)`` views of ``model_layout``. The layers of one such
    pool share every stride and size (only their base differs), so the first and the
    last layer's estimates are made and, when they agree, stand for every layer; else
    every layer is estimated."""
    lay = model_layout(model, stop)
    n = lay.num_layers

    def one(i: int) -> KindEstimate:
        v = lay.layer_range(i, i + 1)
        return request_estimate(v, v, (start, stop), link)

    first, last = one(0), one(n - 1)
    if first.segments == last.segments and first.kind == last.kind:
        return np.full(n, first.segments, dtype=np.int64), first.kind is not PlanKind.DIRECT
    ests = [first] + [one(i) for i in range(1, n - 1)] + [last]
    return (np.array([e.segments for e in ests], dtype=np.int64),
            any(e.kind is not PlanKind.DIRECT for e in ests))


@dataclass(frozen=True)
class LayerwiseEstimate:
    """Send a request's KV layer by layer while the prefill computes, or whole after it?

    ``ttft_whole_s`` = prefill + whole handoff; ``ttft_layerwise_s``: the pipeline in
    which layer ``l``'s send starts once the prefill has computed it (at ``(l + 1) x
    prefill / layers``) and the link is free, each layer paying its bytes, its plan's
    segments and one write batch (``LinkProfile.per_batch_s``); about
    ``setup + max(prefill, layer-wise transfer) + one layer's transfer``
    (``bound_layerwise_s``).
    ``layerwise``: the layer-wise TTFT is below the whole one by more than ``margin``
    (a fraction of the whole one). Times in seconds."""

    layerwise: bool
    reason: str
    prompt_len: int
    held_tokens: int
    layers: int
    bytes: int
    prefill_s: float
    transfer_whole_s: float  # the whole handoff after the prefill (setup, wire, segments, repack not hidden)
    transfer_layerwise_s: float  # the same bytes as per-layer sends, back to back (setup included)
    one_layer_s: float  # the last layer's send: what is left after the prefill ends, at best
    segments_whole: int
    segments_layerwise: int
    overhead_layerwise_s: float  # what layer-wise adds: its extra segments and one batch per layer
    ttft_whole_s: float
    ttft_layerwise_s: float
    bound_layerwise_s: float  # setup + max(prefill, transfer_layerwise - setup) + one_layer
    margin: float
    model: str
    link: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def decide_layerwise(
    model: ModelGeometry,
    link: LinkProfile,
    prompt_len: int,
    *,
    held_tokens: int = 0,
    prefill_s: float | None = None,
    prefill_tps: float | None = None,
    gpu_tflops: float = 989.0,
    mfu: float = 0.45,
    tp: int = 1,
    margin: float = 0.1,
) -> LayerwiseEstimate:
    """Layer-wise or whole sends for one request of ``prompt_len`` tokens, of which the
    first ``held_tokens`` are not moved (the decode holds them), on ``link``. The prefill
    time is ``prefill_s`` when given, else ``prompt_len / prefill_tps``, else from FLOPs
    (as ``decide``). Segments come from the plans either way would run:
    ``request_estimate`` over ``model_layout`` for the whole send, over its
    ``KVLayout.layer_range`` views per layer (``layer_plan_segments``)."""
    if prompt_len <= 0:
        raise ValueError(f"prompt_len must be positive, got {prompt_len}")
    if not 0 <= held_tokens < prompt_len:
        raise ValueError(f"held_tokens must be in [0, prompt_len={prompt_len}), got {held_tokens}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if prefill_s is None:
        prefill_s = (prompt_len / prefill_tps if prefill_tps
                     else model.prefill_flops(prompt_len) / (gpu_tflops * 1e12 * mfu * tp))
    if prefill_s < 0:
        raise ValueError(f"prefill_s must be >= 0, got {prefill_s}")
    moved = prompt_len - held_tokens
    nbytes = model.kv_bytes(moved)
    est_whole = _model_estimate(model, link, held_tokens, prompt_len)
    segs_whole = est_whole.segments
    whole = predict_handoff_s(nbytes, segs_whole, link, staged=est_whole.kind is not PlanKind.DIRECT)
    segs, staged = layer_plan_segments(model, link, held_tokens, prompt_len)
    n = model.layers
    layer_bytes = nbytes / n
    # each layer's send: its plan's estimate, with (staged) its whole repack, which has no
    # later layer's wire time to hide behind, and one write batch
    kind = PlanKind.STAGED_SEND if staged else PlanKind.DIRECT
    x = link.plan_costs(overlap_repack=False).seconds(kind, layer_bytes, segs) + link.per_batch_s
    ready = prefill_s * np.arange(1, n + 1) / n  # layer l computed at (l + 1) / n of the prefill
    tail = np.cumsum(x[::-1])[::-1]  # sends of layers l.. back to back
    ttft_lw = link.setup_s + float(np.max(ready + tail))
    transfer_lw = link.setup_s + float(tail[0])
    one = float(x[-1])
    ttft_whole = prefill_s + whole.total_s
    overhead = float(transfer_lw - whole.total_s)
    go = ttft_lw < ttft_whole * (1.0 - margin)
    why = (f"{moved} tokens ({nbytes / 2**20:.1f} MiB) over {link.name}: whole send after a {prefill_s * 1e3:.2f} ms "
           f"prefill, first token after {ttft_whole * 1e3:.2f} ms (transfer {whole.total_s * 1e3:.2f} ms, "
           f"{segs_whole} segments); layer by layer {ttft_lw * 1e3:.2f} ms ({n} sends of {one * 1e3:.3f} ms, "
           f"{int(segs.sum())} segments, +{overhead * 1e3:.2f} ms of per-layer cost)")
    verdict = ("LAYER-WISE: " if go else "WHOLE: ") + why + (
        f"; {'saves' if go else 'would save'} {(1 - ttft_lw / ttft_whole) * 100:.0f}%"
        f"{'' if go else f', not more than the {margin * 100:.0f}% margin'}")
    return LayerwiseEstimate(go, verdict, prompt_len, held_tokens, n, nbytes, prefill_s, whole.total_s, transfer_lw, one,
                             segs_whole, int(segs.sum()), overhead, ttft_whole, ttft_lw,
                             link.setup_s + max(prefill_s, float(tail[0])) + one, margin, model.name, link.describe())
