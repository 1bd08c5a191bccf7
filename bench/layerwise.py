"""``kvbridge bench layerwise``: first-token time with the KV sent layer by layer during the
prefill against sent whole after it.

One prefill server per mode (``layerwise`` off, on) and one decode server, TensorRT-LLM
stand-ins (``kvbridge.demo.trtllm``: one OS process per rank, the executor calling the
connector's ``save_kv_layer`` after each decoder layer, a real forward of a Llama built
from a config with seeded weights), Mooncake TCP on 127.0.0.1 between them. Each run: the
decode is told to pull the prompt from the prefill (``announce``), both get the request,
and the parent steps the servers (it plays each server's executor loop) until the
decode's first own token; then on to the last token. The first token time
(``ttft``) is from the requests' submission to the end of the decode step that produced
it; ``prefill`` is the prefill's step that ran the forward (whole mode), ``decode_step``
the decode's step that produced the first token, and ``transfer`` the rest of the whole
mode's first-token time (the send after the forward, its landing, the steps between);
on SGLang, where the prefill logs when its send after the forward ended, ``transfer`` is
that tail (whole mode) instead.

Modes run interleaved (whole, layer-wise, whole, ...) after ``warmup`` unmeasured pairs;
every run uses its own cache salt, so no device cache holds its prompt. Reported per
prompt length: medians with p10-p90 of ``ttft_whole_ms`` and ``ttft_layerwise_ms``, the
median of the runs' paired ``ttft_ratio``, the bound (``setup-free``: about
``max(prefill, transfer) + one layer's transfer + decode_step`` against
``prefill + transfer + decode_step``), and each run's outputs, bytes and layer pieces.

``engine="sglang"``: the same runs on SGLang's real servers (``kvbridge.bench.layerwise_sglang``:
two prefills, one decode, and an aggregated server that times the prefill alone).

``link_mbit``: the KV crosses a loopback shaped to that rate with Linux traffic control
(``kvbridge.bench.link``), ``"auto"`` picking per prompt length the rate that makes its
transfer take as long as its prefill. On a CPU host an unshaped loopback moves a prompt's
KV 5-300x faster than the forward computes it (the attention's FLOPs per KV byte grow
with the prompt), so the regime layer-wise sends are for (transfer ~ prefill, as over a
datacenter link beside a GPU's forward) is reached by slowing the link, not the model.
Each length reports the rate and the bytes the kernel's shaped class carried (at least
the KV bytes moved, or the bench warns).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["bench_layerwise", "layerwise_steps", "GEOMETRY"]

log = logging.getLogger(__name__)

# The model: MHA (every query head has its own KV head), a narrow residual stream and a
# wide head, the most KV bytes per unit of prefill compute a Llama has (the attention's
# FLOPs per KV byte grow with the prompt whatever the geometry: see docs/benchmarks.md).
GEOMETRY = dict(num_hidden_layers=8, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=2, head_dim=256)
TOKENS_PER_BLOCK = 64
VERSION = "main"


def token_bytes(geometry: dict) -> int:
    """KV bytes of one token in the stand-in's float32 pools (every layer, K and V)."""
    return geometry["num_hidden_layers"] * 2 * geometry["num_key_value_heads"] * geometry["head_dim"] * 4


def layerwise_steps(prompt_lens: tuple[int, ...], reps: int, warmup: int) -> int:
    """Progress steps ``bench_layerwise`` reports: one per run."""
    return len(prompt_lens) * 2 * (reps + warmup)


def _pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(xs), q)), 2)


def _spread(xs: list[float]) -> dict:
    return {"median": _pct(xs, 50), "p10": _pct(xs, 10), "p90": _pct(xs, 90), "n": len(xs)}


@dataclass
class _Run:
    mode: str
    prompt_len: int
    ttft_ms: float
    prefill_ms: float
    decode_step_ms: float
    output: list[int]
    bytes: int
    layer_pieces: int
    ended_by: str
    tail_ms: float | None = None  # the prefill's room success after its forward's last chunk (SGLang's timeline)
    prefill_alone_ms: float | None = None  # the prompt's prefill on an aggregated server, nothing else running


class _TrtPair:
    """Two TensorRT-LLM stand-in prefill servers (``layerwise`` off, on) and one decode."""

    engine = "trtllm stand-in (main), TP 1 -> TP 1, Mooncake TCP 127.0.0.1"

    def __init__(self, model_dir: str, num_blocks: int, max_len: int):
        from kvbridge.demo.trtllm.server import StandInServer

        plugin = dict(host="127.0.0.1", deadline_s=120.0, heartbeat_s=0.5, peer_timeout_s=30.0, chunk_bytes=16 << 20)
        kw = dict(tp=1, tokens_per_block=TOKENS_PER_BLOCK, num_blocks=num_blocks, disable_overlap_scheduler=True,
                  max_num_tokens=max_len)
        self.servers: list = []
        try:
            self.prefill = {}
            for mode, lw in (("whole", False), ("layerwise", True)):
                s = StandInServer(VERSION, model_dir, plugin={**plugin, "layerwise": lw}, **kw)
                self.servers.append(s)
                self.prefill[mode] = s
            self.decode = StandInServer(VERSION, model_dir, plugin=plugin, **kw)
            self.servers.append(self.decode)
        except BaseException:
            self.close()
            raise
        self._room = 1000

    def run(self, mode: str, prompt: list[int], max_new: int, salt: str, timeout_s: float = 600.0) -> _Run:
        from kvbridge.adapters.trtllm import Handle, announce

        pre, dec = self.prefill[mode], self.decode
        self._room += 1
        announce(pre.bus, prompt, Handle("send", self._room))
        announce(dec.bus, prompt, Handle("recv", self._room, prefill=pre.bus))
        t0 = time.perf_counter()
        a = pre.submit(prompt, 1, cache_salt=salt)
        d = dec.submit(prompt, max_new, cache_salt=salt)
        end = t0 + timeout_s
        ttft = None
        prefill_steps: list[float] = []
        dstep = 0.0
        # the decode steps first: its first step asks the prefill for the room before the
        # prefill's forward starts, as a decode engine running beside it would (stepping the
        # prefill first would hold the request back until the forward ended, and every
        # layer-wise piece with it)
        while ttft is None or d not in dec.responses or not (pre.drained() and dec.drained()):
            if time.perf_counter() > end:
                raise TimeoutError(f"{mode} run of {len(prompt)} tokens not done after {timeout_s:.0f} s")
            s0 = time.perf_counter()
            dec.step()
            s1 = time.perf_counter()
            if ttft is None and (dec.last[0]["generated"].get(d, 0) >= 1 or d in dec.responses):
                ttft, dstep = s1 - t0, s1 - s0
            pre.step()
            prefill_steps.append(time.perf_counter() - s1)
        out = dec.responses[d]["output_token_ids"]
        load = dec.state()["finished_loads"].get(d, {})
        save = pre.state()["finished_saves"].get(a, {})
        if load.get("verdict") != "ok":
            raise RuntimeError(f"{mode} run of {len(prompt)} tokens: the decode's load ended {load}")
        return _Run(mode, len(prompt), ttft * 1e3, max(prefill_steps) * 1e3, dstep * 1e3, list(out),
                    int(load["record"]["bytes"]), int(save.get("layer_pieces", 0)), str(save.get("ended_by", "")))

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers = []


def bench_layerwise(
    prompt_lens: tuple[int, ...] = (1024, 4096),
    *,
    reps: int = 3,
    warmup: int = 1,
    max_new: int = 4,
    geometry: dict | None = None,
    engine: str = "trtllm",
    model_dir: str | None = None,
    seed: int = 0,
    link_mbit: float | str | None = None,
    progress: Callable[[str], Any] | None = None,
) -> dict:
    """Whole against layer-wise first-token times (see the module doc). ``geometry``:
    ``LlamaConfig`` fields over ``GEOMETRY``; ``model_dir``: where the model is written
    (default: a temporary folder, removed). Prompt ``i`` is ``random_prompt(n, seed=seed +
    i)``. ``link_mbit``: the KV crosses a loopback shaped to that many Mbit/s
    (``kvbridge.bench.link.ShapedLoopback``; needs root), or ``"auto"``: per prompt length,
    the rate at which its KV takes as long to move as the first warm-up's whole-mode prefill
    took to compute it (the regime layer-wise sends are for, which an unshaped loopback never reaches on a
    CPU host)."""
    if engine not in ("trtllm", "sglang"):
        raise ValueError(f"bench layerwise: engine {engine!r}: engines are trtllm (the stand-in) and sglang (real servers)")
    auto_link = link_mbit == "auto"
    if link_mbit is not None and not auto_link and not (isinstance(link_mbit, (int, float)) and link_mbit > 0):
        raise ValueError(f"bench layerwise: link rate {link_mbit!r}: a positive Mbit/s figure or 'auto'")
    if auto_link and warmup < 1:
        raise ValueError("bench layerwise: --link-rate auto sets each length's rate from its first warm-up: warmup >= 1")
    if reps < 1 or warmup < 0 or max_new < 1 or not prompt_lens or min(prompt_lens) < 2:
        raise ValueError(f"bench layerwise: reps >= 1, warmup >= 0, max_new >= 1 and prompt lengths >= 2 needed "
                         f"(got reps={reps}, warmup={warmup}, max_new={max_new}, prompt_lens={prompt_lens})")
    from kvbridge.demo.models import build_tiny_llama, random_prompt, reference_generate

    say = progress or (lambda _m: None)
    geo = {**GEOMETRY, **(geometry or {})}
    if geo["hidden_size"] % geo["num_attention_heads"] or geo["num_attention_heads"] % geo["num_key_value_heads"]:
        raise ValueError(f"bench layerwise: hidden size {geo['hidden_size']} must be a multiple of the "
                         f"{geo['num_attention_heads']} attention heads, themselves a multiple of the "
                         f"{geo['num_key_value_heads']} KV heads (transformers' Llama refuses it otherwise)")
    max_len = max(prompt_lens) + max_new
    tmp = None
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvbridge-bench-layerwise-")
        model_dir = tmp.name
    os.makedirs(model_dir, exist_ok=True)
    try:
        say("building the model")
        build_tiny_llama(model_dir, max_position_embeddings=max(2048, max_len + 64), **geo)
        prompts = {n: random_prompt(n, seed=seed + i) for i, n in enumerate(prompt_lens)}
        say("reference outputs (transformers' generate)")
        ref = {n: reference_generate(model_dir, p, max_new).token_ids for n, p in prompts.items()}
        num_blocks = -(-max_len // TOKENS_PER_BLOCK) + 4
        say("starting the servers")
        if engine == "sglang":
            from kvbridge.bench.layerwise_sglang import SglangPair

            pair = SglangPair(model_dir, max_len, token_bytes(geo), page_size=TOKENS_PER_BLOCK)
        else:
            pair = _TrtPair(model_dir, num_blocks, max_len)
        engine_line = pair.engine
        link: dict[int, dict] = {}
        try:
            runs: dict[int, list[_Run]] = {n: [] for n in prompt_lens}
            with _link(link_mbit) as shaper:
                k = 0
                for n in prompt_lens:
                    before = 0
                    for rep in range(warmup + reps):
                        for mode in ("whole", "layerwise"):  # interleaved: A B A B
                            k += 1
                            say(f"{n} tokens, {'warm-up' if rep < warmup else f'rep {rep - warmup + 1}/{reps}'}, {mode}")
                            r = pair.run(mode, prompts[n], max_new, salt=f"lw-{seed}-{k}")
                            if rep >= warmup:
                                runs[n].append(r)
                            elif shaper is not None and auto_link and rep == 0 and mode == "whole":
                                # the rate at which this prompt's KV moves in the time its forward took
                                shaper.set_rate(max(1.0, r.bytes * 8 / (r.prefill_ms / 1e3) / 1e6))
                            if shaper is not None and rep == warmup - 1 and mode == "layerwise":
                                before = shaper.shaped_bytes()
                    if shaper is not None:
                        link[n] = {"rate_mbit": round(shaper.rate_mbit, 1),
                                   "shaped_bytes": shaper.shaped_bytes() - before,
                                   "kv_bytes": sum(r.bytes for r in runs[n])}
        finally:
            pair.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    return _report(runs, ref, geo, prompt_lens, reps, warmup, max_new, seed, engine_line, link)


def _link(link_mbit: float | str | None):
    """The shaped loopback for ``link_mbit`` (``auto``: unshaped-fast until set), or a
    context holding None."""
    import contextlib

    if link_mbit is None:
        return contextlib.nullcontext()
    from kvbridge.bench.link import ShapedLoopback

    return ShapedLoopback(100_000.0 if link_mbit == "auto" else float(link_mbit))


def _predicted(geo: dict, n: int, prefill_ms: float, rate_mbit: float | None = None) -> dict:
    """What the cost model (``decide_layerwise``, the ``tcp`` preset, its bandwidth the
    shaped rate where the link is shaped) says for this prompt given the measured prefill
    time."""
    import dataclasses

    from kvbridge.common.costmodel import LINK_PRESETS, ModelGeometry, decide_layerwise
    from kvbridge.demo.models import LLAMA_DEFAULTS

    g = ModelGeometry.from_hf_dict({**LLAMA_DEFAULTS, **geo}, dtype_bytes=4, name="bench")
    link = LINK_PRESETS["tcp"]
    if rate_mbit:
        link = dataclasses.replace(link, name=f"tcp shaped to {rate_mbit:g} Mbit/s", bandwidth_bytes_per_s=rate_mbit * 1e6 / 8)
    e = decide_layerwise(g, link, n, prefill_s=prefill_ms / 1e3)
    return {"layerwise": e.layerwise, "ttft_whole_ms": round(e.ttft_whole_s * 1e3, 2),
            "ttft_layerwise_ms": round(e.ttft_layerwise_s * 1e3, 2), "transfer_ms": round(e.transfer_whole_s * 1e3, 2)}


def _tails(whole: list, lw: list) -> dict:
    """Where the engine reports it: the send after the forward in each mode (medians), and
    the prefill alone on an idle host."""
    out: dict[str, Any] = {}
    if all(r.tail_ms is not None for r in whole + lw):
        out["tail_after_forward_ms"] = {"whole": _spread([r.tail_ms for r in whole]),
                                        "layerwise": _spread([r.tail_ms for r in lw])}
    alone = [r.prefill_alone_ms for r in whole if r.prefill_alone_ms is not None]
    if alone:
        out["prefill_alone_ms"] = _spread(alone)
    return out


def _report(runs: dict, ref: dict, geo: dict, prompt_lens, reps: int, warmup: int, max_new: int, seed: int,
            engine: str, link: dict | None = None) -> dict:
    layers = geo["num_hidden_layers"]
    out: dict[str, Any] = {
        "engine": engine,
        "geometry": {**geo, "token_bytes": token_bytes(geo), "tokens_per_block": TOKENS_PER_BLOCK, "dtype": "float32"},
        "reps": reps, "warmup": warmup, "max_new": max_new, "seed": seed, "order": "interleaved: whole, layer-wise, ...",
        "lengths": [], "warnings": [],
        "link": ("loopback shaped with tc (HTB) on TCP to Mooncake's ports 15000-17000: see each length's link_rate_mbit"
                 if link else "loopback, unshaped"),
    }
    for n in prompt_lens:
        shaped = (link or {}).get(n)  # this length's shaped link, if any
        whole = [r for r in runs[n] if r.mode == "whole"]
        lw = [r for r in runs[n] if r.mode == "layerwise"]
        tw, tl = [r.ttft_ms for r in whole], [r.ttft_ms for r in lw]
        ratios = [b / a for a, b in zip(tw, tl)]
        prefill = float(np.median([r.prefill_ms for r in whole]))
        dstep = float(np.median([r.decode_step_ms for r in whole]))
        if all(r.tail_ms is not None for r in whole):  # the engine says when its send after the forward ended
            transfer = float(np.median([r.tail_ms for r in whole]))
        else:
            transfer = max(0.0, float(np.median(tw)) - prefill - dstep)
        bound_whole = prefill + transfer + dstep
        bound_lw = max(prefill, transfer) + transfer / layers + dstep
        row = {
            "prompt_len": n,
            "bytes": n * token_bytes(geo),
            "ttft_whole_ms": _spread(tw),
            "ttft_layerwise_ms": _spread(tl),
            "ttft_ratio": _spread(ratios),
            "prefill_ms": round(prefill, 2),
            "prefill_layerwise_ms": round(float(np.median([r.prefill_ms for r in lw])), 2),
            "transfer_ms": round(transfer, 2),
            "decode_step_ms": round(dstep, 2),
            "transfer_over_prefill": round(transfer / prefill, 3) if prefill else None,
            "bound_whole_ms": round(bound_whole, 2),
            "bound_layerwise_ms": round(bound_lw, 2),
            "bound_ratio": round(bound_lw / bound_whole, 3) if bound_whole else None,
            "layerwise_over_bound": round(float(np.median(tl)) / bound_lw, 3) if bound_lw else None,
            "reference": ref[n],
            "outputs": {"whole": [r.output for r in whole], "layerwise": [r.output for r in lw]},
            "bytes_moved": {"whole": [r.bytes for r in whole], "layerwise": [r.bytes for r in lw]},
            "layer_pieces": {"whole": [r.layer_pieces for r in whole], "layerwise": [r.layer_pieces for r in lw]},
            "ended_by": {"whole": [r.ended_by for r in whole], "layerwise": [r.ended_by for r in lw]},
            "outputs_equal": all(r.output == ref[n] for r in whole + lw),
            "cost_model": _predicted(geo, n, prefill, shaped["rate_mbit"] if shaped else None),
            **({"link_rate_mbit": shaped["rate_mbit"], "shaped_bytes": shaped["shaped_bytes"],
                "kv_bytes_moved": shaped["kv_bytes"]} if shaped else {}),
            **_tails(whole, lw),  # its verdict on the tcp preset, given the measured prefill
        }
        spread = max(row["ttft_ratio"]["p90"] - row["ttft_ratio"]["p10"], 0.0)
        effect = abs(1.0 - row["ttft_ratio"]["median"])
        if spread > effect:
            out["warnings"].append(f"{n} tokens: the ratio's p10-p90 spread ({spread:.3f}) is wider than its effect "
                                   f"({effect:.3f}): no difference measured")
        if prefill and not 0.5 <= transfer / prefill <= 2.0:
            out["warnings"].append(f"{n} tokens: transfer {transfer:.1f} ms against prefill {prefill:.1f} ms: not "
                                   "balanced, layer-wise can hide at most the shorter of the two")
        if shaped and shaped["shaped_bytes"] < shaped["kv_bytes"]:
            out["warnings"].append(f"{n} tokens: {shaped['shaped_bytes']} bytes crossed the shaped link, fewer than "
                                   f"the {shaped['kv_bytes']} KV bytes moved: the KV did not take the shaped path")
        if not row["outputs_equal"]:
            out["warnings"].append(f"{n} tokens: outputs differ from transformers' generate()")
        out["lengths"].append(row)
    for w in out["warnings"]:
        log.warning("bench layerwise: %s", w)
    return out
