"""The SGLang plugin's settings: the shared ``BridgeSettings``, read from the environment.

SGLang gives a transfer backend no config object of its own, so every setting comes from
environment variables ``KVBRIDGE_<FIELD>`` (docs/settings.md), optionally on top of a
JSON or YAML file named by ``KVBRIDGE_CONFIG``. Only the defaults are SGLang's own:
``host`` defaults to the address SGLang picks for the rank, ``deadline_s`` to SGLang's
bootstrap plus waiting timeouts, and ``protocol`` to ``MOONCAKE_PROTOCOL`` (the variable
SGLang's Mooncake backend reads), else ``rdma`` when KVArgs name an InfiniBand device and
``MC_FORCE_TCP`` is unset, else ``tcp``. No SGLang module is imported here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from kvbridge.common.settings import BridgeSettings

__all__ = ["SglangBridgeConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SglangBridgeConfig(BridgeSettings):
    """Settings of one SGLang server's kvbridge backend (all of them shared; see
    ``BridgeSettings``)."""

    WHAT: ClassVar[str] = "kvbridge SGLang"

    @classmethod
    def load(cls, *, ib_device: str = "", sglang_timeout_s: float | None = None, host: str = "",
             environ: Mapping[str, str] | None = None) -> "SglangBridgeConfig":
        """Settings from ``KVBRIDGE_CONFIG`` and ``KVBRIDGE_*``, with SGLang's defaults:
        ``host`` (the rank's address as SGLang picks it), ``sglang_timeout_s`` (its
        bootstrap + waiting timeouts) as the deadline, ``ib_device`` (KVArgs') as the
        device, and the protocol from ``MOONCAKE_PROTOCOL`` / ``ib_device`` /
        ``MC_FORCE_TCP``."""
        env = os.environ if environ is None else environ
        defaults: dict[str, Any] = {"protocol": env.get("MOONCAKE_PROTOCOL")
                                    or ("tcp" if env.get("MC_FORCE_TCP") or not ib_device else "rdma")}
        if sglang_timeout_s is not None:
            defaults["deadline_s"] = float(sglang_timeout_s)
        if ib_device:
            defaults["device_name"] = ib_device
        if host:
            defaults["host"] = host
        return super().load(environ=env, defaults=defaults)

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
