"""TensorRT-LLM's KV cache connector API, as each modelled version defines it.

What the stand-in's ``tensorrt_llm/_torch/pyexecutor/[connectors/]kv_cache_connector.py``
exports: the base classes a connector inherits (``KvCacheConnectorWorker``,
``KvCacheConnectorScheduler``), the records ``build_connector_meta`` receives
(``SchedulerOutput`` of ``RequestData``) and the engine-internal
``KvCacheConnectorManager`` that calls the connector. Behaviour follows the real module
(1.2: ``_torch/pyexecutor/kv_cache_connector.py`` @ 3277953654; main:
``_torch/pyexecutor/connectors/kv_cache_connector.py`` @ 035ab91c); the code is this
project's own.

- Both: the scheduler exists on rank 0 only; its answers reach every rank through
  ``mpi_broadcast`` (``_run_on_leader``); ``get_num_new_matched_tokens`` refuses
  generation-only requests ("Connector API is not supported for generation-only
  requests!") and ``(0, True)``; a request loading asynchronously is parked and swapped
  for the Python request in ``take_scheduled_requests_pending_load``; ``get_finished``
  counts only ids every rank reports (``mpi_allgather``); the per-layer hooks call
  ``wait_for_layer_load`` / ``save_kv_layer``.
- main adds: ``wait_for_initialization`` (called by the executor at start-up),
  ``register_kv_cache_layout``, ``*_by_layer_group``, ``supports_attention_dp``; the
  manager splits the matched-token query (``query_num_new_matched_tokens`` +
  ``commit_new_matched_tokens``); ``RequestData`` gains ``block_hashes``,
  ``priorities``, ``cache_salt``, ``new_block_ids_by_layer_group``; ``handle_metadata``
  returns early without a scheduler output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .dist import mpi_allgather, mpi_broadcast, mpi_rank
from .request import LlmRequestState

# -- records --------------------------------------------------------------------------


@dataclass
class RequestData:
    """1.2: one scheduled request as ``build_connector_meta`` sees it."""

    request_id: int
    new_tokens: List[int]
    new_block_ids: List[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class RequestDataMain(RequestData):
    """main: ``RequestData`` with block hashes, retention priorities and the cache salt."""

    block_hashes: List[int] = field(default_factory=list)
    priorities: Optional[List[int]] = None
    cache_salt: Optional[str] = None
    new_block_ids_by_layer_group: List[List[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """1.2: ``new_requests`` (first time scheduled) and ``cached_requests``."""

    new_requests: List[RequestData] = field(default_factory=list)
    cached_requests: List[RequestData] = field(default_factory=list)


@dataclass
class SchedulerOutputMain(SchedulerOutput):
    """main: adds the attention-DP owner (None on the tensor-parallel path)."""

    attention_dp_rank: Optional[int] = None


# -- the connector base classes ---------------------------------------------------------


class _WorkerBase(ABC):
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

    def register_forward_pass_callable(self) -> Optional[Callable]:
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor):
        """The rank's primary pool, once, at executor start-up."""

    @abstractmethod
    def start_load_kv(self, stream):
        """Begin loads for the coming forward (after ``bind_connector_meta``)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream):
        """Before decoder layer ``layer_idx`` runs."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream):
        """After decoder layer ``layer_idx`` ran."""

    @abstractmethod
    def wait_for_save(self, stream):
        """At the end of the forward."""

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]:
        """(finished saving, finished loading); every iteration."""


class _SchedulerBase(ABC):
    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output):
        """Metadata for the workers of the coming forward."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        """(tokens loadable beyond the device match, load asynchronously?)."""

    @abstractmethod
    def request_finished(self, request, cache_block_ids: List[int]) -> bool:
        """True: the blocks stay allocated until the workers report the save."""

    @abstractmethod
    def update_state_after_alloc(self, request, block_ids: List[int]):
        """The blocks just allocated for ``request``."""


class KvCacheConnectorWorker(_WorkerBase):
    """1.2's worker base class."""


class KvCacheConnectorScheduler(_SchedulerBase):
    """1.2's scheduler base class."""


class KvCacheConnectorWorkerMain(_WorkerBase):
    """main's worker base class."""

    supports_attention_dp: bool = False

    def register_kv_cache_layout(self, layout) -> None:
        """A single-pool layout goes to ``register_kv_caches``."""
        tensor = layout.as_single_pool_tensor()
        if tensor is None:
            raise NotImplementedError(f"{type(self).__name__} does not implement register_kv_cache_layout")
        self.register_kv_caches(tensor)


class KvCacheConnectorSchedulerMain(_SchedulerBase):
    """main's scheduler base class."""

    supports_attention_dp: bool = False

    def request_finished_by_layer_group(self, request, cache_block_ids_by_layer_group: List[List[int]]) -> bool:
        if len(cache_block_ids_by_layer_group) != 1:
            raise NotImplementedError(f"{type(self).__name__} does not implement request_finished_by_layer_group")
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    def update_state_after_alloc_by_layer_group(self, request, block_ids_by_layer_group: List[List[int]]) -> None:
        if len(block_ids_by_layer_group) != 1:
            raise NotImplementedError(f"{type(self).__name__} does not implement update_state_after_alloc_by_layer_group")
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])

    def wait_for_initialization(self):
        """Called once by the executor at the end of its start-up."""
        return


# -- the engine's side: KvCacheConnectorManager -----------------------------------------


@dataclass
class _Async:
    saving: Dict[int, Any] = field(default_factory=dict)
    loading: Dict[int, Any] = field(default_factory=dict)

    def add_from(self, other: "_Async") -> None:
        self.saving.update(other.saving)
        self.loading.update(other.loading)
        other.saving, other.loading = {}, {}

    def extract(self, saving_ids, loading_ids) -> "_Async":
        out = _Async()
        for i in saving_ids:
            out.saving[i] = self.saving.pop(i)
        for i in loading_ids:
            out.loading[i] = self.loading.pop(i)
        return out


class _OutputRequest:
    def __init__(self):
        self.block_ids: list[int] = []
        self.tokens: list[int] = []

    def build(self, req, kv_cache_manager, main: bool):
        block_ids = kv_cache_manager.get_cache_indices(req)
        tokens = req.get_tokens(0)
        new_blocks, new_tokens = block_ids[len(self.block_ids):], tokens[len(self.tokens):]
        self.block_ids.extend(new_blocks)
        self.tokens.extend(new_tokens)
        if req.state in (LlmRequestState.CONTEXT_INIT, LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS):
            computed, scheduled = req.context_current_position, min(req.context_remaining_length, req.context_chunk_size)
        else:
            computed, scheduled = len(tokens) - 1, 1
        if main:
            return RequestDataMain(req.request_id, new_tokens, new_blocks, computed, scheduled,
                                   cache_salt=getattr(req, "cache_salt", None))
        return RequestData(req.request_id, new_tokens, new_blocks, computed, scheduled)


class KvCacheConnectorManager:
    """The engine's bookkeeping around a connector (not part of the connector API):
    calls the scheduler on rank 0 and broadcasts its answers, parks async loads and
    saves, and gathers what every rank reports finished."""

    main = False

    def __init__(self, worker, scheduler):
        if (scheduler is not None) != (mpi_rank() == 0):
            raise AssertionError("The scheduler may only exist on rank 0!")
        self.worker, self.scheduler = worker, scheduler
        self.new_async = _Async()
        self.pending_async = _Async()
        self.local_finished = _Async()
        self.finished_async_loading_requests: Dict[int, Any] = {}
        self._scheduler_output = None
        self._outputs: Dict[int, _OutputRequest] = {}
        self._external_loads: Dict[int, int] = {}

    def _run_on_leader(self, f: Callable[[], Any]) -> Any:
        return mpi_broadcast(f() if self.scheduler is not None else None, root=0)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """C++ ``addSequence`` (block reuse on) calls this with a C++ request copy."""
        if request.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        num_tokens, load_async = self._run_on_leader(
            lambda: self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens))
        if num_tokens == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        if load_async:
            self.new_async.loading[request.request_id] = request
        self._external_loads[request.request_id] = num_tokens
        return num_tokens

    def should_add_sequence(self, request) -> bool:
        return request.request_id not in self.finished_async_loading_requests

    def update_state_after_alloc(self, request, block_ids: List[int]) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, block_ids)

    def build_scheduler_output(self, context_requests, generation_requests, kv_cache_manager) -> None:
        out = SchedulerOutputMain() if self.main else SchedulerOutput()
        for req in context_requests:
            if req.request_id in self.new_async.loading:
                continue
            is_new = req.request_id not in self._outputs
            data = self._outputs.setdefault(req.request_id, _OutputRequest()).build(req, kv_cache_manager, self.main)
            if req.request_id in self._external_loads:
                data.computed_position -= self._external_loads[req.request_id]
            (out.new_requests if is_new else out.cached_requests).append(data)
        for req in generation_requests:
            out.cached_requests.append(self._outputs.setdefault(req.request_id, _OutputRequest()).build(
                req, kv_cache_manager, self.main))
        self._external_loads = {}
        self._scheduler_output = out

    def take_scheduled_requests_pending_load(self, context_requests: list) -> list:
        """The context requests that may run now; loading ones are parked (state
        DISAGG_GENERATION_TRANS_IN_PROGRESS) and the canonical request replaces the copy."""
        allowed = []
        for req in context_requests:
            if req.request_id in self.new_async.loading:
                req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
                self.new_async.loading[req.request_id] = req
            else:
                allowed.append(req)
        return allowed

    def handle_metadata(self) -> None:
        metadata = self._run_on_leader(lambda: self.scheduler.build_connector_meta(self._scheduler_output))
        self._scheduler_output = None
        self.worker.bind_connector_meta(metadata)

    def request_finished(self, req, cache_block_ids: List[int]) -> bool:
        self.finished_async_loading_requests.pop(req.request_id, None)
        saving = self._run_on_leader(lambda: self.scheduler.request_finished(req, cache_block_ids))
        if saving:
            self.new_async.saving[req.request_id] = req
            req.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        return bool(saving)

    def get_finished(self) -> list:
        """Requests every rank reports saved (returned) or loaded (back to CONTEXT_INIT)."""
        started = list(self.new_async.loading)
        finished_gen = list(self.new_async.saving)
        self.pending_async.add_from(self.new_async)
        saved, loaded = self.worker.get_finished(finished_gen, started)
        self.local_finished.add_from(self.pending_async.extract(saved, loaded))
        everyone = mpi_allgather((list(self.local_finished.saving), list(self.local_finished.loading)))
        all_saved = set.intersection(*[set(s) for s, _ in everyone])
        all_loaded = set.intersection(*[set(lo) for _, lo in everyone])
        done = self.local_finished.extract(all_saved, all_loaded)
        for rid, req in done.loading.items():
            req.state = LlmRequestState.CONTEXT_INIT
            self.finished_async_loading_requests[rid] = req
        return list(done.saving.values())

    def layer_pre_hook(self, layer_idx: int) -> None:
        self.worker.wait_for_layer_load(layer_idx, None)

    def layer_post_hook(self, layer_idx: int) -> None:
        self.worker.save_kv_layer(layer_idx, None)


class KvCacheConnectorManagerMain(KvCacheConnectorManager):
    """main's manager: the matched-token query and its commit are two steps, metadata is
    skipped without a scheduler output, and the scheduler's ``wait_for_initialization``
    runs at executor start-up."""

    main = True

    def query_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        num_tokens, load_async = self._run_on_leader(
            lambda: self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens))
        if num_tokens == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        return num_tokens, load_async

    def commit_new_matched_tokens(self, request, num_tokens: int, load_async: bool) -> None:
        if load_async:
            self.new_async.loading[request.request_id] = request
        self._external_loads[request.request_id] = num_tokens
        request.py_num_connector_matched_tokens = num_tokens  # lands on the C++ copy when called from C++

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if request.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        n, load_async = self.query_num_new_matched_tokens(request, num_computed_tokens)
        self.commit_new_matched_tokens(request, n, load_async)
        return n

    def handle_metadata(self) -> None:
        if self._scheduler_output is None:
            return
        super().handle_metadata()

    def wait_for_initialization(self) -> None:
        if self.scheduler is not None:
            self.scheduler.wait_for_initialization()
