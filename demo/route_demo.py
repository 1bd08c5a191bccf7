"""``kvbridge demo --router``: a mixed deployment behind ``kvbridge route``, driven by a
real OpenAI client, every answer checked against transformers.

Servers (all on this machine, CPU): SGLang's real server as a prefill and as a decode on
the kvbridge backend, and the TensorRT-LLM stand-in behind trtllm-serve's HTTP shape as
a second decode; ``kvbridge route --config route.yaml`` in its own process in front.
The ``openai`` package sends completions (streamed and not) and a chat completion:
long prompts are disaggregated (SGLang -> SGLang, SGLang -> TensorRT-LLM, whichever
decode is least busy), a short one is below the cost model's break-even and computed
by the TensorRT-LLM decode alone. ``match`` is true when every answer's token ids equal
transformers' greedy ``generate()`` on the same weights.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Callable

__all__ = ["run_router_demo", "format_router_demo"]


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(url + "/metrics", timeout=10).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("kvbridge_route_requests_total", "kvbridge_route_recomputed_total"):
                out.setdefault(s.name, {})[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def run_router_demo(*, model_dir: str | None = None, prompt_len: int = 70, max_new: int = 32,
                    trtllm_version: str = "1.2", short_len: int = 8, seed: int = 600, log_dir: str | None = None,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Start the deployment, send the requests, check them; the report (JSON-ready)."""
    from openai import OpenAI

    from .models import random_prompt, reference_generate
    from .route_local import LocalDeployment
    from .run import _model_info, ensure_tiny_model

    say = progress or (lambda m: None)
    t_all = time.monotonic()
    say("building the tiny model")
    md = Path(model_dir) if model_dir else ensure_tiny_model("llama")[0]
    info = _model_info(md)
    lens = [prompt_len, prompt_len + 3, prompt_len + 6, prompt_len + 9, short_len]
    prompts = [random_prompt(n, seed=seed + n, vocab_size=info["vocab"]) for n in lens]
    say("transformers reference")
    refs = [reference_generate(md, p, max_new).token_ids for p in prompts]
    say("starting SGLang prefill and decode, TensorRT-LLM decode stand-in")
    with LocalDeployment(md, prefills=1, decode=True, aggregated=False, trtllm=True, trtllm_version=trtllm_version,
                         log_dir=log_dir) as dep:
        say("starting kvbridge route")
        router = dep.start_router()
        client = OpenAI(base_url=router.url + "/v1", api_key="kvbridge", max_retries=0, timeout=120)
        results = []
        kinds = ["completion", "completion-stream", "completion", "chat-stream", "completion"]
        for prompt, ref, kind in zip(prompts, refs, kinds):
            say(f"{kind}: {len(prompt)} prompt tokens")
            t0 = time.monotonic()
            got, extra, first_at = _ask(client, kind, prompt, max_new)
            results.append({"kind": kind, "prompt_len": len(prompt), "generated_ids": got, "reference_ids": ref,
                            "match": got == ref, "route": extra.get("route"), "mode": extra.get("mode"),
                            "servers": extra.get("servers"), "why": extra.get("why"), "verdict": extra.get("verdict"),
                            "client_ttft_ms": round((first_at - t0) * 1e3, 2),
                            "seconds": round(time.monotonic() - t0, 3)})
        metrics = _metrics(router.url)
        cfg_text = dep.write_config().read_text()
        servers = {n: s.url for n, (s, _) in dep.sglang.items()} | {n: t.url for n, t in dep.trt.items()}
        started = dep.started_s
    routes = sorted({(r["route"], r["mode"]) for r in results})
    return {"match": all(r["match"] for r in results), "requests": results,
            "routes": [f"{r} ({m})" for r, m in routes], "metrics": metrics, "model": info,
            "trtllm_version": trtllm_version, "servers": servers, "servers_started_s": round(started, 1),
            "route_yaml": cfg_text, "client": "openai " + __import__("openai").__version__,
            "seconds": round(time.monotonic() - t_all, 1)}


def _ask(client, kind: str, prompt: list[int], max_new: int) -> tuple[list[int], dict, float]:
    """One request through the OpenAI client: (token ids, the kvbridge info, time of the first token)."""
    common = dict(model="tiny-llama", max_tokens=max_new, temperature=0, extra_body={"ignore_eos": True})
    if kind.startswith("chat"):
        text = " ".join(f"w{t}" for t in prompt)  # the tiny tokenizer's words; the demo's chat template adds " "
        args = dict(messages=[{"role": "user", "content": text}], **common)
        create = client.chat.completions.create
    else:
        args = dict(prompt=prompt, **common)
        create = client.completions.create
    if not kind.endswith("stream"):
        r = create(**args)
        return list(r.choices[0].model_extra["token_ids"]), r.model_extra.get("kvbridge") or {}, time.monotonic()
    ids, info, first = [], {}, None
    for ch in create(stream=True, **args):
        info = info or ch.model_extra.get("kvbridge") or {}
        if ch.choices:
            new = ch.choices[0].model_extra.get("token_ids") or []
            if new and first is None:
                first = time.monotonic()
            ids += new
    return ids, info, first or time.monotonic()


def format_router_demo(r: dict) -> str:
    """The demo's report for a human."""
    lines = [f"kvbridge demo --router: {'MATCH' if r['match'] else 'MISMATCH'} "
             f"({len(r['requests'])} requests through kvbridge route, {r['client']} client)"]
    for q in r["requests"]:
        lines.append(f"  {q['kind']:<18} {q['prompt_len']:>4} tokens  {q['route']:<15} {q['mode']:<13} "
                     f"{','.join(q['servers'] or [])}  first token {q['client_ttft_ms']:.0f} ms  "
                     f"{'match' if q['match'] else 'MISMATCH'}")
    lines.append("  routes: " + "; ".join(r["routes"]))
    lines.append(f"  servers up in {r['servers_started_s']} s; demo {r['seconds']} s")
    return "\n".join(lines)
