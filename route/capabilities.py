"""What each server can do with a request, and what a request needs.

A server's capabilities start from its configuration (``ServerSpec.capabilities``, every
engine's default: anything) and are narrowed by what it publishes, read when it is
first seen healthy: ``max_model_len`` in ``/v1/models`` (SGLang, vLLM), SGLang's
``enable_deterministic_inference`` (without it SGLang ignores ``sampling_seed``:
``SamplingBatchInfo.from_schedule_batch``), and ``kvbridge_capabilities`` in
``/version`` (the TensorRT-LLM stand-in's own limits: greedy, no stop strings, no EOS).

A request needs: a context of prompt + ``max_tokens`` tokens; sampling, when it is not
greedy (temperature 0 or top_k 1); seeded sampling, when it sets ``seed`` and samples.
Stop strings and EOS need nothing: a server that does not stop at them is ended by the
router (``text.Answer``). Which half needs what: the decode (or the server computing
alone) everything; an SGLang prefill samples the first token, so sampling and seed too,
and it checks prompt + ``max_new_tokens`` against its context; a vLLM or TensorRT-LLM
prefill answers one token the router discards, so only the prompt must fit.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from .config import Capabilities, RouteConfig, ServerSpec

__all__ = ["Caps", "Needs", "model_context", "configured", "discover", "published_limits", "narrowed", "for_server"]


def model_context(cfg: RouteConfig) -> int:
    """The model's context length: ``model.context_length``, else ``max_position_embeddings``
    in the tokenizer folder's (or ``cost.model``'s) ``config.json``; 0 when unknown."""
    if cfg.model.context_length:
        return cfg.model.context_length
    for spec in (cfg.model.tokenizer, cfg.cost.model):
        p = Path(spec) if spec else None
        if p is None:
            continue
        p = p / "config.json" if p.is_dir() else p
        try:
            c = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        n = c.get("max_position_embeddings") or (c.get("text_config") or {}).get("max_position_embeddings")
        if isinstance(n, int) and n > 0:
            return n
    return 0


@dataclass
class Caps:
    """One server's capabilities in effect, and where each limit came from."""

    sampling: str = "any"
    stop: str = "engine"
    eos: str = "engine"
    seed: bool = True
    context_length: int = 0
    sources: tuple[str, ...] = ()

    def cannot(self) -> list[str]:
        """What this server cannot do (for ``--check`` and errors)."""
        out = []
        if self.sampling == "greedy":
            out.append("sample (it decodes greedily: temperature 0 or top_k 1 only)")
        if not self.seed:
            out.append("seeded sampling ('seed' is ignored)")
        if self.stop == "router":
            out.append("stop strings (the router ends its answers at them)")
        if self.eos == "router":
            out.append("stop at EOS (the router ends its answers there)")
        return out


def configured(spec: ServerSpec, context: int) -> Caps:
    """The capabilities the configuration gives ``spec`` (``context``: the model's)."""
    c = spec.capabilities or Capabilities()
    ctx = min(x for x in (c.context_length, context) if x) if (c.context_length or context) else 0
    return Caps(c.sampling, c.stop, c.eos, c.seed, ctx, ("configuration",) if spec.capabilities else ())


def published_limits(engine: str, models: object, info: object, version: object) -> dict:
    """What a server's published documents narrow: ``/v1/models``, SGLang's
    ``/server_info``, ``/version`` (any may be None)."""
    out: dict = {}
    data = models.get("data") if isinstance(models, dict) else None
    lens = [m.get("max_model_len") for m in data or () if isinstance(m, dict)]
    lens = [n for n in lens if isinstance(n, int) and n > 0]
    if lens:
        out["context_length"] = min(lens)
    if engine == "sglang" and isinstance(info, dict) and not info.get("enable_deterministic_inference"):
        out["seed"] = False
    own = version.get("kvbridge_capabilities") if isinstance(version, dict) else None
    if isinstance(own, dict):
        for k in ("sampling", "stop", "eos", "seed"):
            if k in own:
                out[k] = own[k]
    return out


def narrowed(caps: Caps, limits: dict, source: str) -> Caps:
    """``caps`` narrowed by ``limits`` (never widened)."""
    c = caps
    if limits.get("sampling") == "greedy":
        c = replace(c, sampling="greedy")
    if limits.get("stop") == "router":
        c = replace(c, stop="router")
    if limits.get("eos") == "router":
        c = replace(c, eos="router")
    if limits.get("seed") is False:
        c = replace(c, seed=False)
    n = limits.get("context_length")
    if isinstance(n, int) and n > 0 and (not c.context_length or n < c.context_length):
        c = replace(c, context_length=n)
    return replace(c, sources=c.sources + (source,)) if c != caps else c


async def _get(http: aiohttp.ClientSession, url: str, timeout: float) -> object:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            return json.loads(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def discover(http: aiohttp.ClientSession, spec: ServerSpec, timeout_s: float = 5.0) -> dict | None:
    """What ``spec`` publishes about its limits (``published_limits``); None when it
    answered none of the documents (try again later)."""
    url = spec.url.rstrip("/")
    models = await _get(http, url + "/v1/models", timeout_s)
    info = await _get(http, url + "/server_info", timeout_s) if spec.engine == "sglang" else None
    version = await _get(http, url + "/version", timeout_s) if spec.engine == "trtllm" else None
    if models is None and info is None and version is None:
        return None
    return published_limits(spec.engine, models, info, version)


@dataclass(frozen=True)
class Needs:
    """What one request needs of the servers that serve it."""

    prompt: int
    max_tokens: int
    sampled: bool  # not greedy
    seeded: bool  # seed set, and sampled

    @classmethod
    def of(cls, prompt_len: int, s) -> "Needs":
        sampled = not (s.temperature == 0 or s.top_k == 1)
        return cls(prompt_len, s.max_tokens, sampled, sampled and s.seed is not None)

    def unmet(self, engine: str, caps: Caps, part: str) -> list[str]:
        """Why a server (``engine``, ``caps``) cannot be this request's ``part``
        (``prefill``, ``decode`` or ``compute``); empty when it can."""
        out = []
        first_token = part != "prefill" or engine == "sglang"
        total = self.prompt + (self.max_tokens if first_token else 1)
        if caps.context_length and total > caps.context_length:
            out.append(f"its context is {caps.context_length} tokens, the request needs {total} "
                       f"({self.prompt} prompt + {total - self.prompt} to generate)")
        if first_token and self.sampled and caps.sampling == "greedy":
            out.append("'temperature' > 0 needs sampling: it decodes greedily")
        if first_token and self.seeded and not caps.seed:
            out.append("'seed' needs seeded sampling: it ignores seeds")
        return out


def for_server(s, engine: str, caps: Caps, part: str):
    """The sampling a server gets for its ``part`` of a request: no stop strings where the
    router ends the answer; greedy, without stop strings or seed, for a vLLM or
    TensorRT-LLM prefill (its one token is discarded)."""
    if part == "prefill" and engine != "sglang":
        return replace(s, temperature=0.0, top_p=1.0, top_k=-1, stop=(), seed=None)
    if caps.stop == "router" and s.stop:
        return replace(s, stop=())
    return s
