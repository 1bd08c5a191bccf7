"""The plugin's own settings (TensorRT-LLM's ``kv_connector_config`` only names classes).

Read, later entries winning, from: defaults; the JSON or YAML file named by
``KVBRIDGE_TRTLLM_CONFIG``; environment variables ``KVBRIDGE_<FIELD>`` (e.g.
``KVBRIDGE_BUS_PORT=18500``, ``KVBRIDGE_ON_FAILURE=fail``); explicit overrides. Every
rank of a server reads the same sources (TensorRT-LLM's MPI workers inherit the
environment of ``trtllm-serve``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from kvbridge.common.handoff import HandoffConfig

__all__ = ["BridgeConfig", "ConfigError", "CONFIG_ENV"]

CONFIG_ENV = "KVBRIDGE_TRTLLM_CONFIG"


class ConfigError(ValueError):
    """A setting that is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class BridgeConfig:
    """Settings of one TensorRT-LLM server's kvbridge plugin.

    Networking: ``host`` is the address this server's ranks bind and advertise (control
    sockets and the Mooncake transfer engine); ``bus_port`` is where rank 0's connector
    scheduler listens (its *bus*: rank coordination, and the discovery endpoint a router
    gives decode servers: ``tcp://host:bus_port``); 0 picks a free port.
    ``scheduler_endpoint`` names rank 0's bus explicitly for ranks that cannot learn it
    over MPI. ``metadata_server``, ``protocol`` and ``device_name`` go to Mooncake
    (``protocol="rdma"`` on GPU hosts).

    SGLang interop: ``sglang_bootstrap_port`` >= 0 makes rank 0 run an SGLang-compatible
    bootstrap server on that port (0: any free port; -1, the default: none) and register
    every rank's kvbridge record there, so SGLang decode servers on the kvbridge backend
    find this prefill server (a request names it with ``bootstrap_host`` /
    ``bootstrap_port``). ``sglang_page_size`` is the page size that server reports: it
    must be the SGLang decode's ``--page-size``, since SGLang's decode refuses a prefill
    whose reported page size differs from its own (kvbridge converts block sizes itself).
    ``discovery_timeout_s``: how long a decode request whose handle names an SGLang
    bootstrap address (``Handle.bootstrap``) waits for that prefill's ranks.
    Announced handles (``handle.announce``) are held until their request comes, at most
    for the ``ttl_s`` the router gave.

    Behaviour: ``on_failure`` is what a decode server does when a handoff fails:
    ``"recompute"`` the prompt itself, or ``"fail"`` the request. Handoff timing and
    auth: ``deadline_s``, ``heartbeat_s``, ``peer_timeout_s``, ``quiesce_s``,
    ``chunk_bytes``, ``secret``, ``model``.

    Cost gate (decode servers; off unless ``cost_link`` is set): per request, the cost
    model (``kvbridge.common.gate``) decides whether moving the KV beats computing the
    prompt on this server; below break-even the request is computed here and the prefill's
    room released. ``cost_link``: a link preset (``nvlink``, ``pcie5``, ``ib400``,
    ``tcp``) or a ``kvbridge bench link --out`` file; ``cost_model``: a model preset or a
    Hugging Face ``config.json`` (default: the served model's, from the LLM args);
    ``cost_prefill_tps`` / ``cost_decode_prefill_tps``: prefill tokens/s of the prefill
    and of this server (0: from FLOPs); ``cost_queue_s``: expected prefill queue wait.

    Layer-wise sends (prefill servers; off by default): ``layerwise`` sends each layer of
    the tokens a forward computes from ``save_kv_layer``, while the next layers compute,
    for requests whose room is open; the first token follows once sampled.

    Geometry overrides (normally read from the pool, the executor's KV cache manager and
    the model's config; see ``geometry.rank_geometry``): ``tokens_per_block``,
    ``num_kv_heads`` (the model's KV heads), ``head_dim``, ``dtype`` (logical KV dtype
    when the pool stores bytes, e.g. ``"fp8"``), ``block_order`` (``"HND"`` or ``"NHD"``
    inside a block; default from the attention backend), ``tp_size`` / ``tp_rank``,
    ``world_size`` (ranks that run a connector worker).
    """

    host: str = "127.0.0.1"
    bus_port: int = 0
    scheduler_endpoint: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    on_failure: str = "recompute"
    deadline_s: float = 60.0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 3.0
    quiesce_s: float = 1.0
    chunk_bytes: int = 16 << 20
    secret: str = ""
    model: str = ""
    tokens_per_block: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    block_order: str = ""
    tp_size: int = 0
    tp_rank: int = -1
    world_size: int = 0
    sglang_bootstrap_port: int = -1
    sglang_page_size: int = 1
    discovery_timeout_s: float = 30.0
    cost_link: str = ""
    cost_model: str = ""
    cost_prefill_tps: float = 0.0
    cost_decode_prefill_tps: float = 0.0
    cost_queue_s: float = 0.0
    layerwise: bool = False

    def __post_init__(self) -> None:
        if self.on_failure not in ("recompute", "fail"):
            raise ConfigError(f"on_failure must be 'recompute' or 'fail', got {self.on_failure!r}")
        if not 0 <= self.bus_port < 65536:
            raise ConfigError(f"bus_port {self.bus_port} is not a TCP port")
        if not -1 <= self.sglang_bootstrap_port < 65536:
            raise ConfigError(f"sglang_bootstrap_port {self.sglang_bootstrap_port} is not a TCP port (or -1: none, 0: any)")
        if self.block_order not in ("", "HND", "NHD"):
            raise ConfigError(f"block_order must be 'HND' or 'NHD' (or empty: from the attention backend), "
                              f"got {self.block_order!r}")
        if self.sglang_page_size <= 0:
            raise ConfigError(f"sglang_page_size must be positive (the SGLang decode's --page-size), "
                              f"got {self.sglang_page_size}")
        for name in ("deadline_s", "heartbeat_s", "peer_timeout_s", "quiesce_s", "discovery_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("cost_prefill_tps", "cost_decode_prefill_tps", "cost_queue_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "BridgeConfig":
        """Settings from the config file, the environment and ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = env.get(CONFIG_ENV, "")
        if path:
            values.update(_read_file(path))
        known = {f.name: f for f in fields(cls)}
        for name in known:
            raw = env.get("KVBRIDGE_" + name.upper())
            if raw is not None:
                values[name] = raw
        values.update(overrides or {})
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown kvbridge TensorRT-LLM settings {unknown}; known: {sorted(known)}")
        typed = {}
        for name, v in values.items():
            kind = type(known[name].default)
            if kind is bool and isinstance(v, str):  # bool("false") is True: words are read as words
                word = v.strip().lower()
                if word not in _BOOL_WORDS:
                    raise ConfigError(f"setting {name}={v!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
                typed[name] = _BOOL_WORDS[word]
                continue
            try:
                typed[name] = kind(v) if not isinstance(v, kind) else v
            except (TypeError, ValueError) as e:
                raise ConfigError(f"setting {name}={v!r} is not a {kind.__name__}: {e}") from None
        return cls(**typed)

    def cost_gate(self, served_model: Any = None):
        """The per-request cost gate (``kvbridge.common.gate.CostGate``), or None when
        ``cost_link`` is empty. ``served_model``: the LLM args' model (a directory with a
        ``config.json``), used when ``cost_model`` is empty."""
        from kvbridge.common.gate import CostGate

        default = None
        if isinstance(served_model, (str, os.PathLike)) and os.path.isfile(os.path.join(served_model, "config.json")):
            default = os.fspath(served_model)
        try:
            return CostGate.from_settings(self.cost_link, self.cost_model, prefill_tps=self.cost_prefill_tps,
                                          decode_prefill_tps=self.cost_decode_prefill_tps, queue_s=self.cost_queue_s,
                                          default_model=default)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def handoff(self) -> HandoffConfig:
        """The handoff state machines' settings."""
        return HandoffConfig(deadline_s=self.deadline_s, heartbeat_s=self.heartbeat_s, peer_timeout_s=self.peer_timeout_s,
                             quiesce_s=self.quiesce_s, chunk_bytes=self.chunk_bytes, secret=self.secret, model=self.model)


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {CONFIG_ENV}={path!r}: {e}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path} is YAML but PyYAML is not installed; use JSON") from None
        data = yaml.safe_load(text) or {}
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings")
    return data
