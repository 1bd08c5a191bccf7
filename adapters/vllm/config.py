"""The plugin's settings: vLLM's ``kv_connector_extra_config``, then ``KVBRIDGE_VLLM_<FIELD>``.

vLLM gives a connector its ``--kv-transfer-config`` (``KVTransferConfig``); the
``kv_connector_extra_config`` object in it is the connector's own, and every process of
a server (scheduler and workers) sees the same one. Environment variables
``KVBRIDGE_VLLM_<FIELD>`` (e.g. ``KVBRIDGE_VLLM_BOOTSTRAP_PORT=8998``) override it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from kvbridge.common.handoff import HandoffConfig

__all__ = ["VllmBridgeConfig", "ConfigError"]


class ConfigError(ValueError):
    """A setting that is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class VllmBridgeConfig:
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
    Handoff timing and auth as in ``HandoffConfig``. ``discovery_timeout_s``: how long a
    decode waits for a prefill's bootstrap server to list its ranks. ``records_path``: a
    file every worker appends one JSON line to per finished handoff (request, room, side,
    outcome and kvbridge's record: bytes, segments, plan, seconds); "" (default): none.

    What a failed load does is vLLM's own setting, ``kv_load_failure_policy`` in the same
    ``--kv-transfer-config`` (``recompute`` the prompt, or ``fail`` the request).
    """

    host: str = "127.0.0.1"
    bootstrap_port: int = -1
    sglang_page_size: int = 1
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    recv_staging_bytes: int = 16 << 20
    deadline_s: float = 60.0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 5.0
    quiesce_s: float = 1.0
    chunk_bytes: int = 16 << 20
    secret: str = ""
    model: str = ""
    discovery_timeout_s: float = 30.0
    records_path: str = ""

    def __post_init__(self) -> None:
        if not -1 <= self.bootstrap_port < 65536:
            raise ConfigError(f"bootstrap_port {self.bootstrap_port} is not a TCP port (or -1: none)")
        if self.sglang_page_size <= 0:
            raise ConfigError(f"sglang_page_size must be positive, got {self.sglang_page_size}")
        if self.recv_staging_bytes < 0:
            raise ConfigError(f"recv_staging_bytes must be >= 0, got {self.recv_staging_bytes}")
        for name in ("deadline_s", "heartbeat_s", "peer_timeout_s", "quiesce_s", "discovery_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "VllmBridgeConfig":
        """Settings from ``kv_connector_extra_config`` (its ``kvbridge`` object, or the
        whole mapping) and the environment."""
        env = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        extra = dict(extra or {})
        extra = dict(extra.get("kvbridge", extra)) if isinstance(extra.get("kvbridge", extra), Mapping) else {}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"unknown kvbridge vLLM settings {unknown}; known: {sorted(known)}")
        values.update(extra)
        for name in known:
            raw = env.get("KVBRIDGE_VLLM_" + name.upper())
            if raw is not None:
                values[name] = raw
        typed = {}
        for name, v in values.items():
            kind = type(known[name].default)
            try:
                typed[name] = kind(v) if not isinstance(v, kind) else v
            except (TypeError, ValueError) as e:
                raise ConfigError(f"setting {name}={v!r} is not a {kind.__name__}: {e}") from None
        return cls(**typed)

    def handoff(self, *, receiver: bool) -> HandoffConfig:
        """The handoff state machines' settings (staging offered on the decode side)."""
        return HandoffConfig(deadline_s=self.deadline_s, heartbeat_s=self.heartbeat_s,
                             peer_timeout_s=self.peer_timeout_s, quiesce_s=self.quiesce_s,
                             chunk_bytes=self.chunk_bytes, secret=self.secret, model=self.model,
                             recv_staging_bytes=self.recv_staging_bytes if receiver else 0)
