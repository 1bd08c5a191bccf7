"""The plugin's own settings (TensorRT-LLM's ``kv_connector_config`` only names classes).

Read, later entries winning, from: defaults; the JSON or YAML file named by
``KVBRIDGE_CONFIG``; environment variables ``KVBRIDGE_<FIELD>`` (e.g.
``KVBRIDGE_BUS_PORT=18500``, ``KVBRIDGE_ON_FAILURE=fail``), the process's own and then
the ``KVBRIDGE_*`` entries of the LLM args' ``env_overrides`` (TensorRT-LLM pickles the
LLM args to every rank, whatever spawned it: the one source that reaches every rank on
every launch path); explicit overrides. A rank that none of these reached takes rank 0's
settings over MPI at ``register_kv_caches`` (``agree_with_rank0``). The settings every
plugin shares (networking, handoff timing, link, cost gate) are
``kvbridge.common.settings.BridgeSettings``'s, read by its reader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

from kvbridge.common.settings import CONFIG_ENV, ENV_PREFIX, BridgeSettings, ConfigError

__all__ = ["BridgeConfig", "ConfigError", "settings_environ", "agree_with_rank0"]

RETIRED_CONFIG_ENV = "KVBRIDGE_TRTLLM_CONFIG"  # the plugin's former name for KVBRIDGE_CONFIG
# settings each rank may set for itself: its own address (ranks on other nodes), its TP rank
RANK_LOCAL = ("host", "tp_rank")


def settings_environ(llm_args: Any = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``KVBRIDGE_*`` variables this rank sees: its environment's, then the LLM args'
    ``env_overrides`` (``LlmArgs.env_overrides``, applied by TensorRT-LLM's ``worker_main``
    on every rank; read here too, so they count whichever path started the rank)."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    overrides = getattr(llm_args, "env_overrides", None) or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"llm_args.env_overrides must be a mapping of variable names to values, "
                          f"got {type(overrides).__name__}")
    out.update({str(k): str(v) for k, v in overrides.items() if str(k).startswith(ENV_PREFIX)})
    return out


@dataclass(frozen=True)
class BridgeConfig(BridgeSettings):
    """Settings of one TensorRT-LLM server's kvbridge plugin.

    Networking (``host``, ``metadata_server``, ``protocol``, ``device_name``: shared
    settings; ``protocol="rdma"`` on GPU hosts): ``bus_port`` is where rank 0's connector
    scheduler listens (its *bus*: rank coordination, and the discovery endpoint a router
    gives decode servers: ``tcp://host:bus_port``); 0 picks a free port.
    ``scheduler_endpoint`` names rank 0's bus explicitly for ranks that cannot learn it
    over MPI.

    SGLang interop: ``sglang_bootstrap_port`` >= 0 makes rank 0 run an SGLang-compatible
    bootstrap server on that port (0: any free port; -1, the default: none) and register
    every rank's kvbridge record there, so SGLang decode servers on the kvbridge backend
    find this prefill server (a request names it with ``bootstrap_host`` /
    ``bootstrap_port``); it reports the shared ``sglang_page_size``. The shared
    ``discovery_timeout_s``: how long a decode request whose handle names an SGLang
    bootstrap address (``Handle.bootstrap``) waits for that prefill's ranks.
    Announced handles (``handle.announce``) are held until their request comes, at most
    for the ``ttl_s`` the router gave and never more than an hour; a server holds at most
    65536 of them, 256 per prompt (more are refused, with the reason, to the router).
    Bus messages are sealed with ``secret`` (``kvbridge.common.auth``, domain ``b"bus"``);
    a routable ``host`` without one refuses to start unless ``allow_insecure``.

    Behaviour: ``on_failure`` is what a decode server does when a handoff fails:
    ``"recompute"`` the prompt itself, or ``"fail"`` the request. Handoff timing, auth,
    ``protocol``, ``link`` and the cost gate are the shared settings
    (``BridgeSettings``; docs/settings.md). With the gate on, below break-even a request
    is computed on this decode server and the prefill's room released; its model
    geometry defaults to the served model's config (from the LLM args).

    Layer-wise sends (prefill servers; off by default; a shared setting): ``layerwise``
    true sends each layer of the tokens a forward computes from ``save_kv_layer``, while
    the next layers compute, for requests whose room is open; the first token follows
    once sampled. "auto" decides per request, when its room opens, from the link and the
    model geometry (``cost_model``, else the served model's config): ``layerwise_chooser``.

    Geometry overrides (normally read from the pool, the executor's KV cache manager and
    the model's config; see ``geometry.rank_geometry``): ``tokens_per_block``,
    ``num_kv_heads`` (the model's KV heads), ``head_dim``, ``dtype`` (logical KV dtype
    when the pool stores bytes, e.g. ``"fp8"``), ``block_order`` (``"HND"`` or ``"NHD"``
    inside a block; default from the attention backend), ``tp_size`` / ``tp_rank``,
    ``world_size`` (ranks that run a connector worker).
    """

    WHAT: ClassVar[str] = "kvbridge TensorRT-LLM"

    bus_port: int = 0
    scheduler_endpoint: str = ""
    on_failure: str = "recompute"
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 3.0
    tokens_per_block: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    block_order: str = ""
    tp_size: int = 0
    tp_rank: int = -1
    world_size: int = 0
    sglang_bootstrap_port: int = -1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_failure not in ("recompute", "fail"):
            raise ConfigError(f"on_failure must be 'recompute' or 'fail', got {self.on_failure!r}")
        if not 0 <= self.bus_port < 65536:
            raise ConfigError(f"bus_port {self.bus_port} is not a TCP port")
        if not -1 <= self.sglang_bootstrap_port < 65536:
            raise ConfigError(f"sglang_bootstrap_port {self.sglang_bootstrap_port} is not a TCP port (or -1: none, 0: any)")
        if self.block_order not in ("", "HND", "NHD"):
            raise ConfigError(f"block_order must be 'HND' or 'NHD' (or empty: from the attention backend), "
                              f"got {self.block_order!r}")

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
             llm_args: Any = None) -> "BridgeConfig":
        """Settings from the config file, the environment, ``llm_args.env_overrides`` and
        ``overrides``; the retired ``KVBRIDGE_TRTLLM_CONFIG`` is refused, naming ``KVBRIDGE_CONFIG``."""
        env = settings_environ(llm_args, environ)
        if RETIRED_CONFIG_ENV in env:
            raise ConfigError(f"{RETIRED_CONFIG_ENV}: no longer read; every plugin reads its settings file from "
                              f"{CONFIG_ENV}")
        return super().load(environ=env, overrides=overrides)

    def differences(self, other: "BridgeConfig") -> list[str]:
        """The names of the settings (rank-local ones aside) whose values differ from ``other``'s."""
        return [f.name for f in fields(self) if f.name not in RANK_LOCAL and getattr(self, f.name) != getattr(other, f.name)]

    def _served_config(self, served_model: Any) -> str | None:
        """The LLM args' model when it is a folder holding a ``config.json``, else None."""
        if isinstance(served_model, (str, os.PathLike)) and os.path.isfile(os.path.join(served_model, "config.json")):
            return os.fspath(served_model)
        return None


def agree_with_rank0(mine: BridgeConfig, configured: bool, rank0: BridgeConfig, rank0_configured: bool, rank: int,
                     same_host: bool) -> BridgeConfig:
    """The settings rank ``rank`` runs with, given rank 0's (broadcast over MPI at start-up).

    ``configured`` / ``rank0_configured``: whether any source set something on that rank
    (a ``KVBRIDGE_*`` variable, the config file, an ``env_overrides`` entry: a non-empty
    ``settings_environ``, or settings handed to the connector). A rank that nothing reached
    takes rank 0's, its address too when it runs on rank 0's host (a rank on another host
    binds its own, which it cannot guess: ConfigError). A rank with settings of its own
    must agree with rank 0's, else ConfigError naming each setting that differs (never a
    value)."""
    if rank == 0 or mine == rank0:
        return mine
    if not configured:
        if not rank0_configured:
            return mine  # nobody set anything: the defaults everywhere
        if same_host:
            return rank0
        raise ConfigError(
            f"kvbridge TensorRT-LLM: rank {rank} received none of its settings (no KVBRIDGE_* variable, no "
            f"{CONFIG_ENV}, no KVBRIDGE_* entry in the LLM args' env_overrides) and runs on another host than rank 0, "
            "whose address it cannot take: put the settings in env_overrides (every rank receives them) or forward "
            "them to every host (mpirun -x KVBRIDGE_...), with KVBRIDGE_HOST set per host")
    diff = mine.differences(rank0)
    if diff:
        raise ConfigError(f"kvbridge TensorRT-LLM: rank {rank}'s settings differ from rank 0's in {', '.join(diff)}: "
                          "every rank of a server must read the same settings (set them once, in the LLM args' "
                          "env_overrides, or in the environment of every rank)")
    return mine
