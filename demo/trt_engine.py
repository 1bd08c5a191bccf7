"""The demo's "TensorRT-LLM side": one TensorRT-LLM rank (TP 1) whose executor is a
stand-in that drives the REAL kvbridge TensorRT-LLM connector in ``PyExecutor``'s call
order, with a tiny model runner (``kvbridge.demo.llama_runner.TinyLlamaRunner``, or any
runner with its interface) as the forward pass over a pool of TensorRT-LLM's geometry.

TensorRT-LLM itself cannot be installed on CPU hosts; what the connector sees is what
TensorRT-LLM's executor hands it (interfaces: ``tensorrt_llm/_torch/pyexecutor/
py_executor.py`` and ``kv_cache_connector.py``, commit 00fdcbff): ``ExecRequest`` has the
``LlmRequest`` fields the connector reads, ``BlockManager`` allocates a request's blocks
and defers freeing pinned ones (``AsyncTransferManager``), ``ConnectorManagerState`` is
``KvCacheConnectorManager``'s bookkeeping. ``TRTEngine.load`` runs a decode-half request
(the connector pulls its KV, then ``decode_loaded`` continues from the pool alone) and
``TRTEngine.serve_prefill`` a prefill-half one (the runner computes the prompt into the
pool, the connector serves it until a decode side pulled it).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import torch


# -- TensorRT-LLM's request and block bookkeeping ---------------------------------------
class ExecRequest:
    """The fields of TensorRT-LLM's LlmRequest the connector and this executor use."""

    def __init__(self, request_id, prompt_len, max_new_tokens, handle: bytes | None, prefix: int = 0):
        self.request_id = self.py_request_id = request_id
        self.prompt_len = prompt_len
        self._tokens = [(request_id * 7919 + i) % 32000 for i in range(prompt_len)]
        self.max_new_tokens = max_new_tokens
        self.py_disaggregated_params = (SimpleNamespace(request_type="context_and_generation", opaque_state=handle)
                                        if handle is not None else None)
        self.is_generation_only_request = False
        self.context_current_position = 0
        self.state = "CONTEXT_INIT"
        self.prefix = prefix  # tokens the KV cache manager finds on device (block reuse)
        self.cancelled = False

    def get_tokens(self, beam):
        """The request's tokens so far (prompt, then generated), as ``LlmRequest.get_tokens``."""
        return list(self._tokens)

    @property
    def context_remaining_length(self):
        return self.prompt_len - self.context_current_position

    @property
    def generated(self):
        return len(self._tokens) - self.prompt_len


class BlockManager:
    """Block ids for requests, the same sequence on every rank of a server; pinned
    blocks (a request saving asynchronously) are freed when unpinned."""

    def __init__(self, num_blocks, tpb, seed):
        self._free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.tpb, self.total = tpb, num_blocks
        self.blocks: dict[int, list[int]] = {}
        self.pinned: set[int] = set()
        self.deferred: set[int] = set()
        self.double_frees = 0
        self.ever: set[int] = set()

    @property
    def free_count(self):
        return len(self._free)

    def add_sequence(self, req) -> int:
        n = -(-(req.prompt_len + req.max_new_tokens) // self.tpb)
        if n > len(self._free):
            raise RuntimeError(f"out of blocks: {n} > {len(self._free)}")
        self.blocks[req.request_id], self._free = self._free[:n], self._free[n:]
        self.ever.update(self.blocks[req.request_id])
        return req.prefix  # prepopulatedPromptLen

    def get_cache_indices(self, req):
        return list(self.blocks[req.request_id])

    def free_resources(self, req):
        if req.request_id in self.pinned:
            self.deferred.add(req.request_id)
            return
        self._release(req.request_id)

    def _release(self, rid):
        ids = self.blocks.pop(rid)
        if set(ids) & set(self._free):
            self.double_frees += 1
        self._free.extend(ids)

    def pin(self, req):
        self.pinned.add(req.request_id)

    def unpin(self, rid):
        self.pinned.discard(rid)
        if rid in self.deferred:
            self.deferred.discard(rid)
            self._release(rid)


class ConnectorManagerState:
    """The bookkeeping of TensorRT-LLM's KvCacheConnectorManager (new / pending / locally
    finished async requests)."""

    def __init__(self, worker, scheduler):
        self.worker, self.scheduler = worker, scheduler
        self.new_loading, self.new_saving = {}, {}
        self.pending_loading, self.pending_saving = {}, {}
        self.local_loading, self.local_saving = {}, {}


# -- one TensorRT-LLM rank driving the connector ----------------------------------------
class TRTEngine:
    """One TensorRT-LLM rank (TP 1) with the kvbridge connector over the runner's pool.

    ``runner``: the forward pass (``allocate_pool(tokens_per_block=, num_blocks=)`` ->
    KVLayout whose ``tensors[0]`` is the pool ``[num_blocks, layers, kv_factor,
    heads * tokens_per_block * head_dim]``, ``layers``, ``prefill``, ``decode``; see
    ``TinyLlamaRunner``). ``model_dir``: the model folder the connector reads KV heads and
    head_dim from. ``cfg``: ``BridgeConfig`` settings (e.g. ``sglang_bootstrap_port`` to
    let SGLang decode servers find this rank's prefill rooms)."""

    def __init__(self, runner: Any, model_dir, *, tokens_per_block=32, num_blocks=64, **cfg):
        from kvbridge.adapters.trtllm import BridgeConfig, KVBridgeConnectorScheduler, KVBridgeConnectorWorker

        self.runner, self.tpb = runner, tokens_per_block
        self.layout = runner.allocate_pool(tokens_per_block=tokens_per_block, num_blocks=num_blocks)
        self.pool = self.layout.tensors[0]
        llm_args = SimpleNamespace(
            model=str(model_dir),  # KV heads and head_dim from its config, as the connector reads them
            kv_cache_config=SimpleNamespace(tokens_per_block=tokens_per_block, dtype="auto"),
            parallel_config=SimpleNamespace(tp_size=1, world_size=1),
        )
        conf = BridgeConfig(**{"host": "127.0.0.1", "protocol": "tcp", "scheduler_endpoint": "local",
                               "on_failure": "fail", **cfg})
        self.scheduler = KVBridgeConnectorScheduler(llm_args, config=conf)
        self.worker = KVBridgeConnectorWorker(llm_args, config=conf)
        self.kv_cache_manager = BlockManager(num_blocks, tokens_per_block, seed=12345)
        self.kv_connector_manager = ConnectorManagerState(self.worker, self.scheduler)
        self.active_requests: list = []
        self.cancelled: list[int] = []
        self._maybe_init_kv_connector_manager()

    def _maybe_init_kv_connector_manager(self):  # PyExecutor: the worker finds this executor
        self.worker.register_kv_caches(self.pool)

    def cancel_request(self, rid):
        """PyExecutor.cancel_request (the connector cancels a request whose load failed)."""
        self.cancelled.append(rid)

    def close(self):
        """Stop the connector (its bus, sender, receiver, transport and bootstrap endpoint)."""
        self.worker.close()
        self.scheduler.close()

    def _new(self, rid, prompt, max_new, handle: bytes):
        req = ExecRequest(rid, len(prompt), max_new, handle)
        req._tokens = [int(t) for t in prompt]
        self.active_requests.append(req)
        return req

    def _start_batch(self):  # _kv_connector_start_batch + the forward's layer hooks
        meta = self.scheduler.build_connector_meta(None)
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv(None)
        for layer in range(self.runner.layers):
            self.worker.wait_for_layer_load(layer, None)
            self.worker.save_kv_layer(layer, None)

    def _terminate(self, finished_gen, started_loading):  # get_finished (one rank: no allgather)
        return self.worker.get_finished(list(finished_gen), list(started_loading))

    # -- decode half ------------------------------------------------------------------
    def load(self, rid: int, prompt: Sequence[int], max_new: int, handle: bytes, timeout_s: float = 60.0):
        """A decode-half request: admitted, its KV loaded asynchronously by the connector;
        returns (request, how the load ended: the worker's ``finished_loads`` entry)."""
        kvm, sched = self.kv_cache_manager, self.scheduler
        req = self._new(rid, prompt, max_new, handle)
        prepop = kvm.add_sequence(req)
        n, load_async = sched.get_num_new_matched_tokens(req, prepop)
        assert load_async and n == len(prompt) - 1 - prepop, (n, load_async)
        req.context_current_position = prepop + n  # setPrepopulatedPromptLen
        sched.update_state_after_alloc(req, kvm.get_cache_indices(req))
        req.state = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
        started, end = [rid], time.monotonic() + timeout_s
        while True:  # nothing schedulable: only get_finished runs each iteration
            _, loaded = self._terminate([], started)
            started = []
            if rid in loaded:
                req.state = "CONTEXT_INIT"
                return req, self.worker.finished_loads[rid]
            if time.monotonic() > end:
                raise TimeoutError(f"request {rid} not loaded after {timeout_s} s")
            time.sleep(0.01)

    def decode_loaded(self, req, n: int) -> tuple[list[int], torch.Tensor]:
        """The engine's forward for a loaded request: the context step computes the prompt
        from ``context_current_position`` (the last prompt token, over the loaded KV) and
        yields the first token; then ``n - 1`` generation steps. Tokens read K/V only from
        the pool."""
        self._start_batch()
        blocks = self.kv_cache_manager.get_cache_indices(req)
        pos = req.context_current_position
        if pos != req.prompt_len - 1:
            raise AssertionError(f"request {req.request_id} resumes at {pos}, not at the last prompt token")
        self.worker.wait_for_save(None)
        toks, first = self.runner.decode(req.get_tokens(0)[pos], pos, n, self.pool, self.tpb, blocks)
        req._tokens.extend(toks)
        assert not self.scheduler.request_finished(req, blocks)  # a decode half keeps nothing
        self.kv_cache_manager.free_resources(req)
        self.active_requests.remove(req)
        return toks, first

    # -- prefill half -----------------------------------------------------------------
    def serve_prefill(self, rid: int, prompt: Sequence[int], handle: bytes, timeout_s: float = 60.0):
        """A prefill-half request (max_tokens 1): computed by the runner into the pool, its
        blocks held and served by the connector until a decode side pulled them. Returns
        (first token, its logits, block ids); how the send ended (with its handoff record)
        is ``self.worker.finished_saves[rid]``."""
        kvm, sched = self.kv_cache_manager, self.scheduler
        mgr = self.kv_connector_manager
        req = self._new(rid, prompt, 1, handle)
        prepop = kvm.add_sequence(req)
        assert sched.get_num_new_matched_tokens(req, prepop) == (0, False)
        sched.update_state_after_alloc(req, kvm.get_cache_indices(req))  # opens the room
        req.state = "CONTEXT_INIT"
        self._start_batch()
        blocks = kvm.get_cache_indices(req)
        first, logits = self.runner.prefill(prompt, self.pool, self.tpb, blocks)
        self.worker.wait_for_save(None)
        req.context_current_position = req.prompt_len
        req._tokens.append(first)  # the sampler
        req.state = "GENERATION_COMPLETE"
        assert sched.request_finished(req, blocks), "the prefill half must hold its blocks"
        kvm.pin(req)
        mgr.new_saving[rid] = req
        kvm.free_resources(req)  # _handle_responses: deferred while pinned
        self.active_requests.remove(req)
        gen, end = [rid], time.monotonic() + timeout_s
        while True:
            saved, _ = self._terminate(gen, [])
            gen = []
            if rid in saved:
                kvm.unpin(rid)
                return first, logits, blocks
            if time.monotonic() > end:
                raise TimeoutError(f"request {rid} not saved after {timeout_s} s")
            time.sleep(0.01)
