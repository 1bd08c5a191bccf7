"""``route.yaml``: what ``kvbridge route`` serves, read and checked before anything starts.

The file lists servers by engine and role, the link between each prefill/decode pair
(a preset or a ``kvbridge bench link --out`` file), the cost model's inputs, deadlines,
the retry policy, admission limits and health checking::

    model:
      name: llama-3.1-8b               # what /v1/models answers and responses carry
      tokenizer: /models/llama-3.1-8b  # a Hugging Face folder: tokenizer (and config.json)
      aliases: [llama]                 # other names clients may ask for (404 for any other)
      context_length: 0                # 0: config.json's max_position_embeddings
    listen: {host: 0.0.0.0, port: 8000}
    servers:
      - {name: p0, engine: sglang, role: prefill, url: "http://10.0.0.1:30000", bootstrap: "10.0.0.1:8998"}
      - {name: d0, engine: trtllm, role: decode, url: "http://10.0.0.2:8200", bus: "tcp://10.0.0.2:18500"}
      - {name: v0, engine: vllm, role: prefill, url: "http://10.0.0.4:8000", bootstrap: "10.0.0.4:8998",
         model: /models/llama-3.1-8b}     # the name vLLM serves it under (default: model.name)
      - {name: g0, engine: trtllm, role: decode, url: "http://10.0.0.5:8200", bus: "tcp://10.0.0.5:18500",
         capabilities: {sampling: greedy, stop: router}}   # what the engine cannot do (default: all)
      - {name: a0, engine: sglang, role: aggregated, url: "http://10.0.0.3:30000"}
    links: {default: tcp, "sglang->trtllm": /etc/kvbridge/link.json}
    cost: {prefill_tps: 20000, decode_prefill_tps: 10000}

Every other section has defaults (``RouteConfig``). Errors name the key that is wrong
(``ConfigError``). Nothing here touches the network: ``kvbridge.route.check`` probes
the servers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import msgspec

__all__ = ["ConfigError", "ModelSpec", "Capabilities", "ServerSpec", "CostSpec", "Deadlines", "RetryPolicy", "Limits", "HealthSpec",
           "ListenSpec", "RouteConfig", "load_config", "parse_config", "ENGINES", "ROLES"]

ENGINES = ("sglang", "trtllm", "vllm")
ROLES = ("prefill", "decode", "aggregated")


class ConfigError(ValueError):
    """A route configuration that cannot be served; the message names the key."""


class _S(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelSpec(_S):
    """The served model: its public name and the tokenizer folder the router tokenizes
    with (every server must see the same token ids). ``chat_template``: a Jinja template
    for /v1/chat/completions when the tokenizer has none (or to override it)."""

    name: str
    tokenizer: str
    chat_template: str = ""
    aliases: list[str] = msgspec.field(default_factory=list)
    context_length: int = 0

    def names(self) -> list[str]:
        """Every name a client may ask for: ``name`` first, then the aliases."""
        return [self.name] + [a for a in self.aliases if a != self.name]


class Capabilities(_S):
    """What a server's engine does with a request's parameters, as configured; the router
    pairs a request only with servers that can serve it. ``sampling``: ``any``, or
    ``greedy`` (temperature 0 or top_k 1 only); ``stop``: ``engine`` (the server stops at
    stop strings) or ``router`` (it takes none: the router ends the answer at the first
    stop string and closes the connection); ``eos``: ``engine`` or ``router`` likewise for
    the end-of-sequence token; ``seed``: the server makes seeded sampling reproducible;
    ``context_length``: prompt + max_tokens it takes (0: the model's). The router narrows
    these by what a server publishes (``max_model_len``, SGLang's deterministic mode,
    a stand-in's own limits)."""

    sampling: Literal["any", "greedy"] = "any"
    stop: Literal["engine", "router"] = "engine"
    eos: Literal["engine", "router"] = "engine"
    seed: bool = True
    context_length: int = 0


class ServerSpec(_S):
    """One server. ``bootstrap``: an SGLang prefill's bootstrap server ``host:port``, a
    vLLM prefill's (its connector's ``bootstrap_port``), or a TensorRT-LLM prefill's
    SGLang-compatible one (its ``sglang_bootstrap_port``), which SGLang and vLLM decodes
    pull through. ``bus``: a TensorRT-LLM server's kvbridge bus ``tcp://host:port`` (where
    the router announces handles). ``model``: the model name sent in this server's OpenAI
    requests (vLLM answers 404 for a name it does not serve, e.g. its ``--model`` path
    without ``--served-model-name``); default ``model.name``."""

    name: str
    engine: Literal["sglang", "trtllm", "vllm"]
    role: Literal["prefill", "decode", "aggregated"]
    url: str
    bootstrap: str = ""
    bus: str = ""
    model: str = ""
    capabilities: Capabilities | None = None

    @property
    def can_compute(self) -> bool:
        """Whether a request can be sent to this server alone (no handoff): an aggregated
        server, or a TensorRT-LLM or vLLM decode (given no handle, they compute the prompt).
        An SGLang disaggregated decode cannot: it only runs requests whose KV arrives."""
        return self.role == "aggregated" or (self.engine in ("trtllm", "vllm") and self.role == "decode")


class CostSpec(_S):
    """Inputs of the cost gate (``kvbridge.common.gate.CostGate``), one per pair's link.
    ``model``: a preset or a ``config.json`` (default: the tokenizer folder's). Rates in
    prompt tokens/s (0: from FLOPs); ``queue_s``: expected wait for a prefill."""

    model: str = ""
    kv_dtype_bytes: int = 2
    prefill_tps: float = 0.0
    decode_prefill_tps: float = 0.0
    queue_s: float = 0.0
    enabled: bool = True


class Deadlines(_S):
    """``request_s``: a client never waits longer (a header ``X-Request-Timeout`` may
    shorten it); ``prefill_s``: a prefill half that has not handed off by then is given up
    (its room aborted) and retried; ``connect_s``: TCP connect to a server.

    From clients: ``headers_s``: a connection that has not sent a whole request's headers
    within it (from its start, or from the end of its last answer: idle keep-alive
    included) is closed; ``body_s``: a request whose body has not arrived within it is
    answered 408 and its connection closed; ``shutdown_s``: at shutdown, requests in flight
    may finish within it, then open streams end with an error event."""

    request_s: float = 60.0
    prefill_s: float = 20.0
    connect_s: float = 2.0
    headers_s: float = 15.0
    body_s: float = 30.0
    shutdown_s: float = 10.0


class RetryPolicy(_S):
    """``prefill_attempts``: handoffs tried per request (each on another prefill, with a
    new room); ``recompute``: when they are used up, or no prefill is left, compute the
    request on a server that can (aggregated, or a TensorRT-LLM decode), within the
    deadline; ``backoff_s``: pause before a retry."""

    prefill_attempts: int = 2
    recompute: bool = True
    backoff_s: float = 0.0


class Limits(_S):
    """Admission: at most ``max_inflight`` requests dispatched at once and ``max_queue``
    waiting; a request beyond that gets 429, one that cannot be served (no server, or
    its deadline passes in the queue) 503, both with ``Retry-After: retry_after_s``.
    ``max_body_bytes``: a larger request body is refused (413) before it is read;
    ``parse_threads``: threads that decode bodies and tokenize prompts (off the event loop)."""

    max_inflight: int = 64
    max_queue: int = 256
    retry_after_s: float = 1.0
    max_body_bytes: int = 4 << 20
    parse_threads: int = 2


class HealthSpec(_S):
    """Each server's ``path`` is polled every ``interval_s``; ``fail_after`` failures in a
    row take it out of rotation, ``pass_after`` successes put it back. A refused
    connection on the request path takes it out at once."""

    interval_s: float = 2.0
    timeout_s: float = 5.0
    fail_after: int = 2
    pass_after: int = 1
    path: str = "/health"


class ListenSpec(_S):
    host: str = "127.0.0.1"
    port: int = 8000


class RouteConfig(_S):
    """The whole file (see the module doc)."""

    model: ModelSpec
    servers: list[ServerSpec]
    listen: ListenSpec = msgspec.field(default_factory=ListenSpec)
    links: dict[str, str] = msgspec.field(default_factory=lambda: {"default": "tcp"})
    cost: CostSpec = msgspec.field(default_factory=CostSpec)
    deadlines: Deadlines = msgspec.field(default_factory=Deadlines)
    retry: RetryPolicy = msgspec.field(default_factory=RetryPolicy)
    limits: Limits = msgspec.field(default_factory=Limits)
    health: HealthSpec = msgspec.field(default_factory=HealthSpec)
    secret: str = ""  # the servers' key (empty: the shared setting, KVBRIDGE_SECRET): the router's room aborts are sealed with it
    # the decode servers' integrity setting and sample fraction (empty / negative: the shared settings',
    # KVBRIDGE_INTEGRITY / KVBRIDGE_INTEGRITY_SAMPLE): which rooms' content the decode compares, reported per response
    integrity: str = ""
    integrity_sample: float = -1.0

    def integrity_check(self):
        """A ``HandoffConfig`` carrying the decode servers' integrity setting (``verifies(room)``):
        the shared settings (``BridgeSettings.load``) with this file's values over them."""
        from kvbridge.common.settings import BridgeSettings

        mine = {"integrity": self.integrity} if self.integrity else {}
        if self.integrity_sample >= 0:
            mine["integrity_sample"] = self.integrity_sample
        try:
            return BridgeSettings.load(overrides=mine).handoff()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def server(self, name: str) -> ServerSpec:
        for s in self.servers:
            if s.name == name:
                return s
        raise KeyError(name)

    def by_role(self, role: str) -> list[ServerSpec]:
        return [s for s in self.servers if s.role == role]

    def link_spec(self, prefill: ServerSpec, decode: ServerSpec) -> str:
        """The link of this pair: ``links["p->d"]`` by server names, else by engines
        (``"sglang->trtllm"``), else ``links["default"]``."""
        for key in (f"{prefill.name}->{decode.name}", f"{prefill.engine}->{decode.engine}", "default"):
            if key in self.links:
                return self.links[key]
        raise ConfigError(f"links: no entry for {prefill.name}->{decode.name} and no 'default'")


def pairable(prefill: ServerSpec, decode: ServerSpec) -> bool:
    """Whether ``decode`` can pull from ``prefill``: an SGLang decode finds its prefill
    through an SGLang(-compatible) bootstrap server; a TensorRT-LLM decode through the
    prefill's bootstrap (SGLang, vLLM) or bus (TensorRT-LLM); a vLLM decode through the
    prefill's bootstrap, or the rank endpoints a TensorRT-LLM prefill's bus lists."""
    if prefill.role != "prefill" or decode.role != "decode":
        return False
    if decode.engine == "sglang":
        return bool(prefill.bootstrap)
    if decode.engine == "vllm":
        return bool(prefill.bootstrap or prefill.bus)
    return bool(prefill.bus) if prefill.engine == "trtllm" else bool(prefill.bootstrap)


_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ADDR = re.compile(r"^[^:/\s]+:\d{1,5}$")


def _validate(cfg: RouteConfig) -> RouteConfig:
    def bad(where: str, what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}")

    if not cfg.model.name:
        raise bad("model.name", "must not be empty")
    if any(not a for a in cfg.model.aliases):
        raise bad("model.aliases", "must not contain an empty name")
    if cfg.model.context_length < 0:
        raise bad("model.context_length", "must be >= 0 (0: config.json's max_position_embeddings)")
    if not cfg.servers:
        raise bad("servers", "lists no server")
    seen: set[str] = set()
    for i, s in enumerate(cfg.servers):
        where = f"servers[{i}] ({s.name or 'no name'})"
        if not _NAME.match(s.name):
            raise bad(f"servers[{i}].name", f"{s.name!r} is not a name (letters, digits, _ . -)")
        if s.name in seen:
            raise bad(f"servers[{i}].name", f"{s.name!r} is used twice")
        seen.add(s.name)
        u = urlparse(s.url)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise bad(f"{where}.url", f"{s.url!r} is not an http(s)://host:port address")
        if s.bootstrap and not _ADDR.match(s.bootstrap):
            raise bad(f"{where}.bootstrap", f"{s.bootstrap!r} is not host:port")
        if s.bus and not re.match(r"^tcp://[^:/\s]+:\d{1,5}$", s.bus):
            raise bad(f"{where}.bus", f"{s.bus!r} is not tcp://host:port")
        if s.engine == "sglang" and s.role == "prefill" and not s.bootstrap:
            raise bad(f"{where}.bootstrap", "an SGLang prefill needs its bootstrap server's host:port")
        if s.engine == "vllm" and s.role == "prefill" and not s.bootstrap:
            raise bad(f"{where}.bootstrap", "a vLLM prefill needs its kvbridge bootstrap server's host:port "
                                            "(the connector's bootstrap_port): decodes find its ranks there")
        if s.engine != "trtllm" and s.bus:
            raise bad(f"{where}.bus", "only TensorRT-LLM servers have a kvbridge bus")
        if s.model and s.engine == "sglang":
            raise bad(f"{where}.model", "SGLang's /generate takes no model name (only vLLM and trtllm-serve servers)")
        if s.engine == "trtllm" and s.role in ("prefill", "decode") and not s.bus:
            raise bad(f"{where}.bus", "a TensorRT-LLM prefill or decode needs its kvbridge bus (tcp://host:bus_port)")
        if s.capabilities is not None and s.capabilities.context_length < 0:
            raise bad(f"{where}.capabilities.context_length", "must be >= 0")
        if s.role != "prefill" and s.bootstrap:
            raise bad(f"{where}.bootstrap", "only prefill servers have a bootstrap server")
    prefills, decodes = cfg.by_role("prefill"), cfg.by_role("decode")
    for d in decodes:
        if not any(pairable(p, d) for p in prefills):
            need = {"sglang": "a prefill with a bootstrap address (SGLang, vLLM, or TensorRT-LLM with "
                              "sglang_bootstrap_port)",
                    "vllm": "a prefill with a bootstrap address or a TensorRT-LLM bus"}.get(d.engine, "a prefill")
            raise bad(f"servers ({d.name})", f"decode {d.name} has no prefill it can pull from: it needs {need}")
    if not any(s.can_compute for s in cfg.servers) and not decodes:
        raise bad("servers", "no decode and no server that computes requests alone (aggregated)")
    if decodes and not prefills:
        raise bad("servers", "decode servers but no prefill")
    for key, spec in cfg.links.items():
        if key != "default":
            parts = key.split("->")
            names = {s.name for s in cfg.servers} | set(ENGINES)
            if len(parts) != 2 or not all(p in names for p in parts):
                raise bad(f"links[{key!r}]", "keys are 'default', 'engine->engine' or 'prefill_name->decode_name'")
        _check_link(f"links[{key!r}]", spec)
    for p in prefills:
        for d in decodes:
            if pairable(p, d):
                cfg.link_spec(p, d)
    c = cfg.cost
    for name in ("prefill_tps", "decode_prefill_tps", "queue_s"):
        if getattr(c, name) < 0:
            raise bad(f"cost.{name}", "must be >= 0")
    if c.kv_dtype_bytes not in (1, 2, 4):
        raise bad("cost.kv_dtype_bytes", "must be 1, 2 or 4")
    dl = cfg.deadlines
    for name in ("request_s", "prefill_s", "connect_s", "headers_s", "body_s", "shutdown_s"):
        if getattr(dl, name) <= 0:
            raise bad(f"deadlines.{name}", "must be > 0")
    if cfg.retry.prefill_attempts < 1:
        raise bad("retry.prefill_attempts", "must be >= 1")
    if cfg.retry.backoff_s < 0:
        raise bad("retry.backoff_s", "must be >= 0")
    lim = cfg.limits
    if lim.max_inflight < 1 or lim.max_queue < 0 or lim.retry_after_s <= 0:
        raise bad("limits", "max_inflight >= 1, max_queue >= 0 and retry_after_s > 0 are needed")
    if lim.max_body_bytes < 1024:
        raise bad("limits.max_body_bytes", f"{lim.max_body_bytes} is below 1024 bytes")
    if lim.parse_threads < 1:
        raise bad("limits.parse_threads", "must be >= 1")
    h = cfg.health
    if h.interval_s <= 0 or h.timeout_s <= 0 or h.fail_after < 1 or h.pass_after < 1 or not h.path.startswith("/"):
        raise bad("health", "interval_s > 0, timeout_s > 0, fail_after >= 1, pass_after >= 1, path starting with /")
    if not 0 <= cfg.listen.port < 65536:
        raise bad("listen.port", f"{cfg.listen.port} is not a TCP port")
    return cfg


def _check_link(where: str, spec: str) -> None:
    from kvbridge.common.costmodel import load_link

    try:
        load_link(spec)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None


def parse_config(text: str | bytes, source: str = "route.yaml") -> RouteConfig:
    """A checked ``RouteConfig`` from YAML text; ConfigError naming the key otherwise.
    Relative file paths in ``links`` and ``model`` are resolved by the caller."""
    import msgspec.yaml

    try:
        cfg = msgspec.yaml.decode(text, type=RouteConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    try:
        cfg = _validate(cfg)
        cfg.integrity_check()
        return cfg
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_config(path: str | Path) -> RouteConfig:
    """Read and check ``path``; file paths inside it (tokenizer, cost model, link files)
    are taken relative to the file's folder."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    import msgspec.yaml

    try:
        raw = msgspec.yaml.decode(text)
    except msgspec.DecodeError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if isinstance(raw, dict):
        base = p.resolve().parent
        _resolve_paths(raw, base)
        text = msgspec.yaml.encode(raw)
    return parse_config(text, str(p))


def _resolve_paths(raw: dict, base: Path) -> None:
    """Relative paths (that exist relative to ``base``) become absolute."""
    from kvbridge.common.costmodel import LINK_PRESETS, MODEL_PRESETS

    def fix(v):
        if not isinstance(v, str) or not v or v in LINK_PRESETS or v in MODEL_PRESETS:
            return v
        if not Path(v).is_absolute() and (base / v).exists():
            return str(base / v)
        return v

    model = raw.get("model")
    if isinstance(model, dict) and "tokenizer" in model:
        model["tokenizer"] = fix(model["tokenizer"])
    cost = raw.get("cost")
    if isinstance(cost, dict) and "model" in cost:
        cost["model"] = fix(cost["model"])
    links = raw.get("links")
    if isinstance(links, dict):
        for k, v in links.items():
            links[k] = fix(v)
