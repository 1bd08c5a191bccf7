"""TensorRT-LLM's connector base classes, from whichever module path the installed version has.

- main: ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector``;
- 1.2.x: ``tensorrt_llm._torch.pyexecutor.kv_cache_connector``.

The kvbridge classes subclass the real ``KvCacheConnectorScheduler`` /
``KvCacheConnectorWorker`` of that module, so whatever the executor calls on them and
the base defines (main's ``wait_for_initialization``, ``register_kv_cache_layout``, the
``*_by_layer_group`` forms) is there. An installed TensorRT-LLM with neither path is an
ImportError naming its version: never a silent fallback.

Only where ``tensorrt_llm`` is not installed at all (tools, unit tests, the machines this
package is built on) do plain local bases stand in, so the package imports; no executor
can load the connector there.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = ["TRTLLM_AVAILABLE", "TRTLLM_VERSION", "CONNECTOR_MODULE", "CONNECTOR_PATHS", "IDLE_WAIT_UNTIMED",
           "KvCacheConnectorScheduler", "KvCacheConnectorWorker", "find_connector_module"]

CONNECTOR_PATHS = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",  # main
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",  # 1.2.x
)


def find_connector_module(import_module: Callable[[str], Any] = importlib.import_module) -> tuple[Any, Any] | None:
    """(tensorrt_llm, its connector API module), or None when TensorRT-LLM is not
    installed. ImportError (naming the version) when it is installed but has neither path."""
    try:
        trt = import_module("tensorrt_llm")
    except ModuleNotFoundError as e:
        if e.name == "tensorrt_llm":
            return None
        raise ImportError(f"tensorrt_llm is installed but does not import: {e}") from e
    tried = []
    for path in CONNECTOR_PATHS:
        try:
            return trt, import_module(path)
        except ModuleNotFoundError as e:
            if not (e.name and path.startswith(e.name)):
                raise  # the module exists and something it imports is missing: say so
            tried.append(path)
    raise ImportError(f"TensorRT-LLM {getattr(trt, '__version__', '(unknown version)')} has no KV cache connector API at "
                      f"{' or '.join(tried)}; kvbridge's connector supports TensorRT-LLM 1.2.x and main")


class _LocalWorker:
    """Local base where TensorRT-LLM is not installed (same constructor and helpers)."""

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        self._metadata = None
        super().__init__()

    def bind_connector_meta(self, metadata: object):
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self):
        self._metadata = None

    def register_forward_pass_callable(self):
        return None


class _LocalScheduler:
    """Local base where TensorRT-LLM is not installed."""

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        super().__init__()


_found = find_connector_module()
if _found is None:
    TRTLLM_AVAILABLE = False
    TRTLLM_VERSION = ""
    CONNECTOR_MODULE = ""
    KvCacheConnectorWorker: type = _LocalWorker
    KvCacheConnectorScheduler: type = _LocalScheduler
else:
    TRTLLM_AVAILABLE = True
    TRTLLM_VERSION = str(getattr(_found[0], "__version__", ""))
    CONNECTOR_MODULE = _found[1].__name__
    KvCacheConnectorWorker = _found[1].KvCacheConnectorWorker
    KvCacheConnectorScheduler = _found[1].KvCacheConnectorScheduler
    log.info("kvbridge: TensorRT-LLM %s, connector API at %s", TRTLLM_VERSION, CONNECTOR_MODULE)
del _found

# 1.2's executor, idle, waits for its next request with no timeout while blocks of
# finished requests are still pinned for their save (kvbridge.adapters.trtllm.idle)
IDLE_WAIT_UNTIMED = CONNECTOR_MODULE == CONNECTOR_PATHS[1]
