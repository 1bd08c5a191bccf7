"""vLLM plugin (kvbridge.adapters.vllm): an out-of-tree KV connector.

``--kv-transfer-config`` with ``KV_TRANSFER_CONFIG`` (plus ``kv_role`` and, on a prefill,
``kv_connector_extra_config: {"bootstrap_port": P}``) loads it; a request names its
handoff in ``kv_transfer_params`` (``handle``). vLLM itself is imported only by
``connector`` and the worker's set-up, never by this package's import.
"""

from .config import ConfigError, VllmBridgeConfig
from .handle import KEY, Handle, HandleError, handle_of

# What --kv-transfer-config takes to load this connector (add kv_role and kv_connector_extra_config).
KV_TRANSFER_CONFIG = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.adapters.vllm.connector"}


def kv_transfer_config(role: str, **settings) -> dict:
    """A ``--kv-transfer-config`` object for ``role`` ("kv_producer", "kv_consumer",
    "kv_both") with kvbridge ``settings`` (``VllmBridgeConfig`` fields) as its extra config."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
    VllmBridgeConfig(**settings)  # checked here, where the caller can see it
    return {**KV_TRANSFER_CONFIG, "kv_role": role, "kv_connector_extra_config": dict(settings)}


__all__ = ["ConfigError", "Handle", "HandleError", "KEY", "KV_TRANSFER_CONFIG", "VllmBridgeConfig", "handle_of",
           "kv_transfer_config"]
