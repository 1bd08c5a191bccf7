"""``kvbridge route --check``: validate the configuration and probe every server.

Per server, what can be told from outside, and how:

| check | SGLang | TensorRT-LLM (trtllm-serve + kvbridge connector) | vLLM (OpenAI server + kvbridge connector) |
|---|---|---|---|
| reachable | ``GET /health`` 200 | ``GET /health`` 200 | ``GET /health`` 200 |
| engine, version | ``GET /server_info`` (``version``, server args) | ``GET /version``, and ``/v1/models`` not ``owned_by: vllm`` (vLLM answers ``/version`` too) | ``GET /version``; ``GET /v1/models`` lists the model name the router sends (``owned_by: vllm``) |
| role | ``disaggregation_mode`` (prefill / decode / null = aggregated) | not published: the role is what each request's announcement makes it | a decode: vLLM's ``/metrics`` has ``vllm:num_requests_kv_fetch_by_stage`` only with a KV connector whose ``kv_role`` consumes (``kv_consumer``/``kv_both``); a prefill: its bootstrap server |
| kvbridge backend on | ``disaggregation_transfer_backend == "kvbridge"``; a prefill's bootstrap serves ``/kvbridge/ranks`` | the bus answers ``Who`` with its ranks' endpoints (the connector is loaded); ``bootstrap``: ``/kvbridge/ranks`` | a prefill's bootstrap serves ``/kvbridge/ranks`` (only the kvbridge connector runs one); a decode's connector name is not published (vLLM shows its config only in dev mode's ``/server_info``) |
| layout | a prefill's ranks publish their KV layout: layers, KV heads, head_dim, kv_factor against the model's ``config.json``, and dtype against every other prefill; SGLang pairs: equal ``page_size`` (SGLang refuses others) | a prefill with ``bootstrap`` publishes it likewise | a prefill publishes it likewise |

Capabilities: per server, what it cannot do (``cannot``: sampling, seeded sampling, stop
strings, stopping at EOS) and its context length, from the configuration narrowed by what
it publishes (``kvbridge.route.capabilities``), the limits the router pairs requests by.

An SGLang decode and a vLLM or TensorRT-LLM prefill: the page size the prefill's
bootstrap server reports (``sglang_page_size``) must be the decode's (SGLang refuses
others). Not checkable from outside: a decode's KV layout (no engine publishes it; the
prefill side checks it at every handshake and refuses a mismatch with each difference
named), tensor-parallel head splits beyond what the ranks list shows, and whether both
sides were started with the same weights (only the model path is shown).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp

from . import capabilities as C
from .ranks import bus_endpoints, route_keyring
from .config import RouteConfig, ServerSpec, pairable

__all__ = ["check", "format_report"]


def _model_expectation(cfg: RouteConfig) -> dict | None:
    p = Path(cfg.cost.model or cfg.model.tokenizer)
    p = p / "config.json" if p.is_dir() else p
    try:
        c = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if c.get("kv_lora_rank"):
        return {"num_layers": c["num_hidden_layers"], "kv_factor": 1, "total_heads": 1,
                "head_dim": int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"]), "source": str(p)}
    heads = int(c["num_attention_heads"])
    return {"num_layers": int(c["num_hidden_layers"]), "kv_factor": 2,
            "total_heads": int(c.get("num_key_value_heads") or heads),
            "head_dim": int(c.get("head_dim") or int(c["hidden_size"]) // heads), "source": str(p)}


async def _get(http: aiohttp.ClientSession, url: str, timeout: float) -> tuple[int, object]:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text[:300]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return 0, f"{type(e).__name__}: {e}"


async def _text(http: aiohttp.ClientSession, url: str, timeout: float) -> tuple[int, str]:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return 0, f"{type(e).__name__}: {e}"


KV_CONSUMER_METRIC = "vllm:num_requests_kv_fetch_by_stage"  # vllm/v1/metrics/loggers.py: only when kv_role consumes


async def _probe_vllm(http: aiohttp.ClientSession, s: ServerSpec, url: str, model: str, timeout: float,
                      note) -> str | None:
    """A vLLM server's checks (``note``-d); what could not be checked, or None."""
    st, ver = await _get(http, url + "/version", timeout)
    st_m, models = await _get(http, url + "/v1/models", timeout)
    data = models.get("data") if isinstance(models, dict) else None
    if st != 200 or not isinstance(ver, dict) or not isinstance(data, list):
        note("engine", False, f"GET /version -> {st}, /v1/models -> {st_m}: not a vLLM server? ({str(ver)[:200]})")
        return None
    owners = {str(m.get("owned_by")) for m in data if isinstance(m, dict)}
    note("engine", owners == {"vllm"}, f"vLLM {ver.get('version', '?')} (/v1/models owned_by {sorted(owners)})")
    served = [str(m.get("id")) for m in data if isinstance(m, dict)]
    note("model", model in served, f"requests name {model!r}; the server serves {served}"
         + ("" if model in served else " (set this server's `model:`)"))
    if s.role == "decode":
        st, text = await _text(http, url + "/metrics", timeout)
        on = st == 200 and any(line.startswith(KV_CONSUMER_METRIC) for line in text.splitlines())
        note("KV connector (consumer)", on,
             f"/metrics {'has' if on else 'lacks'} {KV_CONSUMER_METRIC} (a KV connector with kv_role "
             f"kv_consumer or kv_both{'' if on else ' is needed'})")
        return "which KV connector: vLLM publishes its kv_transfer_config only in dev mode's /server_info"
    return None


async def _probe(http: aiohttp.ClientSession, s: ServerSpec, timeout: float, model: str = "", context: int = 0,
                 keyring=None) -> dict:
    url = s.url.rstrip("/")
    out: dict = {"name": s.name, "engine": s.engine, "role": s.role, "url": url, "ok": True, "checks": [],
                 "not_checked": []}
    caps = C.configured(s, context)
    out["cannot"], out["context_length"] = caps.cannot(), caps.context_length or None

    def note(what: str, ok: bool, detail: str) -> None:
        out["checks"].append({"check": what, "ok": ok, "detail": detail})
        out["ok"] = out["ok"] and ok

    status, body = await _get(http, url + "/health", timeout)
    note("reachable", status == 200, f"GET /health -> {status or body}")
    if status == 0:
        return out
    caps = C.narrowed(caps, await C.discover(http, s, timeout) or {}, "published")
    out["cannot"], out["context_length"] = caps.cannot(), caps.context_length or None
    if s.engine == "sglang":
        st, info = await _get(http, url + "/server_info", timeout)
        if st != 200 or not isinstance(info, dict):
            note("engine", False, f"GET /server_info -> {st}: not an SGLang server? ({str(info)[:200]})")
            return out
        note("engine", True, f"SGLang {info.get('version', '?')}, model {info.get('model_path', '?')}")
        mode = info.get("disaggregation_mode")
        want = {"prefill": "prefill", "decode": "decode", "aggregated": "null"}[s.role]
        note("role", mode == want, f"disaggregation_mode {mode!r} (configured {s.role}: {want!r})")
        out["page_size"] = info.get("page_size")
        out["dtype"] = info.get("dtype")
        out["kv_cache_dtype"] = info.get("kv_cache_dtype")
        if s.role != "aggregated":
            backend = info.get("disaggregation_transfer_backend")
            note("kvbridge backend", backend == "kvbridge", f"disaggregation_transfer_backend {backend!r}")
    elif s.engine == "trtllm":
        st, ver = await _get(http, url + "/version", timeout)
        _, models = await _get(http, url + "/v1/models", timeout)  # vLLM answers /version too: tell it apart
        owners = {str(m.get("owned_by")) for m in (models.get("data") if isinstance(models, dict) else None) or []
                  if isinstance(m, dict)}
        vllm = "vllm" in owners
        note("engine", st == 200 and not vllm, f"GET /version -> {st}: {str(ver)[:200]}"
             + (" (a vLLM server: /v1/models is owned_by vllm)" if vllm else ""))
        if s.bus:
            try:
                eps = await asyncio.to_thread(bus_endpoints, s.bus, timeout, keyring)
                note("kvbridge connector", True, f"bus {s.bus} answers: {len(eps)} rank(s)")
                out["ranks"] = len(eps)
            except Exception as e:
                note("kvbridge connector", False, f"bus {s.bus}: {e}")
        out["not_checked"].append("role: trtllm-serve does not publish one (each request's announcement decides)")
    elif s.engine == "vllm":
        left = await _probe_vllm(http, s, url, s.model or model, timeout, note)
        if left:
            out["not_checked"].append(left)
    if s.role == "prefill" and s.bootstrap:
        try:
            from kvbridge.common.bootstrap import endpoints_by_tp_rank, fetch_ranks

            body = await asyncio.to_thread(fetch_ranks, s.bootstrap, timeout, keyring=keyring)
            eps = endpoints_by_tp_rank(body, s.bootstrap)
            out["layout"] = (body["ranks"][0].get("layout") or {}) if body.get("ranks") else {}
            out["tp"] = len(eps)
            out["bootstrap_page_size"] = body.get("page_size")
            note("bootstrap", True, f"{s.bootstrap}: {len(eps)} kvbridge rank(s), page size {body.get('page_size')}")
        except Exception as e:
            note("bootstrap", False, f"{s.bootstrap}: {e}")
    if s.role == "decode":
        out["not_checked"].append("KV layout: a decode publishes none; the prefill checks it at each handshake")
    return out


def _cross_checks(cfg: RouteConfig, results: dict[str, dict]) -> list[dict]:
    """Checks between servers: prefill layouts against the model and each other, page
    sizes of every pair with an SGLang decode."""
    out = []
    expect = _model_expectation(cfg)
    layouts = {n: r["layout"] for n, r in results.items() if r.get("layout")}
    for name, lay in layouts.items():
        if expect is not None:
            diffs = [f"{k} {lay.get(k)} (model {expect[k]})" for k in ("num_layers", "kv_factor", "total_heads", "head_dim")
                     if lay.get(k) != expect[k]]
            out.append({"check": f"layout of {name} vs {expect['source']}", "ok": not diffs,
                        "detail": "; ".join(diffs) or (f"{lay.get('num_layers')} layers, {lay.get('total_heads')} KV heads x "
                                                       f"{lay.get('head_dim')}, kv_factor {lay.get('kv_factor')}, "
                                                       f"{lay.get('dtype')}")})
    dtypes = {n: lay.get("dtype") for n, lay in layouts.items()}
    if len(set(dtypes.values())) > 1:
        out.append({"check": "prefill KV dtypes", "ok": False, "detail": f"differ: {dtypes}"})
    for p in cfg.by_role("prefill"):
        for d in cfg.by_role("decode"):
            if not pairable(p, d):
                continue
            rp, rd = results[p.name], results[d.name]
            if d.engine != "sglang" or not rd.get("page_size"):
                continue
            mine = rp.get("page_size") if p.engine == "sglang" else rp.get("bootstrap_page_size")
            if mine:
                ok = mine == rd["page_size"]
                out.append({"check": f"page size {p.name} -> {d.name}", "ok": ok,
                            "detail": f"{mine} vs {rd['page_size']}" + ("" if ok else
                                                                       ": SGLang refuses different page sizes")})
    return out


async def check(cfg: RouteConfig, timeout_s: float = 5.0) -> dict:
    """Probe every server; ``{"ok": bool, "servers": [...], "cross": [...], "break_even": {...}}``."""
    from .gates import PairGates

    async with aiohttp.ClientSession(trust_env=False) as http:
        ctx = C.model_context(cfg)
        keyring = route_keyring(cfg.secret)
        results = await asyncio.gather(*(_probe(http, s, timeout_s, cfg.model.name, ctx, keyring) for s in cfg.servers))
    by_name = {r["name"]: r for r in results}
    cross = _cross_checks(cfg, by_name)
    gates = PairGates(cfg)
    ok = all(r["ok"] for r in results) and all(c["ok"] for c in cross)
    return {"ok": ok, "servers": results, "cross": cross, "break_even": gates.break_even() if gates.enabled else {}}


def format_report(rep: dict) -> str:
    """The check's outcome for a human."""
    lines = []
    for r in rep["servers"]:
        lines.append(f"{'OK  ' if r['ok'] else 'FAIL'} {r['name']}: {r['engine']} {r['role']} at {r['url']}")
        for c in r["checks"]:
            lines.append(f"       {'ok ' if c['ok'] else 'BAD'} {c['check']}: {c['detail']}")
        lines.append(f"       --  context {r.get('context_length') or 'unknown'} tokens; cannot: "
                     + ("; ".join(r.get("cannot") or ()) or "-"))
        for n in r["not_checked"]:
            lines.append(f"       --  not checked: {n}")
    for c in rep["cross"]:
        lines.append(f"{'OK  ' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}")
    for link, n in rep["break_even"].items():
        lines.append(f"     cost gate on link {link}: moving the KV pays from {n if n is not None else 'no'} prompt tokens")
    lines.append("all checks passed" if rep["ok"] else "some checks FAILED")
    return "\n".join(lines)
