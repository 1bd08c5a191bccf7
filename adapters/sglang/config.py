"""The SGLang plugin's settings: the shared ``BridgeSettings``, read from the environment.

SGLang gives a transfer backend no config object of its own, so every setting comes from
environment variables ``KVBRIDGE_<FIELD>`` (README "Settings"), optionally on top of a
JSON or YAML file named by ``KVBRIDGE_CONFIG``. Only the defaults are SGLang's own:
``deadline_s`` defaults to SGLang's bootstrap plus waiting timeouts, and ``protocol`` to
``MOONCAKE_PROTOCOL`` (the variable SGLang's Mooncake backend reads), else ``rdma`` when
KVArgs name an InfiniBand device and ``MC_FORCE_TCP`` is unset, else ``tcp``.
No SGLang module is imported here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvbridge.common.settings import BridgeSettings, read_mapping_file, read_settings
from kvbridge.common.transport import MooncakeTransport

__all__ = ["SglangBridgeConfig", "CONFIG_ENV"]

log = logging.getLogger(__name__)

CONFIG_ENV = "KVBRIDGE_CONFIG"


@dataclass(frozen=True)
class SglangBridgeConfig(BridgeSettings):
    """Settings of one SGLang server's kvbridge backend (all of them shared; see
    ``BridgeSettings``). ``device_name``: the InfiniBand device Mooncake uses (from
    KVArgs' ``ib_device``)."""

    device_name: str = ""

    @classmethod
    def load(cls, *, ib_device: str = "", sglang_timeout_s: float = 60.0,
             environ: Mapping[str, str] | None = None) -> "SglangBridgeConfig":
        """Settings from ``KVBRIDGE_CONFIG`` and ``KVBRIDGE_*``, with SGLang's defaults:
        ``sglang_timeout_s`` (its bootstrap + waiting timeouts) as the deadline and the
        protocol from ``MOONCAKE_PROTOCOL`` / ``ib_device`` / ``MC_FORCE_TCP``."""
        env = os.environ if environ is None else environ
        path = env.get(CONFIG_ENV, "")
        base = read_mapping_file(path, CONFIG_ENV) if path else {}
        defaults: dict[str, Any] = {}
        if "deadline_s" not in base and not env.get("KVBRIDGE_DEADLINE_S"):
            defaults["deadline_s"] = float(sglang_timeout_s)
        if "protocol" not in base and not env.get("KVBRIDGE_PROTOCOL"):
            defaults["protocol"] = env.get("MOONCAKE_PROTOCOL") or ("tcp" if env.get("MC_FORCE_TCP") or not ib_device
                                                                   else "rdma")
        if ib_device and "device_name" not in base:
            defaults["device_name"] = ib_device
        return read_settings(cls, {**defaults, **base}, environ=env, what="kvbridge SGLang")

    def transport(self, host: str) -> MooncakeTransport:
        """This rank's Mooncake transport."""
        return MooncakeTransport(host, protocol=self.protocol,
                                 device_name=self.device_name if self.protocol != "tcp" else "")

    def cost_gate_for(self, server_args: Any):
        """The decode rank's cost gate (None when off); the model geometry defaults to the
        served model's ``config.json`` (a local folder, or a hub model SGLang fetched)."""
        if not self.gate_on:
            return None
        return self.make_cost_gate(self._served_config(server_args))

    def layerwise_chooser_for(self, server_args: Any):
        """The prefill rank's per-request layer-wise decision (``kvbridge.common.gate.
        LayerwiseChooser``) when ``layerwise`` is "auto", else None; the model geometry as
        in ``cost_gate_for``."""
        if self.layerwise != "auto":
            return None
        return self.layerwise_chooser(self._served_config(server_args))

    def _served_config(self, server_args: Any):
        """The served model's config for the cost model: its folder, a hub model's config
        as a dict, or None (``cost_model`` set, or nothing found)."""
        model_path = str(getattr(server_args, "model_path", "") or "")
        if os.path.isfile(os.path.join(model_path, "config.json")):
            return model_path
        if model_path and not self.cost_model:
            try:  # a hub id SGLang has already fetched
                from transformers import AutoConfig

                return AutoConfig.from_pretrained(model_path).to_dict()
            except Exception as e:
                log.warning("kvbridge: cost model: cannot read %s's config: %s", model_path, e)
        return None
