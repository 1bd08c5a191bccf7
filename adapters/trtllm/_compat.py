"""TensorRT-LLM's connector and transceiver base classes, or stand-ins when it is absent.

When ``tensorrt_llm`` imports, the names below are its own classes
(``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``: ``KvCacheConnectorScheduler``,
``KvCacheConnectorWorker``, ``SchedulerOutput``; ``kv_cache_transceiver.py``:
``KvCacheTransceiver``), so the kvbridge classes subclass them and the executor's
``isinstance`` checks and abstract-method checks apply. Otherwise they are plain classes
with the same constructor and helper methods, so this package imports and its tests run
on machines without TensorRT-LLM (which needs CUDA, TensorRT and MPI just to import).

Set ``KVBRIDGE_TRTLLM_IMPORT=0`` to skip the import attempt (the stand-ins are used).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = [
    "TRTLLM_AVAILABLE",
    "TRTLLM_IMPORT_ERROR",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "KvCacheTransceiver",
    "SchedulerOutput",
    "llm_request_state",
    "make_context_phase_params",
]

TRTLLM_AVAILABLE = False
TRTLLM_IMPORT_ERROR = ""


class _StandInWorker:
    """Stand-in for ``tensorrt_llm._torch.pyexecutor.kv_cache_connector.KvCacheConnectorWorker``
    (same constructor and helpers; the abstract methods are the subclass's)."""

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

    def register_forward_pass_callable(self) -> Callable:
        return None


class _StandInScheduler:
    """Stand-in for ``KvCacheConnectorScheduler``."""

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        super().__init__()


class _StandInTransceiver:
    """Stand-in for ``tensorrt_llm._torch.pyexecutor.kv_cache_transceiver.KvCacheTransceiver``."""

    def supports_inflight_request_cancellation(self) -> bool:
        return False

    def has_poisoned_transfer_buffer(self) -> bool:
        return False

    def commit_blocks_for_reuse(self, req: Any) -> None:
        return None

    def shutdown(self):
        return None


class _StandInSchedulerOutput:
    """Stand-in for ``SchedulerOutput`` (new_requests / cached_requests of RequestData)."""

    def __init__(self, new_requests=None, cached_requests=None):
        self.new_requests = list(new_requests or [])
        self.cached_requests = list(cached_requests or [])


KvCacheConnectorWorker: type = _StandInWorker
KvCacheConnectorScheduler: type = _StandInScheduler
KvCacheTransceiver: type = _StandInTransceiver
SchedulerOutput: type = _StandInSchedulerOutput

if os.environ.get("KVBRIDGE_TRTLLM_IMPORT", "1") != "0":
    try:  # pragma: no cover - only where TensorRT-LLM is installed
        from tensorrt_llm._torch.pyexecutor import kv_cache_connector as _kvc

        KvCacheConnectorWorker = _kvc.KvCacheConnectorWorker
        KvCacheConnectorScheduler = _kvc.KvCacheConnectorScheduler
        SchedulerOutput = _kvc.SchedulerOutput
        TRTLLM_AVAILABLE = True
        try:
            from tensorrt_llm._torch.pyexecutor import kv_cache_transceiver as _kvt

            KvCacheTransceiver = _kvt.KvCacheTransceiver
        except Exception as e:  # an older build without the Python transceiver ABC
            log.info("TensorRT-LLM has no KvCacheTransceiver ABC (%s); using the stand-in", e)
    except Exception as e:  # ImportError, or CUDA/MPI/TensorRT errors raised while importing
        TRTLLM_IMPORT_ERROR = f"{type(e).__name__}: {e}"
else:
    TRTLLM_IMPORT_ERROR = "import disabled by KVBRIDGE_TRTLLM_IMPORT=0"


class _States:
    """``LlmRequestState`` member names used here, as plain strings when TensorRT-LLM is absent."""

    CONTEXT_INIT = "CONTEXT_INIT"
    DISAGG_GENERATION_TRANS_IN_PROGRESS = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
    DISAGG_GENERATION_TRANS_COMPLETE = "DISAGG_GENERATION_TRANS_COMPLETE"
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"
    DISAGG_CONTEXT_COMPLETE = "DISAGG_CONTEXT_COMPLETE"
    DISAGG_TRANS_ERROR = "DISAGG_TRANS_ERROR"


def llm_request_state(name: str) -> Any:
    """The ``LlmRequestState`` member called ``name`` (its name as a string without TensorRT-LLM)."""
    if TRTLLM_AVAILABLE:  # pragma: no cover
        from tensorrt_llm.bindings import LlmRequestState

        return getattr(LlmRequestState, name)
    return getattr(_States, name)


class _ContextPhaseParams:
    """Stand-in for ``tensorrt_llm.bindings.executor.ContextPhaseParams``."""

    def __init__(self, first_gen_tokens, req_id, opaque_state, draft_tokens=None):
        self.first_gen_tokens = list(first_gen_tokens)
        self.req_id = req_id
        self.opaque_state = opaque_state
        self.draft_tokens = draft_tokens


def make_context_phase_params(first_gen_tokens, req_id: int, opaque_state: bytes, draft_tokens=None) -> Any:
    """A ``ContextPhaseParams`` (TensorRT-LLM's when installed) for a context-only result."""
    if TRTLLM_AVAILABLE:  # pragma: no cover
        from tensorrt_llm.bindings.executor import ContextPhaseParams

        return ContextPhaseParams(list(first_gen_tokens), req_id, opaque_state, draft_tokens)
    return _ContextPhaseParams(first_gen_tokens, req_id, opaque_state, draft_tokens)
