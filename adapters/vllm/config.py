"""The plugin's settings: vLLM's ``kv_connector_extra_config``, then ``KVBRIDGE_<FIELD>``.

vLLM gives a connector its ``--kv-transfer-config`` (``KVTransferConfig``); the
``kv_connector_extra_config`` object in it is the connector's own, and every process of
a server (scheduler and workers) sees the same one. It goes on top of the file named by
``KVBRIDGE_CONFIG``; environment variables ``KVBRIDGE_<FIELD>`` (e.g.
``KVBRIDGE_BOOTSTRAP_PORT=8998``) override both. The settings every plugin shares
(networking, handoff timing, ``protocol``, ``link``) are
``kvbridge.common.settings.BridgeSettings``'s (docs/settings.md), read by its reader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

from kvbridge.common.settings import ENV_PREFIX, BridgeSettings, ConfigError

__all__ = ["VllmBridgeConfig", "ConfigError"]


@dataclass(frozen=True)
class VllmBridgeConfig(BridgeSettings):
    """Settings of one vLLM server's kvbridge connector.

    ``bootstrap_port``: a prefill server (``kv_producer`` / ``kv_both``) runs an
    SGLang-compatible bootstrap server there (TP rank 0's worker), where every worker
    registers its kvbridge record; decode servers of any engine find this prefill's ranks
    through it (``Handle.bootstrap``), SGLang decode servers too (``bootstrap_host`` /
    ``bootstrap_port``). -1 (the default): none, the prefill is then reachable only
    through explicit endpoints; it reports ``sglang_page_size``. ``recv_staging_bytes``:
    staging a decode worker offers its senders: vLLM's CPU cache stores K transposed, so a
    sender of another engine writes into staging that this worker scatters
    (``staged_recv``). Networking (``host``, Mooncake's settings), handoff timing, auth,
    ``link``, ``sglang_page_size`` and ``discovery_timeout_s`` are the shared settings
    (``BridgeSettings``); the cost gate is not wired into the vLLM connector yet, so
    turning it on is refused. ``records_path``: a
    file every worker appends one JSON line to per finished handoff (request, room, side,
    outcome, the request's block ids the room read or filled, and kvbridge's record:
    bytes, segments, plan, seconds); "" (default): none.

    What a failed load does is vLLM's own setting, ``kv_load_failure_policy`` in the same
    ``--kv-transfer-config`` (``recompute`` the prompt, or ``fail`` the request).
    """

    WHAT: ClassVar[str] = "kvbridge vLLM"

    bootstrap_port: int = -1
    recv_staging_bytes: int = 16 << 20
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 5.0
    records_path: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gate_on:
            raise ConfigError("the cost gate (cost_gate_enabled) is not supported by the vLLM connector")
        if not -1 <= self.bootstrap_port < 65536:
            raise ConfigError(f"bootstrap_port {self.bootstrap_port} is not a TCP port (or -1: none)")

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "VllmBridgeConfig":
        """Settings from ``KVBRIDGE_CONFIG``, ``kv_connector_extra_config`` (its ``kvbridge``
        object, or the whole mapping) and the environment; a retired
        ``KVBRIDGE_VLLM_<FIELD>`` variable is refused, naming its ``KVBRIDGE_<FIELD>``."""
        env = os.environ if environ is None else environ
        retired = [f"{RETIRED_PREFIX}{f.name.upper()}" for f in fields(cls) if f"{RETIRED_PREFIX}{f.name.upper()}" in env]
        if retired:
            raise ConfigError(f"{', '.join(retired)}: no longer read; every plugin reads {ENV_PREFIX}<NAME> "
                              f"(set {', '.join(ENV_PREFIX + n[len(RETIRED_PREFIX):] for n in retired)})")
        extra = dict(extra or {})
        extra = dict(extra.get("kvbridge", extra)) if isinstance(extra.get("kvbridge", extra), Mapping) else {}
        return super().load(extra, environ=env)


RETIRED_PREFIX = "KVBRIDGE_VLLM_"  # the connector's former environment prefix

