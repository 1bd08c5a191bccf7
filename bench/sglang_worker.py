"""The worker process of ``kvbridge bench sglang`` (``kvbridge.bench.sglang``).

It plays one SGLang scheduler rank: real ``MHATokenToKVPool`` pools, ``KVArgs`` filled as
``_init_kv_manager`` fills them, SGLang's bootstrap server, and over one pool one manager
of each backend the case names (``KVBridgeKVManager``, SGLang's ``MooncakeKVManager`` and,
where NIXL is installed, SGLang's ``NixlKVManager`` over host memory). In this
process only, SGLang's transfer engine's ``batch_transfer_sync`` and its manager's aux
sender are wrapped to count the pieces each backend writes (``_instrument_engine``,
``_instrument_aux``); nothing of SGLang is patched in the parent or in a serving process.

``poll_until``, ``failure_reason`` and ``SinglePPGroup`` are shared with the SGLang test
peers (tests/helpers/sglang_peers.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import traceback

__all__ = ["SinglePPGroup", "failure_reason", "poll_until", "worker_main"]

log = logging.getLogger(__name__)

# aux (metadata) rows per backend, so the two never share one
_AUX = {"kvbridge": 1, "sglang_mooncake": 2, "sglang_nixl": 3}


class SinglePPGroup:
    """Stand-in for ``get_parallel().pp_group`` (only set by torch.distributed init); pp 1."""

    rank_in_group = 0
    world_size = 1
    is_first_rank = True
    is_last_rank = True


# -- worker process ------------------------------------------------------------------


class _Counter:
    """Pieces the SGLang transfer engine was asked to write (``batch_transfer_sync``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.aux_threads: set[int] = set()
        self.reset()

    def reset(self) -> None:
        self.kv_pieces = self.kv_calls = self.kv_bytes = self.aux_pieces = self.max_call = 0
        self.first = self.last = None  # KV writes: first call's start, last call's end (perf_counter)

    def add(self, n: int, nbytes: int, t0: float, t1: float) -> None:
        with self.lock:
            if threading.get_ident() in self.aux_threads:
                self.aux_pieces += n
            else:
                self.kv_pieces += n
                self.kv_calls += 1
                self.kv_bytes += nbytes
                self.max_call = max(self.max_call, n)
                self.first = t0 if self.first is None else min(self.first, t0)
                self.last = t1 if self.last is None else max(self.last, t1)

    def snapshot(self, since: float) -> dict:
        with self.lock:
            return {"kv_pieces": self.kv_pieces, "kv_calls": self.kv_calls, "kv_bytes": self.kv_bytes,
                    "aux_pieces": self.aux_pieces, "max_pieces_per_call": self.max_call,
                    "send_to_first_write_s": None if self.first is None else self.first - since,
                    "kv_write_s": None if self.first is None else self.last - self.first}


_COUNTER = _Counter()
_ABANDONED: list = []  # kept alive until the worker process exits


def _instrument_engine(engine) -> None:
    """Count every piece handed to the shared engine (its instance attribute shadows
    the method, and SGLang's managers call ``self.engine.batch_transfer_sync``)."""
    if getattr(engine, "_kvbridge_counted", False):
        return
    inner = engine.batch_transfer_sync

    def counted(session_id, buffers, peer_buffer_addresses, lengths):
        t0 = time.perf_counter()
        try:
            return inner(session_id, buffers, peer_buffer_addresses, lengths)
        finally:
            _COUNTER.add(len(buffers), int(sum(lengths)), t0, time.perf_counter())

    engine.batch_transfer_sync = counted
    engine._kvbridge_counted = True


def _instrument_aux(mgr) -> None:
    """Pieces written while ``send_aux`` runs are the metadata row, not KV."""
    inner = mgr.send_aux

    def send_aux(*a, **kw):
        me = threading.get_ident()
        with _COUNTER.lock:
            _COUNTER.aux_threads.add(me)
        try:
            return inner(*a, **kw)
        finally:
            with _COUNTER.lock:
                _COUNTER.aux_threads.discard(me)

    mgr.send_aux = send_aux


class _Rank:
    """One case on one worker: a pool, metadata buffers, and a manager per backend."""

    def __init__(self, role: str, case: dict, rank: int):
        import torch
        from sglang.srt import runtime_context as rc
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.mooncake.conn import (MooncakeKVBootstrapServer, MooncakeKVManager,
                                                             MooncakeKVReceiver, MooncakeKVSender)
        from sglang.srt.disaggregation.utils import (DisaggregationMode, MetadataBuffers, build_kv_layer_ids,
                                                     get_kv_transfer_buf_infos, get_pd_kv_layout, setup_state_kv_args)
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            get_mooncake_transfer_engine, maybe_init_shared_mooncake_transfer_engine)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.server_args import ServerArgs

        from kvbridge.adapters.sglang.conn import KVBridgeKVBootstrapServer, KVBridgeKVManager, KVBridgeKVReceiver, KVBridgeKVSender

        self.role, self.case, self.rank = role, case, rank
        tp = case["p_tp"] if role == "prefill" else case["d_tp"]
        ps = case["page_size"]
        self.page_size = ps
        heads = case["heads"] // tp
        self.pool = MHATokenToKVPool(size=case["slots"], page_size=ps, dtype=getattr(torch, case["dtype"]),
                                     head_num=heads, head_dim=case["head_dim"], layer_num=case["layers"],
                                     device="cpu", enable_memory_saver=False)
        self.bufs = list(self.pool.k_buffer) + list(self.pool.v_buffer)
        g = torch.Generator().manual_seed(case["seed"] * 7919 + rank)
        for b in self.bufs:  # prefill: the KV to move (random bit patterns); decode: zeroed per transfer
            if role == "prefill":
                b.view(torch.int16).random_(-32768, 32767, generator=g)
            else:
                b.zero_()
        self.meta = MetadataBuffers(8, 32, torch.float32, 16)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE

        def kv_args() -> KVArgs:  # as _init_kv_manager fills them: prefill.py 260-347, decode.py 613-764
            a = KVArgs()
            a.engine_rank = rank % tp
            a.pp_rank = 0
            a.system_dp_rank = 0
            a.kv_cache_dtype_str = case["dtype"]
            a.kv_layout = get_pd_kv_layout(self.pool)
            a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(self.pool)
            a.num_draft_entries = 0
            a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
                                                num_draft_entries=0, num_hidden_layers=case["layers"])
            a.prefill_start_layer = 0
            if role == "prefill":
                a.kv_head_num = self.pool.head_num
                a.total_kv_head_num = case["heads"]
            a.page_size = ps
            a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.meta.get_buf_infos()
            setup_state_kv_args(a, self.pool, None, total_kv_layers=case["layers"])
            a.ib_device = None
            a.gpu_id = None
            a.kv_data_mem_kinds = ["DRAM"] * len(a.kv_data_ptrs)  # host pools (decode.py 629-669 sets it the same way)
            return a

        def publish(backend: str, key: str) -> ServerArgs:
            sa = ServerArgs(model_path="dummy", disaggregation_mode=role, disaggregation_transfer_backend=backend,
                            disaggregation_bootstrap_port=case["ports"][key], host="127.0.0.1", device="cpu",
                            tp_size=tp, page_size=ps)
            rc.reset_context()
            rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
            rc.get_parallel().override_permanently(pp_group=SinglePPGroup())
            return sa

        self.servers: list = []
        self.mgr: dict = {}
        self.cls: dict = {}
        try:
            for backend in case["backends"]:
                args = kv_args()
                if backend == "kvbridge":  # CommonKVManager reads the bootstrap port from the published context
                    sa = publish("kvbridge", "kvbridge")
                    server, manager = KVBridgeKVBootstrapServer, KVBridgeKVManager
                    self.cls[backend] = (KVBridgeKVSender, KVBridgeKVReceiver)
                elif backend == "sglang_mooncake":  # with SGLang's shared transfer engine (instrumented)
                    sa = publish("mooncake", "sglang_mooncake")
                    maybe_init_shared_mooncake_transfer_engine(gpu_id=None)
                    _instrument_engine(get_mooncake_transfer_engine())
                    server, manager = MooncakeKVBootstrapServer, MooncakeKVManager
                    self.cls[backend] = (MooncakeKVSender, MooncakeKVReceiver)
                elif backend == "sglang_nixl":  # SGLang's NIXL backend (UCX), host memory on both sides
                    from sglang.srt.disaggregation.nixl.conn import (NixlKVBootstrapServer, NixlKVManager,
                                                                     NixlKVReceiver, NixlKVSender)

                    sa = publish("nixl", "sglang_nixl")
                    args.gpu_id = 0  # the scheduler's gpu_id on a CPU server; NIXL sends it as an integer
                    server, manager = NixlKVBootstrapServer, NixlKVManager
                    self.cls[backend] = (NixlKVSender, NixlKVReceiver)
                else:
                    raise ValueError(f"unknown backend {backend!r}")
                if role == "prefill" and rank == 0:
                    self.servers.append(server(host="127.0.0.1", port=case["ports"][backend]))
                self.mgr[backend] = manager(args, mode, sa, False)
                if backend == "sglang_mooncake":
                    _instrument_aux(self.mgr[backend])
        except Exception:
            _ABANDONED.extend(self.close())
            raise

    def slots(self, pages):
        import torch

        ps = self.page_size
        return (torch.as_tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)

    def digest(self, pages, parts: int = 1) -> list[str]:
        """blake2b over every buffer's pages (K layers, then V layers), one per head part."""
        import torch

        idx = self.slots(pages)
        hs = [hashlib.blake2b(digest_size=16) for _ in range(parts)]
        for b in self.bufs:
            rows = b.view(torch.int16)[idx]  # [tokens, heads, dim]
            h = rows.shape[1] // parts
            for i in range(parts):
                hs[i].update(rows[:, i * h:(i + 1) * h].contiguous().numpy().tobytes())
        return [h.hexdigest() for h in hs]

    def rows(self, pages) -> list:
        """Every buffer's token rows of ``pages`` (K layers, then V layers), as SGLang indexes
        them (``buf[page * page_size + t]``): int16 numpy ``[tokens, heads, head_dim]`` each."""
        import torch

        idx = self.slots(pages)
        return [b.view(torch.int16)[idx].numpy().copy() for b in self.bufs]

    def zero(self, pages) -> None:
        idx = self.slots(pages)
        for b in self.bufs:
            b.index_fill_(0, idx, 0)

    def close(self) -> list:
        """Close kvbridge's manager; return what must stay alive until the process exits.

        SGLang's ``MooncakeKVManager.teardown`` (meant for role switches) destroys its ZMQ
        context under its own bootstrap thread, which aborted the process here (libzmq
        ``Assertion failed: pfd.revents & POLLIN``); so SGLang's manager and both bootstrap
        servers are kept, idle, until the worker exits."""
        keep = [self.pool, self.meta]
        for name, m in list(self.mgr.items()):
            if name == "kvbridge":
                try:
                    m.close()
                except Exception:  # best effort at teardown
                    log.exception("closing the kvbridge manager")
            else:
                keep.append(m)
        self.mgr.clear()
        keep.extend(self.servers)
        self.servers.clear()
        return keep


def poll_until(obj, want, timeout: float, sleep: float = 0.0005):
    """Poll an SGLang KV sender/receiver until a state in ``want`` or Failed, or ``timeout``."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    end = time.monotonic() + timeout
    st = obj.poll()
    while st not in want and st != KVPoll.Failed and time.monotonic() < end:
        time.sleep(sleep)
        st = obj.poll()
    return st


def failure_reason(obj) -> str:
    """What ``obj.failure_exception()`` raises, as text ('' if nothing)."""
    try:
        obj.failure_exception()
    except Exception as e:
        return str(e)
    return ""


def _serve(r: _Rank, backend: str, room: int, pages: list, num_tokens: int, first_token: int, timeout: float) -> dict:
    """Prefill side of one request, in prefill.py's order (one chunk)."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = r.mgr[backend]
    addr = f"127.0.0.1:{r.case['ports'][backend]}"
    sender = r.cls[backend][0](mgr, addr, room, False)  # create_sender
    st = poll_until(sender, (KVPoll.WaitingForInput,), timeout)
    if st != KVPoll.WaitingForInput:
        return {"ok": False, "reason": f"bootstrap: state {int(st)} {failure_reason(sender)}"}
    prefix = sender.pop_decode_prefix_len() if hasattr(sender, "pop_decode_prefix_len") else 0
    num_pages = -(-(num_tokens - prefix) // r.page_size)
    aux = _AUX[backend]
    sender.init(num_pages, aux)
    r.meta.output_ids[aux][0] = first_token  # set_buf before the last chunk's send
    r.meta.cached_tokens[aux][0] = prefix
    r.meta.bootstrap_room[aux, 0] = room
    _COUNTER.reset()
    t0 = time.perf_counter()
    sender.send(np.asarray(pages[: num_pages], dtype=np.int32), None, num_kv_tokens=num_pages * r.page_size)
    st = poll_until(sender, (KVPoll.Success,), timeout)
    dt = time.perf_counter() - t0
    out = {"ok": st == KVPoll.Success, "send_to_success_s": dt, "pieces": _COUNTER.snapshot(t0),
           "reason": "" if st == KVPoll.Success else failure_reason(sender)}
    sender.clear()
    return out


def _pull(r: _Rank, backend: str, room: int, pages: list, num_tokens: int, timeout: float) -> dict:
    """Decode side of one request, in decode.py's order; timed from send_metadata to Success."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = r.mgr[backend]
    addr = f"127.0.0.1:{r.case['ports'][backend]}"
    end = time.monotonic() + timeout
    while not mgr.try_ensure_parallel_info(addr):  # _ensure_prefill_info
        if time.monotonic() > end:
            return {"ok": False, "reason": "no parallel info from the bootstrap server"}
        time.sleep(0.02)
    recv = r.cls[backend][1](mgr, addr, room)
    recv.init(0)
    aux = _AUX[backend]
    r.meta.clear_slot(aux)
    t0 = time.perf_counter()
    recv.send_metadata(np.asarray(pages, dtype=np.int32), aux, None, decode_prefix_len=0)
    st = poll_until(recv, (KVPoll.Success,), timeout)
    dt = time.perf_counter() - t0
    out = {"ok": st == KVPoll.Success, "seconds": dt}
    if st == KVPoll.Success:
        out["output_id"] = int(r.meta.output_ids[aux][0])
        if backend == "kvbridge":
            rec = mgr.kv_receiver.record(room)
            out["record"] = {"plan": rec.plan, "segments": rec.segments, "bytes": rec.bytes, "chunks": rec.chunks,
                             "repack_s": rec.repack_s} if rec else None
    else:
        out["reason"] = failure_reason(recv)
    recv.clear()
    return out


def worker_main(conn, env: dict) -> None:
    """One worker process: imports SGLang once, then plays the roles the parent asks for."""
    os.environ.update(env)
    t0 = time.perf_counter()
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=env.get("KVBRIDGE_BENCH_LOG", "WARNING"))
    try:
        import sglang.srt.disaggregation.mooncake.conn  # noqa: F401  (5-8 s)

        from kvbridge.adapters.sglang import conn as _kvb  # noqa: F401
    except Exception as e:
        conn.send(("error", f"import failed: {e!r}"))
        return
    conn.send(("ready", time.perf_counter() - t0))
    rank: _Rank | None = None
    keep = _ABANDONED  # pools and SGLang's managers outlive each case (see _Rank.close)
    while True:
        cmd = conn.recv()
        op, args = cmd[0], cmd[1:]
        if op == "stop":
            if rank is not None:
                keep.extend(rank.close())
            conn.send(("stopped",))
            conn.close()
            logging.shutdown()
            os._exit(0)  # SGLang's threads and sockets are not torn down (see _Rank.close)
        try:
            if op == "setup":
                if rank is not None:
                    keep.extend(rank.close())
                t = time.perf_counter()
                rank = _Rank(*args)
                conn.send(("ok", time.perf_counter() - t))
            elif op == "serve":
                conn.send(("ok", _serve(rank, *args)))
            elif op == "pull":
                conn.send(("ok", _pull(rank, *args)))
            elif op == "digest":
                conn.send(("ok", rank.digest(*args)))
            elif op == "rows":
                conn.send(("ok", rank.rows(*args)))
            elif op == "zero":
                rank.zero(*args)
                conn.send(("ok", None))
            elif op == "teardown":
                if rank is not None:
                    keep.extend(rank.close())
                rank = None
                conn.send(("ok", None))
            else:
                raise ValueError(op)
        except Exception as e:
            conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
