"""One SGLang scheduler rank per OS process, driving kvbridge's SGLang backend with the
REAL sglang package on CPU, for tests/sglang/test_sglang_backend.py.

A process imports SGLang once (5-15 s), loads plugins through SGLang's own loader, and
then plays any role the parent asks for, case after case: it re-publishes SGLang's
runtime context (``ServerArgs`` + ``runtime_context.publish``, with a stand-in pp_group
via ``get_parallel().override_permanently``), builds real ``MHATokenToKVPool`` /
``MLATokenToKVPool`` pools and ``MetadataBuffers``, fills ``KVArgs`` as
``_init_kv_manager`` in prefill.py / decode.py does, and gets every class through
``get_kv_class(TransferBackend("kvbridge"), ...)``. Requests are driven in the call
order of SGLang's schedulers (line numbers: sglang 0.5.23).

What it mirrors, at sglang 0.5.23 (``sglang/srt/disaggregation/``):

- prefill (``serve``): ``PrefillBootstrapQueue`` creating the sender (``prefill.py``
  ``add`` -> ``create_sender``), ``pop_bootstrapped``'s ``finalize_bootstrap`` and
  ``sender.init``, and ``send_kv_chunk``'s page slicing, ``set_buf`` and ``sender.send`` per
  chunk (chunked prefill), then polling as ``process_disagg_prefill_inflight_queue`` does;
- decode (``pull``): ``DecodePreallocQueue`` (``_ensure_prefill_info`` ->
  ``try_ensure_parallel_info``, ``_init_receiver``), ``_send_kv_metadata`` ->
  ``receiver.send_metadata`` with ``decode_prefix_len``, and ``DecodeTransferQueue``'s
  polling and metadata read (``get_buf``) after ``Success``;
- aborts: ``sender.abort()`` / ``receiver.abort()`` where the schedulers call them when a
  client aborts (``scheduler.py`` ``abort_request``).

It exists for fault injection (throttled writes, SIGSTOP, kills at exact points), which a
real server cannot be stopped at. Every behaviour it drives also runs through SGLang's
REAL servers: handoffs and concurrency (tests/sglang/test_sglang_server_kvbridge.py,
tests/sglang/test_sglang_server_page_sizes.py), chunked prefill, prefix reuse and early send
(test_sglang_server_page_sizes.py), a dead prefill (``test_decode_fails_cleanly_when_
prefill_is_gone_and_stays_healthy``), a client's decode abort (``test_decode_abort_while_
waiting_for_kv_ends_the_room_on_both_servers``), a prefill killed mid-run and a slow
prefill given up within its deadline (tests/route/test_route_sglang.py), an incompatible decode
(``test_incompatible_decode_fails_requests_and_servers_stay_up``).
"""

from __future__ import annotations

import os
import time
import traceback

from kvbridge.bench.sglang import ENV as BENCH_ENV
from kvbridge.bench.sglang_worker import SinglePPGroup, failure_reason, poll_until

ENV = {**BENCH_ENV, "SGLANG_PLUGINS": "kvbridge"}  # the bench's worker environment, kvbridge's plugin loaded


def _checks() -> dict:
    """What the plugin must have done to this process (reported to the parent)."""
    import importlib.metadata as md

    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import decode, prefill, utils
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.managers import disagg_service
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    from kvbridge.adapters.sglang import conn

    eps = [ep.value for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "kvbridge"]
    be = TransferBackend("kvbridge")
    got = {k.value: get_kv_class(be, k) for k in KVClassType}
    want = {"manager": conn.KVBridgeKVManager, "sender": conn.KVBridgeKVSender,
            "receiver": conn.KVBridgeKVReceiver, "bootstrap_server": conn.KVBridgeKVBootstrapServer}
    sa = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                              "--disaggregation-transfer-backend", "kvbridge", "--device", "cpu"])
    from sglang.srt.disaggregation.mooncake import MooncakeKVSender

    return {
        "entry_points": eps,
        "choice": "kvbridge" in choices.DISAGG_TRANSFER_BACKEND_CHOICES,
        "enum": (be is TransferBackend.KVBRIDGE, be.name, TransferBackend["KVBRIDGE"] is be, be in list(TransferBackend)),
        "classes": all(got[k] is v for k, v in want.items()),
        "kvargs": got["kvargs"].__name__,
        "mooncake_still": get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER) is MooncakeKVSender,
        # every module that imported get_kv_class / TransferBackend by name sees the patched ones
        "patched_in": {m.__name__: (m.get_kv_class is utils.get_kv_class, m.TransferBackend is TransferBackend)
                       for m in (prefill, decode, disagg_service)},
        "argv_backend": sa.disaggregation_transfer_backend,
        # the hook that notes the model's fp8 KV scales, applied by SGLang's loader
        "scales_hook": "sglang.srt.managers.scheduler.Scheduler.init_disaggregation" in HookRegistry._patched,
        "server_args": ServerArgs(model_path="dummy", disaggregation_transfer_backend="kvbridge",
                                  device="cpu").disaggregation_transfer_backend,
    }


def note_model_scales(scales, backend: str = "flashinfer") -> None:
    """Load a model's fp8 KV scales the way SGLang does and let the plugin's hook see it.

    Per layer ``(k, v)`` as a checkpoint's ``k_scale`` / ``v_scale``: SGLang's own
    ``RadixAttention`` layers get them through SGLang's ``BaseKVCacheMethod``
    (``create_weights``, the loader's copy, ``process_weights_after_loading``, which sets
    ``k_scale_float`` / ``v_scale_float``); the hook (``record_scales``, the BEFORE hook on
    ``Scheduler.init_disaggregation``) is then called as SGLang calls it, with a scheduler
    whose ``tp_worker.model_runner`` holds that model and the attention backends."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
    from sglang.srt.layers.radix_attention import RadixAttention

    from kvbridge.adapters.sglang.scales import record_scales

    layers = torch.nn.ModuleList()
    for i, (k, v) in enumerate(scales):
        attn = RadixAttention(num_heads=4, head_dim=8, scaling=1.0, num_kv_heads=4, layer_id=i)
        method = BaseKVCacheMethod(None)
        method.create_weights(attn)
        attn.k_scale.data.fill_(k)
        attn.v_scale.data.fill_(v)
        method.process_weights_after_loading(attn)
        layers.append(attn)
    runner = SimpleNamespace(model=layers, prefill_attention_backend_str=backend, decode_attention_backend_str=backend)
    record_scales(SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner)))


class Rank:
    """One case's state on this process: pools, metadata buffers, manager."""

    def __init__(self, role: str, case: dict, rank: int):
        import torch
        from sglang.srt import runtime_context as rc
        from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType, MetadataBuffers, TransferBackend,
                                                     get_kv_class, get_kv_transfer_buf_infos, get_pd_kv_layout,
                                                     setup_state_kv_args)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.server_args import ServerArgs

        self.role, self.case, self.rank = role, case, rank
        from tests.helpers.kvhelpers import install_test_hooks

        os.environ.update(case.get("env", {}))  # e.g. shorter SGLang/kvbridge timeouts for fault tests
        # across hosts: each role's own address (and network namespace, entered by this process)
        host = case.get("hosts", {}).get(role, "127.0.0.1")
        os.environ["SGLANG_HOST_IP"] = host
        netns = case.get("netns", {}).get(role)
        install_test_hooks(dict(case.get("hooks") or {}, **({"netns": netns} if netns else {})))
        tp = case["p_tp"] if role == "prefill" else case["d_tp"]
        # each server its own page size ("page_size" both, or "d_page_size" for the decode)
        ps = case["page_size"] if role == "prefill" else case.get("d_page_size", case["page_size"])
        self.page_size = ps
        sa = ServerArgs(model_path="dummy", disaggregation_mode=role, disaggregation_transfer_backend="kvbridge",
                        disaggregation_bootstrap_port=case["port"], host=host, device="cpu", tp_size=tp,
                        page_size=ps)
        rc.reset_context()
        rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
        rc.get_parallel().override_permanently(pp_group=SinglePPGroup())
        self.server_args = sa
        backend = TransferBackend(sa.disaggregation_transfer_backend)
        self.backend = backend
        dtype_name = case["dtype"] if role == "prefill" else case.get("d_dtype", case["dtype"])
        dtype = getattr(torch, dtype_name)
        # MLA's latent is replicated on every TP rank: prefill ranks hold the same bytes
        g = torch.Generator().manual_seed(case["seed"] * 131 + (0 if case["mla"] else rank * 7)
                                          + (0 if role == "prefill" else 1000 + rank))
        if case["mla"]:
            self.pool = MLATokenToKVPool(size=case["slots"], page_size=ps, dtype=dtype, kv_lora_rank=case["lora"],
                                         qk_rope_head_dim=case["rope"], layer_num=case["layers"], device="cpu",
                                         enable_memory_saver=False)
            self.bufs = list(self.pool.kv_buffer)
        else:
            heads = case["heads"] // tp if case["heads"] >= tp else 1
            self.pool = MHATokenToKVPool(size=case["slots"], page_size=ps, dtype=dtype, head_num=heads,
                                         head_dim=case["head_dim"], layer_num=case["layers"], device="cpu",
                                         enable_memory_saver=False)
            self.bufs = list(self.pool.k_buffer) + list(self.pool.v_buffer)
        for b in self.bufs:  # prefill: the KV to move; decode: a sentinel that must survive outside the pages
            b.view(torch.int16 if b.element_size() == 2 else torch.uint8).copy_(
                torch.randint(-30000 if b.element_size() == 2 else 0, 30000 if b.element_size() == 2 else 255,
                              b.shape, generator=g, dtype=torch.int32))
        self.meta = MetadataBuffers(16, 32, torch.float32, 16)

        # KVArgs as _init_kv_manager fills them: prefill.py 270-345, decode.py 608-765
        kv_args = get_kv_class(backend, KVClassType.KVARGS)()
        kv_args.engine_rank = rank % tp
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.kv_cache_dtype_str = dtype_name
        kv_args.kv_layout = get_pd_kv_layout(self.pool)
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(self.pool)
        kv_args.num_draft_entries = 0
        kv_args.prefill_start_layer = 0
        if role == "prefill" and not case["mla"]:  # prefill.py 335-339; decode.py sets these only for staging
            kv_args.kv_head_num = self.pool.head_num
            kv_args.total_kv_head_num = case["heads"]
        kv_args.page_size = ps
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = self.meta.get_buf_infos()
        setup_state_kv_args(kv_args, self.pool, None, total_kv_layers=case["layers"])
        kv_args.ib_device = None
        kv_args.gpu_id = None
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        scales = case.get("p_scales" if role == "prefill" else "d_scales")
        if scales is not None:  # the model's fp8 KV scales, seen by the plugin before its manager is built
            note_model_scales(scales, case.get("attention_backend", "flashinfer"))
        self.bootstrap = None
        if role == "prefill" and rank == 0:  # disagg_service.start_disagg_service (tokenizer side)
            # "bootstrap": another backend's bootstrap server (e.g. "mooncake": SGLang's own,
            # which reports the prefill's page size to decode servers)
            boot_backend = TransferBackend(case.get("bootstrap", sa.disaggregation_transfer_backend))
            self.bootstrap = get_kv_class(boot_backend, KVClassType.BOOTSTRAP_SERVER)(host=host, port=case["port"])
            _wait_http(f"http://{bootstrap_addr(case)}/health")
        self.mgr = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, sa, case["mla"])
        self.sender_cls = get_kv_class(backend, KVClassType.SENDER)
        self.receiver_cls = get_kv_class(backend, KVClassType.RECEIVER)
        self.free_pages = list(range(1, case["slots"] // ps + 1))

    def pages_content(self, pages) -> list:
        """Bytes of ``pages`` in every buffer, [len(pages), page_size, heads, dim] as int16/uint8."""
        import torch

        ps = self.page_size
        idx = (torch.as_tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)
        out = []
        for b in self.bufs:
            v = b.view(torch.int16 if b.element_size() == 2 else torch.uint8)
            out.append(v[idx].reshape(len(pages), ps, *b.shape[1:]).numpy().copy())
        return out

    def token_rows(self, pages, first_token: int, start: int, stop: int) -> list:
        """Tokens [start, stop) of a request whose token ``first_token`` opens ``pages[0]``,
        per buffer [stop - start, heads, dim] as int16/uint8."""
        import numpy as np
        import torch

        ps = self.page_size
        t = np.arange(start, stop) - first_token
        slots = torch.as_tensor(np.asarray(pages, dtype=np.int64)[t // ps] * ps + t % ps)
        return [b[slots].numpy().copy() for b in self.raw()]

    def raw(self):
        """The buffers as integers (random bf16 bit patterns include NaNs)."""
        import torch

        return [b.view(torch.int16 if b.element_size() == 2 else torch.uint8) for b in self.bufs]

    def snapshot(self):
        return [b.clone() for b in self.raw()]

    def close(self):
        self.mgr.close()
        if self.bootstrap is not None:
            self.bootstrap.close()


def bootstrap_addr(case: dict) -> str:
    """host:port of the prefill instance's bootstrap server."""
    return f"{case.get('hosts', {}).get('prefill', '127.0.0.1')}:{case['port']}"


def _wait_http(url: str, timeout: float = 10.0) -> None:
    import requests

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.02)
    raise TimeoutError(url)


def _poll_until(obj, want, timeout: float):
    return poll_until(obj, want, timeout, sleep=0.002)


def serve(r: Rank, room: int, pages: list, num_tokens: int, chunk_pages: int, first_token: int, timeout: float,
          abort_on: str | None = None):
    """Prefill side of one request, in prefill.py's order; ``abort_on``: a file whose
    appearance makes the prefill abort the request (AbortReq) mid-transfer."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = bootstrap_addr(r.case)
    sender = r.sender_cls(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=room,
                          req_has_disagg_prefill_dp_rank=False)  # create_sender, prefill.py 400-406
    st = _poll_until(sender, (KVPoll.WaitingForInput,), timeout)  # bootstrap queue poll
    if st != KVPoll.WaitingForInput:
        return {"state": int(st), "phase": "bootstrap", "reason": failure_reason(sender), "t_end": time.monotonic()}
    prefix = sender.pop_decode_prefix_len()  # finalize_bootstrap, prefill.py 437
    ps = r.page_size
    num_pages = -(-(num_tokens - prefix) // ps)  # _num_pages_to_send, prefill.py 446-450
    aux_idx = 3
    sender.init(num_pages, aux_idx)  # prefill.py 442
    todo = pages[prefix // ps:]  # prefix: on a page boundary of ours (req_to_token sliced from there)
    t0 = time.perf_counter()
    for i in range(0, num_pages, chunk_pages):  # one send per chunk, consecutive page slices
        last = i + chunk_pages >= num_pages
        ntok = min(chunk_pages * ps, num_tokens - prefix - i * ps)  # seg_end - seg_start, prefill.py 1766
        if last:  # set_buf before the last chunk's send, prefill.py 1567-1568
            r.meta.output_ids[aux_idx][0] = first_token
            r.meta.cached_tokens[aux_idx][0] = prefix
            r.meta.output_token_logprobs_val[aux_idx][0] = -0.25
            r.meta.bootstrap_room[aux_idx, 0] = room
        chunk = np.asarray(todo[i:i + chunk_pages], dtype=np.int32)
        if sender.should_send_kv_chunk(len(chunk), last):  # prefill.py 1765
            sender.send(chunk, None, num_kv_tokens=ntok)  # prefill.py 1775-1779
    t_abort = _abort_on(sender, abort_on, timeout)
    st = _poll_until(sender, (KVPoll.Success,), timeout)  # inflight queue poll
    out = {"state": int(st), "prefix": prefix, "seconds": time.perf_counter() - t0, "reason": failure_reason(sender) if st != KVPoll.Success else "",
           "t_end": time.monotonic(), "t_abort": t_abort}
    out["metric_bytes"] = sender.get_transfer_metric().transfer_total_bytes
    sender.clear()
    return out


def serve_layerwise(r: Rank, room: int, pages: list, num_tokens: int, first_token: int, timeout: float,
                    layer_gap_s: float = 0.0, progress_path: str | None = None):
    """Prefill side of one request with ``layerwise`` on, as the real scheduler runs it
    (tests/test_sglang_layerwise.py runs the server): one forward computes the prompt; the
    prefill manager's streamer is armed with its tokens (what the ``run_batch`` hook does),
    then each layer's K and V go into the REAL pool through ``MHATokenToKVPool.set_kv_buffer``
    (the hooked method; ``RadixAttention`` as the attention layer passes itself), which hands
    the layer to the sender; ``layer_gap_s`` between layers stands for the next layer's
    compute; ``progress_path``: a file that holds how many layers the forward has written.
    Then ``send_kv_chunk``'s last send, which ends the room with ``finish``."""
    import numpy as np
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.layers.radix_attention import RadixAttention

    st = r.mgr.kvb_streamer
    assert st is not None, "the prefill manager has no layer-wise streamer (KVBRIDGE_LAYERWISE unset?)"
    addr = bootstrap_addr(r.case)
    sender = r.sender_cls(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=room, req_has_disagg_prefill_dp_rank=False)
    st_ = _poll_until(sender, (KVPoll.WaitingForInput,), timeout)
    if st_ != KVPoll.WaitingForInput:
        return {"state": int(st_), "phase": "bootstrap", "reason": failure_reason(sender), "t_end": time.monotonic()}
    prefix = sender.pop_decode_prefix_len()
    ps = r.page_size
    num_pages = -(-(num_tokens - prefix) // ps)
    aux_idx = 3
    sender.init(num_pages, aux_idx)
    pg = np.asarray(pages, dtype=np.int64)

    def slots_of(lo, hi):
        t = np.arange(lo, hi)
        return torch.as_tensor(pg[t // ps] * ps + t % ps)

    a = st.arm_request(sender, prefix, num_tokens, ps, slots_of, num_tokens)
    assert a is not None, "the room does not stream"
    st.begin_forward(r.pool, [a])
    loc = slots_of(prefix, num_tokens)
    g = torch.Generator().manual_seed(room)
    heads, dim = r.pool.head_num, r.pool.head_dim
    pieces = []
    for layer in range(r.case["layers"]):
        if layer and layer_gap_s:
            time.sleep(layer_gap_s)
        k, v = (torch.randn(len(loc), heads, dim, generator=g).to(r.pool.dtype) for _ in range(2))
        attn = RadixAttention(heads, dim, 1.0, heads, layer_id=layer)
        r.pool.set_kv_buffer(attn, loc, k, v)  # the attention backend's write; the hook streams the layer
        pieces.append(sender.kvb_layer_pieces)
        if progress_path:
            with open(progress_path + ".tmp", "w") as f:
                f.write(str(layer + 1))
            os.replace(progress_path + ".tmp", progress_path)
    st.disarm()
    r.meta.output_ids[aux_idx][0] = first_token
    r.meta.cached_tokens[aux_idx][0] = prefix
    r.meta.bootstrap_room[aux_idx, 0] = room
    sender.send(np.asarray(pages[prefix // ps:], dtype=np.int32), None, num_kv_tokens=num_tokens - prefix)
    st_ = _poll_until(sender, (KVPoll.Success,), timeout)
    out = {"state": int(st_), "prefix": prefix, "reason": failure_reason(sender) if st_ != KVPoll.Success else "",
           "t_end": time.monotonic(), "pieces_after_layer": pieces, "ended_by": sender._kvb_ended}
    sender.clear()
    return out


def _abort_on(obj, when, timeout: float) -> float | None:
    """Abort ``obj`` after ``when`` seconds, or once the file ``when`` names exists; returns
    when it aborted (monotonic), or None."""
    if when is None:
        return None
    if isinstance(when, str):
        end = time.monotonic() + timeout
        while not os.path.exists(when) and time.monotonic() < end:
            time.sleep(0.002)
    else:
        time.sleep(when)
    obj.abort()
    return time.monotonic()


def pull(r: Rank, room: int, num_tokens: int, prefix: int, timeout: float, abort_after: float | str | None = None,
         settle_s: float = 0.0, port: int | None = None, released_path: str | None = None):
    """Decode side of one request, in decode.py's order; returns what landed. ``abort_after``:
    seconds, or a file whose appearance makes the decode abort; after a failure the request's
    pages are watched for ``settle_s`` more (nothing may write into them once it failed).
    ``port``: the bootstrap server of another prefill instance than the case's.
    ``released_path``: a file created the moment a failed request's pages go back to
    SGLang (the parent watches it while ``pull`` waits for that)."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = bootstrap_addr(r.case if port is None else {**r.case, "port": port})
    end = time.monotonic() + timeout
    while not r.mgr.try_ensure_parallel_info(addr):  # _ensure_prefill_info, decode.py 1200
        if time.monotonic() > end:
            return {"state": int(KVPoll.Failed), "reason": "no parallel info"}
        time.sleep(0.05)
    recv = r.receiver_cls(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=room)  # decode.py 905-911
    recv.init(0)  # _init_receiver, decode.py 1105
    ps = r.page_size
    n = -(-(num_tokens - prefix) // ps)
    pages = r.free_pages[1:2 * n + 1:2][:n]  # scattered pages, every other free one
    before = r.snapshot()
    aux_idx = 5
    r.meta.clear_slot(aux_idx)
    # kvbridge's hook on _send_kv_metadata (decode.py 1845) tells it the tokens first
    recv.note_transfer_tokens(num_tokens - prefix)
    recv.send_metadata(np.asarray(pages, dtype=np.int32), aux_idx, None,
                       decode_prefix_len=prefix)  # _send_kv_metadata, decode.py 1863-1868
    t_abort = _abort_on(recv, abort_after, timeout)
    st = _poll_until(recv, (KVPoll.Success,), timeout)
    out = {"state": int(st), "pages": pages, "t_end": time.monotonic(), "t_abort": t_abort}
    if st == KVPoll.Success:
        row = r.meta.get_buf(aux_idx)  # decode.py 2624-2627 reads these after Success
        out["output_id"] = int(row[0][0])
        out["cached"] = int(row[1][0])
        out["logprob"] = float(row[2][0])
        out["room_row"] = int(row[-1][0])
        out["content"] = r.token_rows(pages, prefix, prefix, num_tokens)  # per buffer [tokens, heads, dim]
        import torch

        # every other slot must be as it was, the unused tail of the last page included
        t = np.arange(num_tokens - prefix)
        mask = torch.ones(before[0].shape[0], dtype=torch.bool)
        mask[torch.as_tensor(np.asarray(pages, dtype=np.int64)[t // ps] * ps + t % ps)] = False
        diff = set()
        for a, b in zip(before, r.raw()):
            d = (a != b).reshape(a.shape[0], -1).any(1) & mask
            diff.update(int(x) for x in torch.nonzero(d).reshape(-1)[:8])
        out["untouched"] = not diff
        out["changed_slots"] = sorted(diff)[:8]
    else:
        out["reason"] = failure_reason(recv)
        import torch

        # whether any byte landed in the request's pages before it failed (a partial room)
        t = np.arange(num_tokens - prefix)
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64)[t // ps] * ps + t % ps)
        out["landed_before_fail"] = any(bool((a[idx] != b[idx]).any()) for a, b in zip(before, r.raw()))
        if r.mgr.enable_deferred_decode_kv_release:
            # decode.py's transfer queue holds a failed request's pages (2895-2967) and gives
            # them back once resolve_deferred_releases, each scheduler pass, finds the manager's
            # is_abort_release_safe true (3046-3090); kvbridge lifts SGLang's timer there
            if not recv.abort_notified:
                recv.ensure_abort_notified(force_arm=True)
            hold_end = time.monotonic() + timeout
            while not r.mgr.is_abort_release_safe(room, 1) and time.monotonic() < hold_end:
                time.sleep(0.002)
            out["t_released"] = time.monotonic()
            if released_path:
                open(released_path, "w").close()
            r.mgr.clear_deferred_abort_state(room)  # _do_release, decode.py 3013-3029
        if settle_s:  # the pages are the engine's again: not one byte may change from here on
            at_release = r.pages_content(pages)
            time.sleep(settle_s)
            out["stable_after_fail"] = all(np.array_equal(a, b) for a, b in zip(at_release, r.pages_content(pages)))
    recv.clear()
    return out


def health(r: Rank) -> dict:
    """kvbridge's own accounting on this rank: blocks leased to rooms, rooms still open."""
    from kvbridge.common.handoff import TERMINAL, default_metrics

    m = default_metrics()
    side = r.mgr.kv_sender if r.role == "prefill" else r.mgr.kv_receiver
    rooms = getattr(side, "_rooms", {}) if side is not None else {}
    return {"blocks_held": {k: m.blocks_held.labels(k)._value.get() for k in ("sender", "receiver")},
            "open_rooms": sum(1 for x in rooms.values() if x.state not in TERMINAL)}


def _metrics() -> dict:
    """This process's kvbridge Prometheus samples the tests look at."""
    from prometheus_client import REGISTRY

    get = REGISTRY.get_sample_value
    return {"fallbacks": get("kvbridge_fallbacks_total", {"role": "receiver", "reason": "below_break_even"}) or 0.0,
            "declined": {role: get("kvbridge_handoffs_total", {"role": role, "result": "declined", "plan": "none"}) or 0.0
                         for role in ("sender", "receiver")},
            "blocks_held": {role: get("kvbridge_blocks_held", {"role": role}) or 0.0 for role in ("sender", "receiver")}}


def main(conn) -> None:
    os.environ.update(ENV)
    t0 = time.perf_counter()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=os.environ.get("KVBRIDGE_TEST_LOG", "WARNING"))
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what every SGLang process does at start
    ranks: dict = {}
    conn.send(("ready", time.perf_counter() - t0, _checks()))
    while True:
        cmd = conn.recv()
        op, args = cmd[0], cmd[1:]
        if op == "stop":
            for r in ranks.values():
                r.close()
            conn.send(("stopped",))
            return
        try:
            if op == "setup":
                role, case, rank = args
                for r in ranks.values():
                    r.close()
                ranks.clear()
                ranks[0] = Rank(role, case, rank)
                conn.send(("ok", ranks[0].mgr.kvbridge_record() if role == "prefill" else None))
            elif op == "content":
                conn.send(("ok", ranks[0].pages_content(args[0])))
            elif op == "rows":
                conn.send(("ok", ranks[0].token_rows(*args)))
            elif op == "env":  # settings read when the next case's manager is built (KVBRIDGE_COST_*...)
                os.environ.update(args[0])
                conn.send(("ok", None))
            elif op == "metrics":
                conn.send(("ok", _metrics()))
            elif op == "serve":
                conn.send(("ok", serve(ranks[0], *args)))
            elif op == "serve_layerwise":
                conn.send(("ok", serve_layerwise(ranks[0], *args)))
            elif op == "pull":
                conn.send(("ok", pull(ranks[0], *args)))
            elif op == "health":
                conn.send(("ok", health(ranks[0])))
            elif op == "bootstrap_down":  # the prefill instance's bootstrap server stops
                ranks[0].bootstrap.close()
                ranks[0].bootstrap = None
                conn.send(("ok", None))
            elif op == "teardown":
                for r in ranks.values():
                    r.close()
                ranks.clear()
                conn.send(("ok", None))
            else:
                raise ValueError(op)
        except Exception as e:
            conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
