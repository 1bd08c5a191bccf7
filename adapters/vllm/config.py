"""The plugin's settings: vLLM's ``kv_connector_extra_config``, then ``KVBRIDGE_VLLM_<FIELD>``.

vLLM gives a connector its ``--kv-transfer-config`` (``KVTransferConfig``); the
``kv_connector_extra_config`` object in it is the connector's own, and every process of
a server (scheduler and workers) sees the same one. Environment variables
``KVBRIDGE_VLLM_<FIELD>`` (e.g. ``KVBRIDGE_VLLM_BOOTSTRAP_PORT=8998``) override it.
The settings every plugin shares (handoff timing, ``protocol``, ``link``) are
``kvbridge.common.settings.BridgeSettings``'s (README "Settings"), read by its reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvbridge.common.settings import BridgeSettings, ConfigError, read_settings

__all__ = ["VllmBridgeConfig", "ConfigError"]


@dataclass(frozen=True)
class VllmBridgeConfig(BridgeSettings):
    """Settings of one vLLM server's kvbridge connector.

    ``host``: the address its workers bind and advertise (control sockets, Mooncake).
    ``bootstrap_port``: a prefill server (``kv_producer`` / ``kv_both``) runs an
    SGLang-compatible bootstrap server there (TP rank 0's worker), where every worker
    registers its kvbridge record; decode servers of any engine find this prefill's ranks
    through it (``Handle.bootstrap``), SGLang decode servers too (``bootstrap_host`` /
    ``bootstrap_port``). -1 (the default): none, the prefill is then reachable only
    through explicit endpoints. ``sglang_page_size``: the page size it reports, which must
    be the SGLang decode's ``--page-size`` (SGLang refuses a prefill whose reported page
    size differs; kvbridge converts block sizes itself). ``metadata_server``,
    ``protocol``, ``device_name`` go to Mooncake. ``recv_staging_bytes``: staging a decode
    worker offers its senders: vLLM's CPU cache stores K transposed, so a sender of
    another engine writes into staging that this worker scatters (``staged_recv``).
    Handoff timing, auth, ``protocol`` and ``link`` are the shared settings
    (``BridgeSettings``); the cost gate is not wired into the vLLM connector yet, so
    turning it on is refused. ``discovery_timeout_s``: how long a
    decode waits for a prefill's bootstrap server to list its ranks. ``records_path``: a
    file every worker appends one JSON line to per finished handoff (request, room, side,
    outcome, the request's block ids the room read or filled, and kvbridge's record:
    bytes, segments, plan, seconds); "" (default): none.

    What a failed load does is vLLM's own setting, ``kv_load_failure_policy`` in the same
    ``--kv-transfer-config`` (``recompute`` the prompt, or ``fail`` the request).
    """

    host: str = "127.0.0.1"
    bootstrap_port: int = -1
    sglang_page_size: int = 1
    metadata_server: str = "P2PHANDSHAKE"
    device_name: str = ""
    recv_staging_bytes: int = 16 << 20
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 5.0
    discovery_timeout_s: float = 30.0
    records_path: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gate_on:
            raise ConfigError("the cost gate (cost_gate_enabled) is not supported by the vLLM connector")
        if not -1 <= self.bootstrap_port < 65536:
            raise ConfigError(f"bootstrap_port {self.bootstrap_port} is not a TCP port (or -1: none)")
        if self.sglang_page_size <= 0:
            raise ConfigError(f"sglang_page_size must be positive, got {self.sglang_page_size}")
        if self.discovery_timeout_s <= 0:
            raise ConfigError(f"discovery_timeout_s must be positive, got {self.discovery_timeout_s}")

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "VllmBridgeConfig":
        """Settings from ``kv_connector_extra_config`` (its ``kvbridge`` object, or the
        whole mapping) and the environment."""
        extra = dict(extra or {})
        extra = dict(extra.get("kvbridge", extra)) if isinstance(extra.get("kvbridge", extra), Mapping) else {}
        return read_settings(cls, extra, environ=environ, prefix="KVBRIDGE_VLLM_", what="kvbridge vLLM")

