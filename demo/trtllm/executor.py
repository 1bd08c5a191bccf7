"""TensorRT-LLM's PyTorch executor, as far as a KV connector can tell, for one rank.

``create_py_executor`` follows ``_torch/pyexecutor/py_executor_creator.py``;
``PyExecutor.iteration`` follows ``py_executor.py``'s ``_executor_loop`` (overlap
scheduler off) and ``_executor_loop_overlap`` (on, the default); ``enqueue_request``
follows ``executor/base_worker.py`` ``_enqueue_request``. What a connector meets, and
what is enforced here as the real engine enforces it:

Creation
- A connector needs ``capacity_scheduler_policy == GUARANTEED_NO_EVICT``
  ("KV connector is only supported with guaranteed no evict scheduler policy."), and on
  1.2 no speculative decoding; the module named by ``kv_connector_config`` is imported
  by name, the worker built on every rank and the scheduler on rank 0, each from the
  LLM args only.
- Block reuse is turned off in the LLM args themselves, before the connector is built,
  with ``FORCE_DETERMINISTIC=1`` and for the FLASHINFER attention backends (with a
  warning); the connector sees the effective value. (MLA outside SM 90/100/103/120 and
  MLA with a non-FP8 quantized cache do the same on a GPU; not modelled on CPU.)
- ``tokens_per_block`` is ``kv_cache_config.tokens_per_block``, except ``max_num_tokens``
  for the VANILLA attention backend and 64 for MLA with FlashMLA; the LLM args the
  connector holds are NOT updated.
- ``_maybe_init_kv_connector_manager``: pipeline parallelism refused (main also refuses
  beam > 1 and ``host_cache_size``); ``register_kv_caches(get_unique_primary_pool())`` on
  every rank, called from the executor's own method; a pre- and a post-hook on every
  decoder layer (``wait_for_layer_load`` / ``save_kv_layer``); main then calls the
  scheduler's ``wait_for_initialization()``.
- The model (``PyExecutor.model_engine.model``) holds one attention module per decoder
  layer (``_torch/modules/attention.py``: ``layer_idx``, its backend in ``attn``); the
  TRTLLM backend keeps the fp8 KV scale as ``kv_cache_scaling_factor``, a ``[1]`` tensor
  of 1.0 (``attention_backend/trtllm.py``, ``TrtllmAttention.__init__``) shared by K
  and V: stored = value / scale, read = stored * scale. ``kv_scales`` (per layer) stands
  for a checkpoint whose calibrated scales were loaded there.

Requests
- ``context_only`` / ``generation_only`` requests need a cache transceiver (there is
  none here): refused; ``context_and_generation`` disaggregated params pass. On 1.2 the
  Python request does not carry them (``py_disaggregated_params`` exists on main only).

Each iteration (every rank in lockstep; rank 0's request queue is broadcast)
1. new requests and cancels from rank 0's queue (``executor_request_queue.py``
   ``_fetch_and_process_requests``): with nothing active the executor waits for the next
   item with no timeout, so an idle iteration does nothing at all (here: returns at once,
   counted in ``idle_waits``) until a request or a cancel is queued. A cancel's id goes
   to ``canceled_req_ids`` on every rank and leaves it only when it cancels an active
   request (``_handle_canceled_requests``); an id that matches none stays;
2. schedule context (chunked by ``max_num_tokens`` with ``enable_chunked_prefill``) and
   generation requests (capacity: every admitted request's blocks for prompt + max tokens);
3. ``prepare_resources``: a first context chunk gets ``add_sequence`` (device reuse,
   then the connector's ``get_num_new_matched_tokens`` with a C++ request copy) and
   ``update_state_after_alloc(python request, block ids)``; the scheduler output is built;
4. if anything is scheduled: loading requests are parked, ``build_connector_meta``
   (rank 0, broadcast), ``start_load_kv``; the forward with the layer hooks;
   ``wait_for_save`` (the end of ``_forward_step``, before sampling);
5. sampling (greedy). With the overlap scheduler a request's sampled token, its
   completion and ``request_finished`` come one iteration later (after that iteration's
   forward); ``request_finished`` True pins the blocks and sets
   ``DISAGG_CONTEXT_TRANS_IN_PROGRESS``;
6. cancels; responses; finished requests not in transfer are freed. On 1.2 with block
   reuse on, a request whose save is under way leaves ``active_requests`` too (its blocks
   stay pinned; ``_handle_responses``): with nothing else active the executor is idle
   (step 1) and calls no ``get_finished`` until something is queued;
7. ``get_finished`` on every rank, allgathered: loads back to ``CONTEXT_INIT`` (and not
   added again), saves unpinned and freed.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from ..paged_runner import PoolStore, SeqStep
from .dist import mpi_allgather, mpi_broadcast
from .kv_cache import DataType, KVCacheManager
from .request import LlmRequestState, LlmRequestType, PyLlmRequest
from .versions import EngineVersion

__all__ = ["DisaggregatedParams", "ExecutorRequest", "PyExecutor", "create_py_executor", "make_llm_args",
           "CONNECTOR_CONFIG"]

log = logging.getLogger(__name__)

# the plugin's own kv_connector_config (kvbridge.adapters.trtllm.KV_CONNECTOR_CONFIG), as
# trtllm-serve's YAML names it; imported lazily by the executor, as TensorRT-LLM does
CONNECTOR_CONFIG = {"connector_module": "kvbridge.adapters.trtllm",
                    "connector_scheduler_class": "KVBridgeConnectorScheduler",
                    "connector_worker_class": "KVBridgeConnectorWorker"}

_REQUEST_TYPES = {"context_and_generation": LlmRequestType.LLMREQUEST_TYPE_CONTEXT_AND_GENERATION,
                  "context_only": LlmRequestType.LLMREQUEST_TYPE_CONTEXT_ONLY,
                  "generation_only": LlmRequestType.LLMREQUEST_TYPE_GENERATION_ONLY}


@dataclass
class DisaggregatedParams:
    """``tensorrt_llm.disaggregated_params.DisaggregatedParams`` (the fields used here)."""

    request_type: str = "context_and_generation"
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None


@dataclass
class ExecutorRequest:
    """What ``LLM.generate`` / ``trtllm-serve`` hand the executor for one request."""

    input_token_ids: list[int]
    max_tokens: int
    disaggregated_params: DisaggregatedParams | None = None
    cache_salt: str | None = None


def make_llm_args(model: str, *, tp: int = 1, tokens_per_block: int = 32, enable_block_reuse: bool = True,
                  kv_dtype: str = "auto", capacity_scheduler_policy: str = "GUARANTEED_NO_EVICT",
                  disable_overlap_scheduler: bool = False, attn_backend: str = "TRTLLM", enable_flash_mla: bool = False,
                  max_num_tokens: int = 8192, enable_chunked_prefill: bool = False, connector: bool = True,
                  speculative_config: Any = None, pipeline_parallel_size: int = 1, max_beam_width: int = 1,
                  host_cache_size: int | None = None, cache_transceiver_config: Any = None,
                  use_kv_cache_manager_v2: bool | None = None, env_overrides: dict | None = None,
                  max_attention_window: list[int] | None = None, max_seq_len: int = 8192) -> SimpleNamespace:
    """LLM args (``TorchLlmArgs``) with the fields the executor and the connector read.
    ``env_overrides`` is carried to every rank in the LLM args (``worker_main`` would also
    apply it to each rank's environment; the stand-in does not, so a plugin must read it)."""
    return SimpleNamespace(
        model=model, backend="pytorch", tensor_parallel_size=tp, pipeline_parallel_size=pipeline_parallel_size,
        parallel_config=SimpleNamespace(tp_size=tp, pp_size=pipeline_parallel_size, world_size=tp * pipeline_parallel_size,
                                        enable_attention_dp=False),
        kv_cache_config=SimpleNamespace(tokens_per_block=tokens_per_block, enable_block_reuse=enable_block_reuse,
                                        dtype=kv_dtype, host_cache_size=host_cache_size, free_gpu_memory_fraction=0.9,
                                        use_kv_cache_manager_v2=use_kv_cache_manager_v2,
                                        max_attention_window=list(max_attention_window) if max_attention_window else None),
        scheduler_config=SimpleNamespace(capacity_scheduler_policy=capacity_scheduler_policy),
        disable_overlap_scheduler=disable_overlap_scheduler, attn_backend=attn_backend, enable_flash_mla=enable_flash_mla,
        max_num_tokens=max_num_tokens, enable_chunked_prefill=enable_chunked_prefill, max_beam_width=max_beam_width,
        speculative_config=speculative_config, cache_transceiver_config=cache_transceiver_config,
        kv_connector_config=SimpleNamespace(**CONNECTOR_CONFIG) if connector else None,
        enable_attention_dp=False, trust_remote_code=False, env_overrides=dict(env_overrides or {}),
        max_seq_len=max_seq_len)


def _model_kv_geometry(model_dir: str) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    if getattr(cfg, "kv_lora_rank", None):
        return {"mla": True, "layers": cfg.num_hidden_layers, "kv_heads": 1,
                "head_dim": int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)}
    heads = int(cfg.num_attention_heads)
    return {"mla": False, "layers": cfg.num_hidden_layers, "kv_heads": int(getattr(cfg, "num_key_value_heads", heads)),
            "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)}


def _head_slice(total: int, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads rank ``rank`` holds: ``ceil(total / tp)`` of them, replicated when tp > total."""
    per = -(-total // tp)
    if tp >= total:
        return rank * total // tp, 1
    return rank * per, per


def create_py_executor(llm_args: Any, *, version: EngineVersion, rank: int, world: int, pool_files: Sequence[str],
                       num_blocks: int, seed: int = 7, kv_scales: Sequence[float] | None = None) -> "PyExecutor":
    """The rank's executor: KV cache (its pool in ``pool_files[rank]``, shared memory the
    other ranks of the server read), the model runner and, when configured, the connector."""
    if llm_args.pipeline_parallel_size != 1 and llm_args.kv_connector_config is None:
        raise NotImplementedError("the stand-in runs pipeline parallelism only to refuse it with a connector")
    geo = _model_kv_geometry(llm_args.model)
    # py_executor_creator: the tokens per block the KV cache gets (a local: the config is not updated)
    tokens_per_block = int(llm_args.kv_cache_config.tokens_per_block)
    if llm_args.attn_backend == "VANILLA":
        tokens_per_block = int(llm_args.max_num_tokens)
    if geo["mla"] and llm_args.enable_flash_mla:
        tokens_per_block = 64
    # block reuse turned off in the LLM args, before the connector is built (py_executor_creator)
    kvc = llm_args.kv_cache_config
    if os.getenv("FORCE_DETERMINISTIC", "0") == "1":
        kvc.enable_block_reuse = False
    if str(llm_args.attn_backend) in ("FLASHINFER", "FLASHINFER_STAR_ATTENTION") and kvc.enable_block_reuse:
        log.warning("Disabling block reuse for %s backend", llm_args.attn_backend)
        kvc.enable_block_reuse = False
    connector_mgr = None
    cc = llm_args.kv_connector_config
    if cc is not None:
        if llm_args.scheduler_config.capacity_scheduler_policy != "GUARANTEED_NO_EVICT":
            raise NotImplementedError("KV connector is only supported with guaranteed no evict scheduler policy.")
        if llm_args.speculative_config is not None and version.name == "1.2":
            raise NotImplementedError("KV connector is not supported with speculative decoding.")
        module = importlib.import_module(cc.connector_module)
        worker_cls = getattr(module, cc.connector_worker_class)
        scheduler_cls = getattr(module, cc.connector_scheduler_class)
        worker = worker_cls(llm_args)
        scheduler = scheduler_cls(llm_args) if rank == 0 else None
        api = importlib.import_module(version.connector_module)
        connector_mgr = api.KvCacheConnectorManager(worker, scheduler)
    kv_dtype = "fp8" if "fp8" in str(llm_args.kv_cache_config.dtype).lower() else "auto"
    tp = int(llm_args.tensor_parallel_size)
    slices = [(0, 1)] * world if geo["mla"] else [_head_slice(geo["kv_heads"], tp, r) for r in range(world)]
    pools = _open_pools(pool_files, rank, num_blocks, geo, slices, tokens_per_block, kv_dtype, seed)
    kvm = KVCacheManager(pools[rank], tokens_per_block=tokens_per_block, num_kv_heads=geo["kv_heads"],
                         head_dim=geo["head_dim"], tp_size=tp, kv_factor=1 if geo["mla"] else 2,
                         dtype=DataType.FP8 if kv_dtype == "fp8" else DataType.FLOAT,
                         enable_block_reuse=llm_args.kv_cache_config.enable_block_reuse,
                         max_seq_len=int(llm_args.max_seq_len),
                         max_attention_window=llm_args.kv_cache_config.max_attention_window)
    # the TRTLLM attention backend writes HND inside a block; backends that address the pool
    # through KVCacheManager.get_buffers ([blocks, kv_factor, tokens, heads, head_dim]) write NHD
    order = "NHD" if str(llm_args.attn_backend).upper() in ("VANILLA", "FLASHINFER") else "HND"
    scales = list(kv_scales) if kv_scales else [1.0] * geo["layers"]
    store = PoolStore(pools, tokens_per_block, slices, own=rank, kv_dtype=kv_dtype, block_order=order,
                      kv_scales=scales)
    return PyExecutor(version=version, llm_args=llm_args, rank=rank, world=world, kv_cache_manager=kvm, store=store,
                      kv_connector_manager=connector_mgr, model=AttentionLayers(scales))


class AttentionLayers(torch.nn.Module):
    """The model as the KV connector can see it: one attention module per decoder layer,
    each with ``layer_idx`` and a backend (``attn``) holding ``kv_cache_scaling_factor``."""

    def __init__(self, scales: Sequence[float]):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for i, scale in enumerate(scales):
            m = torch.nn.Module()
            m.layer_idx = i
            m.attn = SimpleNamespace(kv_cache_scaling_factor=torch.full((1,), float(scale)))
            self.layers.append(m)


def _open_pools(files: Sequence[str], rank: int, num_blocks: int, geo: dict, slices, tpb: int, kv_dtype: str,
                seed: int) -> list[torch.Tensor]:
    """Each rank creates its own pool file (seeded garbage), then maps every rank's."""
    dtype = torch.uint8 if kv_dtype == "fp8" else torch.float32
    kvf = 1 if geo["mla"] else 2

    def shape(r):
        return (num_blocks, geo["layers"], kvf, slices[r][1] * tpb * geo["head_dim"])

    def numel(r):
        s = shape(r)
        return s[0] * s[1] * s[2] * s[3]

    mine = torch.from_file(files[rank], shared=True, size=numel(rank), dtype=dtype).view(shape(rank))
    b = mine.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    if dtype == torch.float32:  # garbage that is still finite: NaN/inf would poison any stray read visibly anyway
        mine.view(-1).clamp_(-1e4, 1e4).nan_to_num_(0.0)
    mpi_allgather(rank)  # every rank's file exists
    return [mine if r == rank else torch.from_file(files[r], shared=True, size=numel(r), dtype=dtype).view(shape(r))
            for r in range(len(files))]


@dataclass
class _Pending:
    """A sampled token the host has not applied yet (overlap scheduler)."""

    token: int
    complete: bool


@dataclass
class _Batch:
    requests: list = field(default_factory=list)
    sampled: dict[int, _Pending] = field(default_factory=dict)


class ExecutorRequestQueue:
    """Rank 0's request queue (``executor_request_queue.py``): requests and cancels from
    any thread; ``canceled_req_ids`` on every rank."""

    def __init__(self):
        self.request_queue: queue.Queue = queue.Queue()
        self.enqueue_lock = threading.Lock()
        self.canceled_req_ids: list[int] = []
        self.next_request_id = 1

    def enqueue_request(self, request: "ExecutorRequest") -> int:
        """The request's id, given under the lock it is queued under (``_enqueue_impl``)."""
        with self.enqueue_lock:
            rid = self.next_request_id
            self.next_request_id += 1
            self.request_queue.put((rid, request, False))
        return rid

    def enqueue_cancel_request(self, req_id: int) -> None:
        with self.enqueue_lock:
            self.request_queue.put((int(req_id), None, True))

    def take(self) -> list:
        """Every queued item (the executor's wait, when idle, ends at the first)."""
        items = []
        while True:
            try:
                items.append(self.request_queue.get_nowait())
            except queue.Empty:
                return items


class PyExecutor:
    """One rank's executor loop around the KV cache, the model and the connector."""

    def __init__(self, *, version: EngineVersion, llm_args: Any, rank: int, world: int, kv_cache_manager: KVCacheManager,
                 store: PoolStore, kv_connector_manager: Any, model: torch.nn.Module | None = None):
        from .runner import load_runner

        self.version = version
        self.llm_args = llm_args
        self.dist = SimpleNamespace(rank=rank, world_size=world, tp_size=int(llm_args.tensor_parallel_size),
                                    tp_rank=rank % int(llm_args.tensor_parallel_size),
                                    pp_size=int(llm_args.pipeline_parallel_size))
        self.kv_cache_manager = kv_cache_manager
        self.resource_manager = SimpleNamespace(resource_managers={"KV_CACHE_MANAGER": kv_cache_manager})
        self.kv_connector_manager = kv_connector_manager
        self.store = store
        self.model_engine = SimpleNamespace(model=model)
        self.runner = load_runner(llm_args.model)
        self.disable_overlap_scheduler = bool(llm_args.disable_overlap_scheduler)
        self.active_requests: list[PyLlmRequest] = []
        self.executor_request_queue = ExecutorRequestQueue()
        self.idle_waits = 0  # iterations spent waiting for a request (nothing active, nothing queued)
        self._previous: _Batch | None = None
        self._computed: dict[int, int] = {}
        self._first_logits: dict[int, list[float]] = {}  # the logits the first token was sampled from
        self._responded: set[int] = set()
        self.responses: dict[int, dict] = {}
        if kv_connector_manager is not None:
            self._maybe_init_kv_connector_manager()

    # -- start-up ------------------------------------------------------------------------
    def _maybe_init_kv_connector_manager(self) -> None:
        if self.dist.pp_size > 1:
            raise NotImplementedError("KV Cache Connector is not supported with pipeline parallelism.")
        if self.version.refuses_beam_and_host_cache:
            if int(self.llm_args.max_beam_width) > 1:
                raise NotImplementedError("KV Cache Connector is not supported with beam search (max_beam_width > 1).")
            if self.llm_args.kv_cache_config.host_cache_size:
                raise NotImplementedError("KV Cache Connector is not supported with KV cache host offloading "
                                          "(KvCacheConfig.host_cache_size).")
        kv_tensor = self.kv_cache_manager.get_unique_primary_pool()
        self.kv_connector_manager.worker.register_kv_caches(kv_tensor)
        self._layer_hooks = (self.kv_connector_manager.layer_pre_hook, self.kv_connector_manager.layer_post_hook)
        if self.version.wait_for_initialization:
            self.kv_connector_manager.wait_for_initialization()

    # -- requests ------------------------------------------------------------------------
    def enqueue_request(self, request: ExecutorRequest) -> int:
        """``BaseWorker._enqueue_request`` then the executor's queue (rank 0); the request id."""
        dp = request.disaggregated_params
        if dp is not None:
            if dp.request_type not in _REQUEST_TYPES:
                raise ValueError(f"unknown request_type {dp.request_type!r}")
            if dp.request_type != "context_and_generation":  # no cache transceiver in this engine
                raise AssertionError("kv_cache_transceiver is disabled, please set 'cache_transceiver_config: "
                                     "backend:<backend_type>` in config file for disaggregated serving")
        if not request.input_token_ids:
            raise ValueError("empty prompt")
        return self.executor_request_queue.enqueue_request(request)

    def cancel_request(self, request_id: int) -> None:
        """``PyExecutor.cancel_request`` (any thread): into the request queue, applied next iteration."""
        self.executor_request_queue.enqueue_cancel_request(request_id)

    def _activate(self, rid: int, er: ExecutorRequest) -> PyLlmRequest:
        dp = er.disaggregated_params
        rtype = _REQUEST_TYPES[dp.request_type] if dp is not None else LlmRequestType.LLMREQUEST_TYPE_CONTEXT_AND_GENERATION
        req = PyLlmRequest(version=self.version, request_id=rid, input_tokens=er.input_token_ids,
                           max_new_tokens=er.max_tokens, llm_request_type=rtype, cache_salt=er.cache_salt,
                           disaggregated_params=dp)
        self._computed[rid] = 0
        return req

    # -- one iteration -------------------------------------------------------------------
    def iteration(self) -> None:
        """One pass of the executor loop on this rank (collectives with the other ranks)."""
        mgr, kvm = self.kv_connector_manager, self.kv_cache_manager
        items = None
        if self.dist.rank == 0:
            items = self.executor_request_queue.take()
            if not items and not self.active_requests:
                items = None  # idle: rank 0 waits in the queue, the other ranks in the broadcast
        items = mpi_broadcast(items, root=0)
        if items is None:
            self.idle_waits += 1
            return
        for rid, er, cancel in items:
            if cancel:
                self.executor_request_queue.canceled_req_ids.append(rid)
            else:
                self.active_requests.append(self._activate(rid, er))
        ctx, gen = self._schedule()
        # prepare_resources
        for req in ctx:
            if req.is_first_context_chunk and (mgr is None or mgr.should_add_sequence(req)) \
                    and not kvm.holds(req.request_id):
                kvm.add_sequence(req, mgr)
                if mgr is not None:
                    mgr.update_state_after_alloc(req, kvm.get_cache_indices(req))
            if self.llm_args.enable_chunked_prefill:
                self._chunk(req)  # the micro-batch scheduler's chunk for this iteration
        for req in gen:
            kvm.add_token(req, self._gen_position(req))
        if mgr is not None:
            mgr.build_scheduler_output(ctx, gen, kvm)
        batch = _Batch()
        if ctx or gen:
            if mgr is not None:  # _kv_connector_start_batch
                ctx = mgr.take_scheduled_requests_pending_load(ctx)
                mgr.handle_metadata()
                mgr.worker.start_load_kv(None)
            if ctx or gen:
                self._forward(ctx, gen, batch)  # wait_for_save inside, after the model and before sampling
        if self.disable_overlap_scheduler:
            self._update_requests(batch)
            self._send_kv_async(batch.requests)
        else:
            previous, self._previous = self._previous, batch
            if previous is not None:
                self._update_requests(previous)
                self._send_kv_async(previous.requests)
        self._handle_canceled()
        self._handle_responses()
        if mgr is not None:
            saved = mgr.get_finished()
            for req in saved:  # saved on every rank: end_transfer, then terminate
                kvm.unpin(req.request_id)
                self._terminate(req)
            if saved:
                self.active_requests = [r for r in self.active_requests if r not in saved]

    def _schedule(self) -> tuple[list, list]:
        """GUARANTEED_NO_EVICT: context requests while every admitted request's prompt +
        max tokens fit in the blocks; chunks within ``max_num_tokens``."""
        kvm, tpb = self.kv_cache_manager, self.kv_cache_manager.tokens_per_block
        budget = int(self.llm_args.max_num_tokens)
        reserved = sum(-(-(r.prompt_len + r.max_new_tokens) // tpb) for r in self.active_requests
                       if kvm.holds(r.request_id) or r.state != LlmRequestState.CONTEXT_INIT)
        gen = [r for r in self.active_requests if r.state == LlmRequestState.GENERATION_IN_PROGRESS]
        budget -= len(gen)
        ctx = []
        for r in self.active_requests:
            if r.state != LlmRequestState.CONTEXT_INIT or budget <= 0:
                continue
            if not kvm.holds(r.request_id):
                need = -(-(r.prompt_len + r.max_new_tokens) // tpb)
                if reserved + need > kvm.max_blocks:
                    continue
                reserved += need
            ctx.append(r)
            budget -= r.context_remaining_length
        return ctx, gen

    def _chunk(self, req: PyLlmRequest) -> None:
        """Chunked prefill: this iteration's chunk within ``max_num_tokens``. Without it the
        scheduler never sets a chunk: a request's chunk is its prompt, cut only by
        ``setPrepopulatedPromptLen`` (``microBatchScheduler.cpp``)."""
        req.context_chunk_size = max(1, min(req.context_remaining_length, int(self.llm_args.max_num_tokens)))

    def _gen_position(self, req: PyLlmRequest) -> int:
        """Where the coming generation step's input token sits."""
        pend = self._previous.sampled.get(req.request_id) if self._previous is not None else None
        n = req.get_num_tokens(0)
        return n if pend is not None else n - 1

    def _forward(self, ctx: list, gen: list, batch: _Batch) -> None:
        """The model over the batch, with the connector's layer hooks; greedy sampling."""
        kvm = self.kv_cache_manager
        seqs = []
        for req in ctx:
            if req.context_remaining_length <= 0:  # a loaded request resumes at its last prompt token
                raise AssertionError(f"request {req.request_id} scheduled with no context left")
            if req.context_chunk_size <= 0:  # LlmRequest::moveToNextContextChunk's check, in the engine
                raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: Full context out of bounds (request "
                                   f"{req.request_id} at {req.context_current_position} of {req.prompt_len} with "
                                   "no chunk to compute)")
            a = req.context_current_position
            b = min(req.prompt_len, a + req.context_chunk_size)
            toks = req.get_tokens(0)[a:b]
            seqs.append(SeqStep(toks, a, kvm.get_cache_indices(req)))
            self._computed[req.request_id] += b - a
        for req in gen:
            pend = self._previous.sampled.get(req.request_id) if self._previous is not None else None
            pos = self._gen_position(req)
            tok = pend.token if pend is not None else req.get_tokens(0)[-1]
            seqs.append(SeqStep([tok], pos, kvm.get_cache_indices(req)))
        pre, post = getattr(self, "_layer_hooks", (None, None))
        logits = self.runner.forward_batch(seqs, self.store, pre, post)
        if self.kv_connector_manager is not None:  # _forward_step ends with _kv_connector_wait_for_save
            self.kv_connector_manager.worker.wait_for_save(None)
        # sampling and the requests' state updates follow (_sample_async, _update_request_states)
        for req, lg in zip(ctx + gen, logits):
            if req in ctx:
                req.move_to_next_context_chunk()
                if req.context_remaining_length > 0:
                    continue  # more chunks: nothing sampled yet
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
            tok = int(lg[-1].argmax())
            if req.get_num_tokens(0) == req.prompt_len and not self._pending(req):
                self._first_logits[req.request_id] = lg[-1].tolist()
            generated = req.get_num_tokens(0) - req.prompt_len + (1 if self._pending(req) else 0)
            done = generated + 1 >= req.max_new_tokens
            batch.sampled[req.request_id] = _Pending(tok, done)
            if done:
                req.state = LlmRequestState.GENERATION_TO_COMPLETE
            batch.requests.append(req)

    def _pending(self, req) -> bool:
        """Whether ``req`` has a sampled token the host has not applied (overlap scheduler)."""
        return self._previous is not None and req.request_id in self._previous.sampled

    def _update_requests(self, batch: _Batch) -> None:
        """The host applies a batch's sampled tokens (completion included)."""
        for req in batch.requests:
            p = batch.sampled[req.request_id]
            if req.state in (LlmRequestState.GENERATION_COMPLETE,):
                continue
            req.add_new_token(p.token, 0)
            if p.complete:
                req._finish("length")

    def _send_kv_async(self, requests: list) -> None:
        """``request_finished`` for each finished request; True pins its blocks."""
        mgr = self.kv_connector_manager
        if mgr is None:
            return
        for req in requests:
            if req.is_finished and req.state == LlmRequestState.GENERATION_COMPLETE \
                    and self.kv_cache_manager.holds(req.request_id):  # not terminated (cancelled) meanwhile
                if mgr.request_finished(req, self.kv_cache_manager.get_cache_indices(req)):
                    self.kv_cache_manager.store_blocks_for_reuse(req, True)  # AsyncTransferManager.start_transfer

    def _handle_canceled(self) -> None:
        """An active request whose id was cancelled finishes as cancelled and its id leaves
        ``canceled_req_ids``; an id that matches no active request stays there."""
        ids = self.executor_request_queue.canceled_req_ids
        if not ids:
            return
        for req in self.active_requests:
            if req.request_id in ids and req.state not in (LlmRequestState.GENERATION_COMPLETE,
                                                          LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS):
                req._finish("cancelled")
                ids.remove(req.request_id)

    def _handle_responses(self) -> None:
        kvm = self.kv_cache_manager
        keep = []
        for req in self.active_requests:
            finished = req.state in (LlmRequestState.GENERATION_COMPLETE, LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
            if finished and req.request_id not in self._responded:
                self._responded.add(req.request_id)
                self.responses[req.request_id] = {
                    "request_id": req.request_id, "output_token_ids": req.get_tokens(0)[req.prompt_len:],
                    "finish_reason": req._core.finish_reason, "prompt_len": req.prompt_len,
                    "context_tokens_computed": self._computed.get(req.request_id, 0),
                    "first_logits": self._first_logits.pop(req.request_id, None),
                    "blocks": self.kv_cache_manager.get_cache_indices(req) if self.kv_cache_manager.holds(req.request_id)
                    else []}
            if req.state == LlmRequestState.GENERATION_COMPLETE:
                self._terminate(req)
            elif (req.state == LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS and self.version.drops_saving_requests
                  and kvm.enable_block_reuse):
                pass  # 1.2: terminated while its save is under way (blocks pinned); get_finished frees it
            else:  # running, loading, or held until its save finishes
                keep.append(req)
        self.active_requests = keep

    def _terminate(self, req: PyLlmRequest) -> None:
        """Free a finished request's blocks (the caller drops it from ``active_requests``)."""
        if self.kv_cache_manager.holds(req.request_id):
            self.kv_cache_manager.free_resources(req)

