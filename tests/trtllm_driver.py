"""A stand-in for TensorRT-LLM's executor that drives the kvbridge connector in its order.

One OS process per rank (as TensorRT-LLM's MPI ranks), each with a primary pool of
TensorRT-LLM's exact geometry ``[blocks, layers, kv_factor, heads*tokens_per_block*head_dim]``
filled from a seed, a fake KV cache manager (block ids identical on every rank of a
server, pinning as ``AsyncTransferManager`` does) and ``FakeExecutor``, whose
``iteration`` follows ``PyExecutor._executor_loop`` (tensorrt_llm/_torch/pyexecutor/
py_executor.py, commit 00fdcbff) and ``KvCacheConnectorManager`` (kv_cache_connector.py):

  _fetch_and_activate_new_requests            (+ cancels broadcast from rank 0's queue)
  _prepare_disagg_gen_init -> prepare_resources -> addSequence:
      get_num_new_matched_tokens  [rank 0, broadcast: _run_on_leader]
      setPrepopulatedPromptLen; update_state_after_alloc(get_cache_indices) [rank 0]
  mark_ready_requests; _schedule
  if can_queue:
      _kv_connector_start_batch: build_connector_meta [rank 0, broadcast],
          bind_connector_meta, start_load_kv
      _forward_step: wait_for_layer_load / save_kv_layer per layer, wait_for_save
      _update_requests (the sampler appends a token)
      _send_kv_async: request_finished(get_cache_indices) [rank 0, broadcast];
          True -> AsyncTransferManager.start_transfer (pin)
      _handle_canceled_requests; _handle_responses (finished -> free_resources)
  _kv_connector_terminate_requests: get_finished -> mpi_allgather -> intersection;
      loaded -> CONTEXT_INIT; saved -> end_transfer (unpin)

Collectives (broadcast, allgather) are done by the parent test, which drives every rank
of a server through an iteration in lockstep (``Server.step``). The decode "model"
writes, for each token it computes, the K/V the prefill pool holds for that token, so
a decode pool must end up byte-identical to the prefill's whatever path the KV took;
``computed`` counts what the model computed, to tell a transfer from a recompute.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from types import SimpleNamespace

import numpy as np
import torch
from kvhelpers import install_test_hooks, stop_process

# TensorRT-LLM's request, KV cache manager and connector-manager bookkeeping: the library's
# executor stand-in (kvbridge.demo.trt_engine), under the names these tests gave them
from kvbridge.demo.trt_engine import BlockManager as FakeKVCacheManager
from kvbridge.demo.trt_engine import ConnectorManagerState as FakeConnectorManager
from kvbridge.demo.trt_engine import ExecRequest as FakeRequest

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


# -- pools ------------------------------------------------------------------------------
def pool_spec(*, layers=2, total_heads=4, head_dim=32, dtype="bf16", tpb=32, blocks=32, tp=1, rank=0, mla=False, seed=1):
    return dict(layers=layers, total_heads=1 if mla else total_heads, head_dim=head_dim, dtype=dtype, tpb=tpb,
                blocks=blocks, tp=tp, rank=rank, mla=mla, seed=seed)


def make_pool(spec: dict) -> torch.Tensor:
    """A primary pool of TensorRT-LLM's geometry for ``spec``'s rank, filled from its seed."""
    from kvbridge.layout import tp_head_slice

    heads = 1 if spec["mla"] else tp_head_slice(spec["total_heads"], spec["tp"], spec["rank"])[1]
    pool = torch.empty(spec["blocks"], spec["layers"], 1 if spec["mla"] else 2, heads * spec["tpb"] * spec["head_dim"],
                       dtype=TORCH_DTYPES[spec["dtype"]])
    b = pool.view(-1).view(torch.uint8)
    g = torch.Generator().manual_seed(spec["seed"])
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return pool


def spec_layout(spec: dict, pool: torch.Tensor):
    from kvbridge.adapters.trtllm import RankGeometry, pool_layout

    geo = RankGeometry(tokens_per_block=spec["tpb"], total_kv_heads=0 if spec["mla"] else spec["total_heads"],
                       tp_size=spec["tp"], tp_rank=spec["rank"], dtype="fp8" if spec["dtype"] == "fp8" else "")
    return pool_layout(pool, geo)


def unit_offsets(lay, blocks, tokens, heads_local) -> np.ndarray:
    """Byte offsets ``[layers, kv, tokens, heads, head_bytes]`` into the pool, from first
    principles (block id, slot, strides); token t lives in ``blocks[t // tpb]``."""
    blocks = np.asarray(blocks, dtype=np.int64)
    t = np.asarray(tokens, dtype=np.int64)
    blk, slot = blocks[t // lay.tokens_per_block], t % lay.tokens_per_block
    h = np.asarray(heads_local, dtype=np.int64)
    rel = (lay.base - lay.regions[0].addr)[:, :, None, None, None]
    return (rel + (blk * lay.block_stride + slot * lay.token_stride)[None, None, :, None, None]
            + (h * lay.head_stride)[None, None, None, :, None] + np.arange(lay.head_bytes)[None, None, None, None, :])


class Reference:
    """What a decode rank's pool must hold for a request: the prefill ranks' pools
    (rebuilt from their seeds) at the prefill's blocks, for this rank's heads."""

    def __init__(self):
        self._pools: dict[int, tuple] = {}

    def _prefill(self, spec):
        key = spec["seed"]
        if key not in self._pools:
            pool = make_pool(spec)
            self._pools[key] = (pool.view(-1).view(torch.uint8).numpy(), spec_layout(spec, pool))
        return self._pools[key]

    def tokens(self, lay, src: dict, tokens) -> np.ndarray:
        """Bytes ``[layers, kv, tokens, heads of lay, head_bytes]`` for ``lay``'s heads."""
        out = np.empty((lay.num_layers, lay.kv_factor, len(tokens), lay.num_heads, lay.head_bytes), dtype=np.uint8)
        for j, g in enumerate(lay.heads):
            for spec in src["specs"]:  # any prefill rank holding global head g (replicas are identical)
                data, slay = self._prefill(spec)
                if g in slay.heads:
                    out[:, :, :, j:j + 1] = data[unit_offsets(slay, src["blocks"], tokens, [g - slay.head_offset])]
                    break
            else:
                raise AssertionError(f"no prefill rank holds head {g}")
        return out


# -- the executor -----------------------------------------------------------------------
class FakeExecutor:
    def __init__(self, rank, spec, worker, scheduler, reference: Reference | None):
        self.rank = rank
        self.pool = make_pool(spec)
        self.kv_cache_manager = FakeKVCacheManager(spec["blocks"], spec["tpb"], seed=12345)
        self.kv_connector_manager = FakeConnectorManager(worker, scheduler)
        self.active_requests: list[FakeRequest] = []
        self.cancel_queue: list[int] = []
        self.canceled_ids: set[int] = set()
        self.reference = reference
        self.sources: dict[int, dict] = {}
        self.computed: dict[int, int] = {}
        self.results: dict[int, dict] = {}
        self.layers = spec["layers"]
        self._maybe_init_kv_connector_manager()
        self.layout = worker.layout
        self.snapshot = self.pool.view(-1).view(torch.uint8).numpy().copy()

    def _maybe_init_kv_connector_manager(self):  # PyExecutor._maybe_init_kv_connector_manager
        self.kv_connector_manager.worker.register_kv_caches(self.pool)

    def cancel_request(self, rid):  # PyExecutor.cancel_request: into rank 0's request queue
        self.cancel_queue.append(rid)

    def _pool_bytes(self):
        return self.pool.view(-1).view(torch.uint8).numpy()

    def _model_writes(self, req, start, stop):
        """The decode "model": computing tokens [start, stop) writes their reference K/V."""
        self.computed[req.request_id] = self.computed.get(req.request_id, 0) + (stop - start)
        src = self.sources.get(req.request_id)
        if src is None or stop <= start:
            return
        lay = self.layout
        toks = np.arange(start, stop)
        off = unit_offsets(lay, self.kv_cache_manager.blocks[req.request_id], toks, range(lay.num_heads))
        self._pool_bytes()[off] = self.reference.tokens(lay, src, toks)

    def _verify(self, req):
        src = self.sources.get(req.request_id)
        if src is None:
            return None
        lay, toks = self.layout, np.arange(req.prompt_len)
        off = unit_offsets(lay, self.kv_cache_manager.blocks[req.request_id], toks, range(lay.num_heads))
        return bool(np.array_equal(self._pool_bytes()[off], self.reference.tokens(lay, src, toks)))

    def iteration(self, new_requests, cancels):
        """One executor iteration; yields ("bcast", value) / ("allgather", value) at collectives."""
        mgr, kvm, worker, sched = self.kv_connector_manager, self.kv_cache_manager, self.kv_connector_manager.worker, \
            self.kv_connector_manager.scheduler
        lead = self.rank == 0
        # _fetch_and_activate_new_requests
        self.canceled_ids.update(cancels)
        new = []
        for spec in new_requests:
            req = FakeRequest(spec["id"], spec["prompt_len"], spec["max_new_tokens"], spec.get("handle"),
                              spec.get("prefix", 0))
            if spec.get("source"):
                self.sources[req.request_id] = spec["source"]
            self.active_requests.append(req)
            new.append(req)
        # _prepare_disagg_gen_init -> KVCacheManager.prepare_resources -> C++ addSequence
        for req in new:
            prepop = kvm.add_sequence(req)
            if prepop and self.reference is not None:  # blocks found on device already hold the prefix
                self._model_writes(req, 0, prepop)
                self.computed[req.request_id] = 0
            assert not req.is_generation_only_request
            n, load_async = yield ("bcast", sched.get_num_new_matched_tokens(req, prepop) if lead else None)
            assert not (n == 0 and load_async), "load_kv_async must be False when num_tokens is 0"
            if load_async:
                mgr.new_loading[req.request_id] = req
            req.context_current_position = prepop + n  # setPrepopulatedPromptLen
            if lead:
                sched.update_state_after_alloc(req, kvm.get_cache_indices(req))
            req.state = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
        for req in new:  # mark_ready_requests
            if req.request_id not in mgr.new_loading:
                req.state = "CONTEXT_INIT"
        # _schedule
        ctx = [r for r in self.active_requests if r.state == "CONTEXT_INIT"]
        gen = [r for r in self.active_requests if r.state == "GENERATION_IN_PROGRESS"]
        if ctx or gen:  # can_queue
            # _kv_connector_start_batch
            meta = yield ("bcast", sched.build_connector_meta(None) if lead else None)
            worker.bind_connector_meta(meta)
            worker.start_load_kv(None)
            # _forward_step: the DecoderLayer pre/post hooks, then wait_for_save
            for layer in range(self.layers):
                worker.wait_for_layer_load(layer, None)
                worker.save_kv_layer(layer, None)
            for req in ctx:
                self._model_writes(req, req.context_current_position, req.prompt_len)
            worker.wait_for_save(None)
            # _update_requests: the sampler appends one token to every scheduled request
            for req in ctx + gen:
                if req in ctx:
                    req.context_current_position = req.prompt_len
                    req.state = "GENERATION_IN_PROGRESS"
                req._tokens.append(50000 + req.request_id)
                if req.generated >= req.max_new_tokens:
                    req.state = "GENERATION_COMPLETE"
            # _send_kv_async: request_finished for finished requests
            for req in ctx + gen:
                if req.state == "GENERATION_COMPLETE":
                    saving = yield ("bcast", sched.request_finished(req, kvm.get_cache_indices(req)) if lead else None)
                    if saving:
                        mgr.new_saving[req.request_id] = req
                        req.state = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"
                        kvm.pin(req)  # AsyncTransferManager.start_transfer
            # _handle_canceled_requests
            for req in self.active_requests:
                if req.request_id in self.canceled_ids and req.state != "GENERATION_COMPLETE":
                    req.cancelled = True
                    req.state = "GENERATION_COMPLETE"
                    self.canceled_ids.discard(req.request_id)
            # _handle_responses: finished requests are answered and terminated
            keep = []
            for req in self.active_requests:
                if req.state in ("GENERATION_COMPLETE", "DISAGG_CONTEXT_TRANS_IN_PROGRESS"):
                    self.results[req.request_id] = {"tokens": req.generated, "cancelled": req.cancelled,
                                                    "computed": self.computed.get(req.request_id, 0),
                                                    "kv_ok": self._verify(req)}
                    kvm.free_resources(req)
                else:
                    keep.append(req)
            self.active_requests = keep
        # _kv_connector_terminate_requests -> KvCacheConnectorManager.get_finished
        started, finished_gen = list(mgr.new_loading), list(mgr.new_saving)
        mgr.pending_loading.update(mgr.new_loading)
        mgr.pending_saving.update(mgr.new_saving)
        mgr.new_loading, mgr.new_saving = {}, {}
        saved, loaded = worker.get_finished(finished_gen, started)
        for rid in saved:
            mgr.local_saving[rid] = mgr.pending_saving.pop(rid)
        for rid in loaded:
            mgr.local_loading[rid] = mgr.pending_loading.pop(rid)
        everyone = yield ("allgather", (sorted(mgr.local_saving), sorted(mgr.local_loading)))
        all_saved = set.intersection(*[set(s) for s, _ in everyone])
        all_loaded = set.intersection(*[set(lo) for _, lo in everyone])
        for rid in all_loaded:
            mgr.local_loading.pop(rid).state = "CONTEXT_INIT"
        for rid in all_saved:
            mgr.local_saving.pop(rid)
            kvm.unpin(rid)  # AsyncTransferManager.end_transfer

    def summary(self):
        out, self.cancel_queue = self.cancel_queue, []
        return {"cancels": out, "active": len(self.active_requests), "free": self.kv_cache_manager.free_count,
                "results": dict(self.results)}

    def final_check(self):
        kvm = self.kv_cache_manager
        mask = np.zeros(self.snapshot.size, dtype=bool)
        lay = self.layout
        for b in kvm.ever:  # every byte of every block a request ever held
            mask[b * lay.block_stride:(b + 1) * lay.block_stride] = True
        now = self._pool_bytes()
        return {"free": kvm.free_count, "total": kvm.total, "double_frees": kvm.double_frees,
                "pinned": len(kvm.pinned), "untouched_ok": bool(np.array_equal(now[~mask], self.snapshot[~mask])),
                "finished_loads": dict(self.kv_connector_manager.worker.finished_loads),
                "sender_rooms": len(self.kv_connector_manager.worker.sender._rooms),
                "receiver_rooms": len(self.kv_connector_manager.worker.receiver._rooms),
                "declined": dict(self.kv_connector_manager.worker.declined),
                "fallbacks": dict(self.kv_connector_manager.scheduler.fallbacks) if self.kv_connector_manager.scheduler else {},
                "metrics": _metric_samples()}


def _metric_samples() -> dict:
    """This process's kvbridge Prometheus samples the tests look at."""
    from prometheus_client import REGISTRY

    get = REGISTRY.get_sample_value
    return {"fallbacks_below_break_even": get("kvbridge_fallbacks_total", {"role": "receiver", "reason": "below_break_even"}),
            "fallbacks_handoff_failed": get("kvbridge_fallbacks_total", {"role": "receiver", "reason": "handoff_failed"}),
            "sender_declined": get("kvbridge_handoffs_total", {"role": "sender", "result": "declined", "plan": "none"})}


# -- the rank process -------------------------------------------------------------------
def rank_main(conn, spec: dict, cfg: dict, is_decode: bool) -> None:
    install_test_hooks(cfg.pop("hooks", None))  # fault tests: network namespace, throttled writes
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    for k, v in cfg.items():
        os.environ["KVBRIDGE_" + k.upper()] = str(v)
    from kvbridge.adapters.trtllm import KVBridgeConnectorScheduler, KVBridgeConnectorWorker

    llm_args = SimpleNamespace(
        model=None,
        kv_cache_config=SimpleNamespace(tokens_per_block=spec["tpb"], dtype="fp8" if spec["dtype"] == "fp8" else "auto"),
        parallel_config=SimpleNamespace(tp_size=spec["tp"], world_size=spec["tp"]),
    )
    scheduler = worker = None
    try:
        scheduler = KVBridgeConnectorScheduler(llm_args) if spec["rank"] == 0 else None
        worker = KVBridgeConnectorWorker(llm_args)
        ex = FakeExecutor(spec["rank"], spec, worker, scheduler, Reference() if is_decode else None)
    except Exception as e:
        conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
        raise
    conn.send(("ready", scheduler.endpoint if scheduler else "", worker.sender.endpoint, ex.kv_cache_manager.free_count))
    try:
        while True:
            cmd = conn.recv()
            try:
                if cmd[0] == "stop":
                    conn.send(("stopped",))
                    return
                if cmd[0] == "step":
                    gen = ex.iteration(cmd[1], cmd[2])
                    try:
                        req = next(gen)
                        while True:
                            conn.send(("coll",) + req)
                            req = gen.send(conn.recv()[1])
                    except StopIteration:
                        pass
                    conn.send(("done", ex.summary()))
                elif cmd[0] == "blocks":
                    conn.send(("blocks", ex.kv_cache_manager.blocks.get(cmd[1])))
                elif cmd[0] == "check":
                    conn.send(("check", ex.final_check()))
                else:
                    raise ValueError(cmd[0])
            except Exception as e:
                conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        if worker is not None:
            worker.close()
        if scheduler is not None:
            scheduler.close()


# -- the parent side --------------------------------------------------------------------
class Server:
    """The ranks of one TensorRT-LLM server, each in its own process, driven in lockstep."""

    def __init__(self, specs: list[dict], cfg: dict, is_decode: bool):
        ctx = mp.get_context("spawn")
        self.specs, self.ranks, self.cancels = specs, [], []
        self.sender_endpoints = []
        for spec in specs:
            rcfg = dict(cfg, tp_rank=spec["rank"], tp_size=spec["tp"], world_size=spec["tp"])
            rcfg["scheduler_endpoint"] = self.bus if spec["rank"] > 0 else "local"
            if not spec["mla"]:
                rcfg["num_kv_heads"] = spec["total_heads"]
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(child, spec, rcfg, is_decode), daemon=True)
            proc.start()
            self.ranks.append((parent, proc))
            msg = self._recv(parent, 120)
            assert msg[0] == "ready", msg
            if spec["rank"] == 0:
                self.bus = msg[1]
            self.sender_endpoints.append(msg[2])
            self.free0 = msg[3]
        self.last = None

    @staticmethod
    def _recv(conn, timeout=60):
        if not conn.poll(timeout):
            raise TimeoutError(f"rank did not answer within {timeout} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise AssertionError(msg[1])
        return msg

    def step(self, new_requests=()):
        """One executor iteration on every rank, doing the collectives between them."""
        for conn, _ in self.ranks:
            conn.send(("step", list(new_requests), self.cancels))
        while True:
            msgs = [self._recv(conn) for conn, _ in self.ranks]
            if msgs[0][0] == "done":
                assert all(m[0] == "done" for m in msgs), msgs
                self.cancels = msgs[0][1]["cancels"]  # rank 0's request queue, broadcast next iteration
                self.last = [m[1] for m in msgs]
                return self.last
            kinds = {m[1] for m in msgs}
            assert len(kinds) == 1, f"ranks diverged at a collective: {msgs}"
            val = msgs[0][2] if msgs[0][1] == "bcast" else [m[2] for m in msgs]
            for conn, _ in self.ranks:
                conn.send(("val", val))

    def ask(self, *cmd, rank=0):
        conn = self.ranks[rank][0]
        conn.send(cmd)
        return self._recv(conn)[1]

    def check(self):
        return [self.ask("check", rank=r) for r in range(len(self.ranks))]

    def stop(self):
        for conn, proc in self.ranks:
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                    conn.poll(5)
                except (BrokenPipeError, OSError):
                    pass
        for _, proc in self.ranks:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def run_until(servers, done, timeout_s=60.0, pause_s=0.005):
    """Step every server until ``done()`` holds; returns the iterations it took."""
    end, n = time.monotonic() + timeout_s, 0
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(f"not done after {n} iterations: {[s.last for s in servers]}")
        for s in servers:
            s.step()
        n += 1
        time.sleep(pause_s)
    return n


# -- the cache transceiver ----------------------------------------------------------------
class TransceiverKVCacheManager(FakeKVCacheManager):
    """The KVCacheManager surface the transceiver reads (resource_manager.py KVCacheManager)."""

    def __init__(self, spec):
        super().__init__(spec["blocks"], spec["tpb"], seed=12345)
        from kvbridge.layout import tp_head_slice

        self.pool = make_pool(spec)
        self.tokens_per_block, self.head_dim = spec["tpb"], spec["head_dim"]
        self.kv_factor = 1 if spec["mla"] else 2
        heads = 1 if spec["mla"] else tp_head_slice(spec["total_heads"], spec["tp"], spec["rank"])[1]
        self.num_kv_heads_per_layer = [heads] * spec["layers"]
        self.total_num_kv_heads_per_layer = [spec["total_heads"]] * spec["layers"]
        self.layer_offsets = {layer: layer for layer in range(spec["layers"])}

    def get_unique_primary_pool(self):
        return self.pool


class OneRankDist:
    """``Distributed`` of a one-rank server."""

    def allgather(self, obj):
        return [obj]


def transceiver_main(conn, spec: dict, cfg: dict) -> None:
    """One rank running ``KVBridgeCacheTransceiver`` in py_executor.py's call order."""
    install_test_hooks(cfg.pop("hooks", None))
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.adapters.trtllm import BridgeConfig, KVBridgeCacheTransceiver

    mgr = TransceiverKVCacheManager(spec)
    tx = KVBridgeCacheTransceiver(SimpleNamespace(tp_rank=0, tp_size=1), OneRankDist(), mgr, None,
                                  SimpleNamespace(kv_transfer_timeout_ms=None), config=BridgeConfig(**cfg))
    ref, reqs = Reference(), {}
    conn.send(("ready", tx.endpoints, mgr.free_count))

    def handle(op, *args):
        if op == "context":  # a context-only request finished its context step
            rid, prompt_len = args
            req = reqs[rid] = FakeRequest(rid, prompt_len, 1, None)
            mgr.add_sequence(req)
            req.context_current_position = prompt_len
            req._tokens.append(50000 + rid)  # the sampler's first token
            tx.respond_and_send_async(req)  # _send_kv_async
            mgr.pin(req)  # AsyncTransferManager.start_transfer
            cpp = req.context_phase_params
            return {"first_gen_tokens": cpp.first_gen_tokens, "req_id": cpp.req_id, "opaque_state": cpp.opaque_state,
                    "state": req.state}
        if op == "poll_ctx":  # _check_disagg_ctx_cache_transfer_status
            done, failed = tx.check_context_transfer_status(args[0])
            for rid in done + failed:
                mgr.unpin(rid)  # end_transfer
                mgr.free_resources(reqs[rid])
            return {"done": done, "failed": failed, "states": {r: reqs[r].state for r in done + failed},
                    "free": mgr.free_count}
        if op == "gen":  # _prepare_disagg_gen_init -> _recv_disagg_gen_cache
            rid, prompt_len, cpp, source = args
            req = reqs[rid] = FakeRequest(rid, prompt_len, 2, None)
            req.context_phase_params = SimpleNamespace(**cpp)
            mgr.add_sequence(req)
            tx.request_and_receive_async(req)
            return {"state": req.state}
        if op == "poll_gen":  # _check_disagg_gen_cache_transfer_status, _prepare_disagg_gen_transmission_complete
            rid, source = args
            tx.check_gen_transfer_status(1)
            req = reqs[rid]
            out = {"state": req.state, "complete": tx.check_gen_transfer_complete()}
            if req.state == "DISAGG_GENERATION_TRANS_COMPLETE":
                req.context_current_position = req.prompt_len
                req._tokens.extend(req.context_phase_params.first_gen_tokens)
                lay, toks = tx.layout, np.arange(req.prompt_len)
                off = unit_offsets(lay, mgr.blocks[rid], toks, range(lay.num_heads))
                out["kv_ok"] = bool(np.array_equal(mgr.pool.view(-1).view(torch.uint8).numpy()[off],
                                                   ref.tokens(lay, source, toks)))
                out["tokens"] = req.get_tokens(0)[req.prompt_len:]
            if req.state in ("DISAGG_GENERATION_TRANS_COMPLETE", "DISAGG_TRANS_ERROR"):
                mgr.free_resources(req)
            out["free"] = mgr.free_count
            return out
        if op == "blocks":
            return mgr.blocks.get(args[0])
        if op == "cancel":  # PyExecutor._handle_canceled_requests -> cancel_request, retried until True
            return tx.cancel_request(reqs[args[0]])
        raise ValueError(op)

    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                conn.send(("stopped",))
                return
            try:
                conn.send(("ok", handle(*cmd)))
            except Exception as e:
                conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        tx.shutdown()


class TransceiverRank:
    """A transceiver rank process driven over a Pipe."""

    def __init__(self, spec, cfg):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=transceiver_main, args=(child, spec, cfg), daemon=True)
        self.proc.start()
        msg = Server._recv(self.conn, 120)
        self.endpoints, self.free0 = msg[1], msg[2]

    def call(self, *cmd, timeout=60):
        self.conn.send(cmd)
        return Server._recv(self.conn, timeout)[1]

    def stop(self):
        stop_process(self.conn, self.proc)
