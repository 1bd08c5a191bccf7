"""``kvbridge bench route``: a load through ``kvbridge route`` with a prefill killed part-way.

The deployment of ``kvbridge.demo.route_local`` (two SGLang prefills, an SGLang decode,
an SGLang aggregated server and, unless ``trtllm=False``, a TensorRT-LLM decode stand-in), the
router in its own process, and ``requests`` requests from the ``openai`` package's
async client, ``concurrency`` at a time, half of them streamed, prompts of 8 to 128
tokens (the short ones below the cost model's break-even). After ``kill_after`` of the
requests were sent, prefill p0 is killed (SIGKILL).

Each request ends as one of: ``ok`` (its token ids equal transformers' greedy
``generate()``, computed beforehand), ``wrong`` (an answer that differs), ``failed``
(an HTTP error or an error event with a message: counted by reason), ``lost`` (no
answer before its deadline plus 10 s, or a stream that ended without a finish reason or
an error). TTFT is reported as the router measured it (``X-KVBridge-TTFT-Ms``, arrival to
first token out) and as the client saw it (first streamed token; whole answer when not
streamed), with p50/p99 over the requests that succeeded.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["bench_route", "format_bench"]


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 2) if xs else None


async def _parsed(raw):
    """A raw response's parsed body (``parse()`` is a coroutine for plain answers in the
    async client, and hands streams back as they are)."""
    import inspect

    obj = raw.parse()
    return await obj if inspect.isawaitable(obj) else obj


async def _one(client, i: int, prompt: list[int], ref: list[int], max_new: int, stream: bool, deadline_s: float) -> dict:
    from openai import APIError

    t0 = time.monotonic()
    out = {"i": i, "prompt_len": len(prompt), "stream": stream, "sent_at": t0}
    args = dict(model="tiny-llama", prompt=prompt, max_tokens=max_new, temperature=0, extra_body={"ignore_eos": True})
    try:
        async with asyncio.timeout(deadline_s + 10.0):
            if stream:
                raw = await client.completions.with_raw_response.create(stream=True, **args)
                ids, finish, info, first = [], None, {}, None
                async for ch in await _parsed(raw):
                    extra = ch.model_extra or {}
                    if "error" in extra:
                        out.update(outcome="failed", reason=str(extra["error"].get("reason")),
                                   message=str(extra["error"].get("message"))[:300], ids=ids)
                        return out
                    info = info or extra.get("kvbridge") or {}
                    if ch.choices:
                        new = (ch.choices[0].model_extra or {}).get("token_ids") or []
                        if new and first is None:
                            first = time.monotonic()
                        ids += new
                        finish = ch.choices[0].finish_reason or finish
                if finish is None:
                    out.update(outcome="lost", message="stream ended without a finish reason or an error", ids=ids)
                    return out
                client_ttft = (first or time.monotonic()) - t0
            else:
                raw = await client.completions.with_raw_response.create(**args)
                r = await _parsed(raw)
                ids, info = list(r.choices[0].model_extra["token_ids"]), r.model_extra.get("kvbridge") or {}
                client_ttft = time.monotonic() - t0
            hdr = raw.headers.get("X-KVBridge-TTFT-Ms")
            out.update(outcome="ok" if ids == ref else "wrong", ids=ids, route=info.get("route"), mode=info.get("mode"),
                       servers=info.get("servers"), retries=info.get("retries") or [],
                       router_ttft_ms=float(hdr) if hdr else None, client_ttft_ms=client_ttft * 1e3)
    except APIError as e:
        body = getattr(e, "body", None) or {}
        reason = body.get("reason") if isinstance(body, dict) else None
        out.update(outcome="failed", reason=str(reason or getattr(e, "status_code", "") or type(e).__name__),
                   message=str(e)[:300])
    except TimeoutError:
        out.update(outcome="lost", message=f"no answer within {deadline_s + 10:.0f} s")
    out["seconds"] = time.monotonic() - t0
    return out


async def _load(url: str, prompts, refs, max_new: int, concurrency: int, kill_after: float, kill: Callable[[], None],
                deadline_s: float, progress) -> tuple[list[dict], float | None]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="kvbridge", max_retries=0, timeout=deadline_s + 30)
    sem = asyncio.Semaphore(concurrency)
    n = len(prompts)
    kill_at = int(n * kill_after) if kill_after is not None and 0 <= kill_after < 1 else None
    killed_at: list[float] = []
    done = [0]

    async def run(i: int) -> dict:
        async with sem:
            if i == kill_at:
                await asyncio.to_thread(kill)
                killed_at.append(time.monotonic())
            r = await _one(client, i, prompts[i], refs[i], max_new, i % 2 == 1, deadline_s)
            done[0] += 1
            if done[0] % 20 == 0:
                progress(f"{done[0]}/{n} answered")
            return r

    try:
        results = await asyncio.gather(*(run(i) for i in range(n)))
    finally:
        await client.close()
    return list(results), (killed_at[0] if killed_at else None)


def bench_route(*, requests: int = 200, concurrency: int = 16, kill_after: float = 0.3, max_new: int = 16, seed: int = 0,
                trtllm: bool = True, model_dir: str | None = None, log_dir: str | None = None,
                progress: Callable[[str], None] | None = None, deployment=None) -> dict:
    """Run the load (see the module doc); the report (JSON-ready). ``deployment``: a
    running ``LocalDeployment`` with its router to use instead of starting one (its p0
    is killed all the same)."""
    import contextlib

    from kvbridge.demo.models import random_prompt, reference_generate
    from kvbridge.demo.route_local import LocalDeployment
    from kvbridge.demo.run import ensure_tiny_model

    say = progress or (lambda m: None)
    say("building the tiny model")
    md = Path(model_dir) if model_dir else (deployment.model_dir if deployment else ensure_tiny_model("llama")[0])
    rng = random.Random(seed)
    lens = [rng.choice([6, 10, 14]) if rng.random() < 0.2 else rng.randint(40, 128) for _ in range(requests)]
    prompts = [random_prompt(n, seed=seed * 100003 + i) for i, n in enumerate(lens)]
    say(f"transformers reference for {requests} prompts")
    refs = [reference_generate(md, p, max_new).token_ids for p in prompts]
    deadline_s = 60.0
    say("starting the deployment")
    t_start = time.monotonic()
    owned = deployment is None
    with (LocalDeployment(md, prefills=2, decode=True, aggregated=True, trtllm=trtllm, log_dir=log_dir,
                          route={"deadlines": {"request_s": deadline_s, "prefill_s": 15.0}})
          if owned else contextlib.nullcontext(deployment)) as dep:
        started_s = time.monotonic() - t_start
        router = dep.start_router() if owned else dep.router
        say(f"{requests} requests, {concurrency} at a time; p0 killed after {kill_after:.0%}")
        t0 = time.monotonic()
        results, killed_at = asyncio.run(_load(router.url, prompts, refs, max_new, concurrency, kill_after,
                                               lambda: dep.kill("p0"), deadline_s, say))
        wall = time.monotonic() - t0
        from kvbridge.demo.route_demo import _metrics

        metrics = _metrics(router.url)
        retries = _retries(router.url)
    outcomes = Counter(r["outcome"] for r in results)
    ok = [r for r in results if r["outcome"] == "ok"]
    inflight_at_kill = [r for r in results if killed_at is not None and r["sent_at"] <= killed_at
                        and r["sent_at"] + r.get("seconds", 0) >= killed_at]
    after_kill = [r for r in ok if killed_at is not None and r["sent_at"] > killed_at + 2.0]
    return {
        "requests": requests, "concurrency": concurrency, "max_new": max_new,
        "ok": outcomes["ok"], "wrong": outcomes["wrong"], "failed": outcomes["failed"], "lost": outcomes["lost"],
        "failure_reasons": dict(Counter(r.get("reason") for r in results if r["outcome"] == "failed")),
        "failure_examples": [r.get("message") for r in results if r["outcome"] in ("failed", "lost")][:5],
        "ttft_router_p50_ms": _pct([r["router_ttft_ms"] for r in ok if r.get("router_ttft_ms") is not None], 50),
        "ttft_router_p99_ms": _pct([r["router_ttft_ms"] for r in ok if r.get("router_ttft_ms") is not None], 99),
        "ttft_client_stream_p50_ms": _pct([r["client_ttft_ms"] for r in ok if r["stream"]], 50),
        "ttft_client_stream_p99_ms": _pct([r["client_ttft_ms"] for r in ok if r["stream"]], 99),
        "latency_p50_ms": _pct([r["seconds"] * 1e3 for r in ok], 50),
        "latency_p99_ms": _pct([r["seconds"] * 1e3 for r in ok], 99),
        # per route: the TensorRT-LLM stand-in reports a request's tokens when it finishes, so its
        # "first token" is its last; SGLang's decode streams them as it makes them
        "ttft_router_by_route_ms": {
            k: {"n": len(v), "p50": _pct(v, 50), "p99": _pct(v, 99)} for k, v in sorted(_by_route(ok).items())},
        "throughput_rps": round(len(results) / wall, 2), "wall_s": round(wall, 1),
        "routes": dict(Counter(f"{r['route']} ({r['mode']})" for r in ok)),
        "killed": "p0" if killed_at is not None else None,
        "inflight_at_kill": len(inflight_at_kill),
        "inflight_at_kill_outcomes": dict(Counter(r["outcome"] for r in inflight_at_kill)),
        "retried_requests": sum(1 for r in ok if r.get("retries")),
        "ok_after_kill_on_p0": sum(1 for r in after_kill if "p0" in (r.get("servers") or [])),
        "ok_after_kill": len(after_kill),
        "router_retries": retries, "router_metrics": metrics,
        "servers_started_s": round(started_s, 1) if owned else None, "trtllm": bool(dep.trt),
    }


def _by_route(ok: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in ok:
        if r.get("router_ttft_ms") is not None:
            out.setdefault(f"{r['route']} ({r['mode']})", []).append(r["router_ttft_ms"])
    return out


def _retries(url: str) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("kvbridge_route_retries_total", "kvbridge_route_failures_total", "kvbridge_route_room_aborts_total"):
                out[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"] = s.value
    return out


def format_bench(r: dict) -> str:
    keys = ["requests", "concurrency", "ok", "wrong", "failed", "lost", "failure_reasons", "ttft_router_p50_ms",
            "ttft_router_p99_ms", "ttft_router_by_route_ms", "ttft_client_stream_p50_ms", "ttft_client_stream_p99_ms", "latency_p50_ms",
            "latency_p99_ms", "throughput_rps", "routes", "killed", "inflight_at_kill", "inflight_at_kill_outcomes",
            "retried_requests", "ok_after_kill", "ok_after_kill_on_p0", "router_retries"]
    return "\n".join(f"{k:>28}: {r[k]}" for k in keys)
