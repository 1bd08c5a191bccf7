"""``kvbridge bench sglang``: kvbridge's SGLang backend against SGLang's own Mooncake
backend, side by side, in one run.

Both backends are driven identically, by the same worker processes, in the call order
of SGLang's schedulers (prefill.py / decode.py, sglang 0.5.23): real ``MHATokenToKVPool``
pools, ``KVArgs`` filled as ``_init_kv_manager`` fills them, SGLang's bootstrap servers,
the same page ids, Mooncake TCP on 127.0.0.1. Each worker process holds ONE pool per
case and, over it, one manager of each backend (``KVBridgeKVManager`` and SGLang's
``MooncakeKVManager`` with SGLang's shared transfer engine), so both move the very same
bytes between the very same addresses. Transfers alternate between the backends (the
order flips every rep), medians over ``reps``.

Cases:

- ``same_tp``: prefill TP 1 -> decode TP 1, ``tokens`` tokens on contiguous pages: the
  throughput case (end to end: ``send_metadata`` on decode -> Success seen by decode).
- ``tp2to1``: prefill TP 2 -> decode TP 1, ``tp_tokens`` tokens (MHA: each prefill rank
  holds half of every token's heads). SGLang takes its per-token slice path
  (``send_kvcache_slice``); its pieces are COUNTED by wrapping the transfer engine's
  ``batch_transfer_sync`` in the prefill processes (KV pieces and the metadata row's
  pieces apart), and also computed from that code path (pages x page_size x layers x
  K/V per prefill rank). kvbridge's segments are read from the decode's handoff
  record; its decode manager offers receiver staging (``KVBRIDGE_RECV_STAGING_BYTES``).

- ``sweep``: prefill TP 1 -> decode TP 1 again at each prompt length of ``sweep``
  (``per_length``: both backends' effective GB/s per length, for the charts of
  ``kvbridge bench all --plot``).

``samples_detail`` per timed rep: for SGLang, per prefill rank, the time from ``send()``
to its first engine write and from that write's start to the last KV write's end; for
kvbridge, the decode's scatter time out of receiver staging (staged_recv plans).

After every transfer the decode pages are checked against the prefill pages (a blake2b
digest per prefill rank over its head slice of every K and V buffer), and the first
output token in the decode metadata row against the prefill's; the pages are zeroed
before every transfer, so each transfer is verified on its own.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
import traceback
from typing import Callable

__all__ = ["bench_sglang", "sglang_steps"]

log = logging.getLogger(__name__)

BACKENDS = ("kvbridge", "sglang_mooncake")
ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "MC_FORCE_TCP": "1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_LOG_LEVEL": "WARNING",
    "NO_PROXY": "127.0.0.1,localhost",
}
# aux (metadata) rows per backend, so the two never share one
_AUX = {"kvbridge": 1, "sglang_mooncake": 2}


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

        from .conn import KVBridgeKVBootstrapServer, KVBridgeKVManager, KVBridgeKVReceiver, KVBridgeKVSender

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
            # kvbridge (CommonKVManager reads the bootstrap port from the published context)
            sa = publish("kvbridge", "kvbridge")
            if role == "prefill" and rank == 0:
                self.servers.append(KVBridgeKVBootstrapServer(host="127.0.0.1", port=case["ports"]["kvbridge"]))
            self.mgr["kvbridge"] = KVBridgeKVManager(kv_args(), mode, sa, False)
            self.cls["kvbridge"] = (KVBridgeKVSender, KVBridgeKVReceiver)
            # SGLang's Mooncake backend, with its shared transfer engine (instrumented)
            sa = publish("mooncake", "sglang_mooncake")
            maybe_init_shared_mooncake_transfer_engine(gpu_id=None)
            _instrument_engine(get_mooncake_transfer_engine())
            if role == "prefill" and rank == 0:
                self.servers.append(MooncakeKVBootstrapServer(host="127.0.0.1", port=case["ports"]["sglang_mooncake"]))
            mgr = MooncakeKVManager(kv_args(), mode, sa, False)
            _instrument_aux(mgr)
            self.mgr["sglang_mooncake"] = mgr
            self.cls["sglang_mooncake"] = (MooncakeKVSender, MooncakeKVReceiver)
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


def _worker(conn, env: dict) -> None:
    """One worker process: imports SGLang once, then plays the roles the parent asks for."""
    os.environ.update(env)
    t0 = time.perf_counter()
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=env.get("KVBRIDGE_BENCH_LOG", "WARNING"))
    try:
        import sglang.srt.disaggregation.mooncake.conn  # noqa: F401  (5-8 s)

        from . import conn as _kvb  # noqa: F401
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


# -- parent ----------------------------------------------------------------------------


class _Peer:
    def __init__(self, ctx, env: dict, name: str):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, env), daemon=True, name=name)
        self.proc.start()

    def recv(self, timeout: float = 300.0):
        end = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"benchmark worker {self.name} died (exit code {self.proc.exitcode})")
            if time.monotonic() > end:
                raise RuntimeError(f"benchmark worker {self.name} did not answer within {timeout:.0f} s")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"benchmark worker {self.name}: {msg[1]}")
        return msg

    def send(self, *cmd) -> None:
        self.conn.send(cmd)

    def call(self, *cmd, timeout: float = 300.0):
        self.send(*cmd)
        return self.recv(timeout)[1]

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            self.conn.poll(5)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _median(xs):
    return statistics.median(xs) if xs else None


def _run_case(peers: list[_Peer], case: dict, reps: int, timeout: float, say, room_ids) -> dict:
    """Set a case up on the workers, transfer (warm-up + ``reps`` per backend, alternating),
    verify every transfer, tear down. Returns per-backend samples and checks."""
    p_tp, d_tp, ps = case["p_tp"], case["d_tp"], case["page_size"]
    pre, dec = peers[:p_tp], peers[p_tp:p_tp + d_tp]
    assert d_tp == 1, "the decode side is one rank here"
    d = dec[0]
    setup_s = {}
    for rank, p in enumerate(pre):  # rank 0 starts the bootstrap servers
        setup_s[f"prefill{rank}"] = p.call("setup", "prefill", case, rank)
    setup_s["decode"] = d.call("setup", "decode", case, 0)
    npages = -(-case["tokens"] // ps)
    src_pages = list(range(1, npages + 1))
    dst_pages = list(range(1, npages + 1))
    want = [p.call("digest", src_pages, 1)[0] for p in pre]  # per prefill rank, its heads
    res = {b: {"seconds": [], "send_s": [], "ok": 0, "failed": 0, "verified": 0, "reasons": [], "pieces": None,
               "record": None, "engine": []} for b in BACKENDS}
    order = list(BACKENDS)
    for i in range(reps + 1):  # rep 0 warms up connections; not timed
        for backend in order:
            room = next(room_ids)
            say(f"{case['name']}: {backend} {'warm-up' if i == 0 else f'rep {i}/{reps}'}")
            d.call("zero", dst_pages)
            first = room % 1000 + 7
            for p in pre:
                p.send("serve", backend, room, src_pages, case["tokens"], first, timeout)
            d.send("pull", backend, room, dst_pages, case["tokens"], timeout)
            pulled = d.recv(timeout + 30)[1]
            served = [p.recv(timeout + 30)[1] for p in pre]
            r = res[backend]
            ok = pulled["ok"] and all(s["ok"] for s in served)
            if not ok:
                r["failed"] += 1
                r["reasons"].append(pulled.get("reason") or next(s["reason"] for s in served if not s["ok"]))
                log.warning("%s %s failed: %s", case["name"], backend, r["reasons"][-1])
                continue
            r["ok"] += 1
            got = d.call("digest", dst_pages, p_tp)
            good = got == want and pulled["output_id"] == first
            r["verified"] += int(good)
            if not good:
                r["reasons"].append(f"room {room}: decode pages or metadata row differ from the prefill's")
            if backend == "sglang_mooncake":
                r["pieces"] = [s["pieces"] for s in served]
            else:
                r["record"] = pulled.get("record")
            if i > 0:
                r["seconds"].append(pulled["seconds"])
                r["send_s"].append(max(s["send_to_success_s"] for s in served))
                if backend == "sglang_mooncake":  # where SGLang's time went, per prefill rank
                    r["engine"].append([{"send_to_first_write_s": round(x["pieces"]["send_to_first_write_s"] or 0, 4),
                                         "engine_write_s": round(x["pieces"]["kv_write_s"] or 0, 4)} for x in served])
                else:
                    rec = pulled.get("record") or {}
                    r["engine"].append({"decode_scatter_s": round(rec.get("repack_s") or 0.0, 4)})
        order.reverse()
    for p in pre + [d]:
        p.call("teardown")
    res["setup_s"] = setup_s
    return res


def sglang_steps(reps: int, sweep: tuple[int, ...] = ()) -> int:
    """How many times ``bench_sglang`` calls ``progress`` (for a progress bar)."""
    return 1 + (2 + len(sweep)) * (reps + 1) * len(BACKENDS)


def bench_sglang(
    *,
    tokens: int = 8192,
    tp_tokens: int = 1024,
    layers: int = 8,
    heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    dtype: str = "bfloat16",
    reps: int = 3,
    timeout_s: float = 120.0,
    mc_tcp_max_queued: int | None = None,
    sweep: tuple[int, ...] = (),
    sweep_layers: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the benchmark in three spawned worker processes; returns a JSON-ready dict.

    ``mc_tcp_max_queued``: if set, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` for the worker
    processes (Mooncake's default is 1024 per peer; SGLang's slice path may need more at
    larger ``tp_tokens``). It applies to the whole process, hence to both backends.
    ``sweep``: prompt lengths of the same-TP case measured again, one case each, with
    ``sweep_layers`` layers (default ``layers``; ``kvbridge bench all`` passes the transfer
    suite's, so both sweeps move the same bytes per token)."""
    if any(int(n) <= 0 for n in sweep):
        raise ValueError(f"sweep lengths must be positive, got {list(sweep)}")
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4 if dtype == "float32" else 1
    if itemsize != 2:
        raise ValueError("the benchmark compares 16-bit KV (bfloat16/float16)")
    token_bytes = layers * 2 * heads * head_dim * itemsize  # every layer's K and V of one token
    # receiver staging for the decode: what one TP 2 -> 1 request needs from both prefill ranks
    staging = 2 * tp_tokens * token_bytes
    env = {**ENV, "KVBRIDGE_RECV_STAGING_BYTES": str(staging)}
    if mc_tcp_max_queued:
        env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(int(mc_tcp_max_queued))
    ctx = mp.get_context("spawn")
    say("starting workers (each imports SGLang)")
    peers = [_Peer(ctx, env, f"sglang-bench-{i}") for i in range(3)]
    base = 20000 + random.randint(0, 4000) * 4
    rooms = iter(range(random.randint(1 << 20, 1 << 30), 1 << 31))
    try:
        import_s = [p.recv(300)[1] for p in peers]
        geom = dict(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, page_size=page_size)

        def case(name, ntok, p_tp, port0, seed, **over):
            slots = (-(-ntok // page_size) + 2) * page_size
            return dict(name=name, tokens=ntok, p_tp=p_tp, d_tp=1, slots=slots, seed=seed,
                        ports={"kvbridge": port0, "sglang_mooncake": port0 + 1}, **{**geom, **over})

        same = _run_case([peers[0], peers[2]], case("same_tp", tokens, 1, base, 1), reps, timeout_s, say, rooms)
        tp21 = _run_case(peers, case("tp2to1", tp_tokens, 2, base + 2, 2), reps, timeout_s, say, rooms)
        s_layers = sweep_layers or layers
        swept = [(int(n), _run_case([peers[0], peers[2]], case(f"sweep {n} tokens", int(n), 1, base + 4 + 2 * i, 3 + i,
                                                               layers=s_layers), reps, timeout_s, say, rooms))
                 for i, n in enumerate(sweep)]
    finally:
        for p in peers:
            try:
                p.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in peers:
            p.stop()

    def gbps(nbytes, xs):
        m = _median(xs)
        return round(nbytes / m / 1e9, 4) if m else None

    def summary(res: dict, nbytes: int) -> dict:
        out = {}
        for b in BACKENDS:
            r = res[b]
            out[b] = {"gbps": gbps(nbytes, r["seconds"]), "median_ms": round(_median(r["seconds"]) * 1e3, 2) if r["seconds"] else None,
                      "send_to_success_median_ms": round(_median(r["send_s"]) * 1e3, 2) if r["send_s"] else None,
                      "transfers_ok": r["ok"], "transfers_failed": r["failed"], "transfers_verified": r["verified"],
                      "samples_s": [round(x, 5) for x in r["seconds"]], "errors": r["reasons"][:3],
                      "samples_detail": r["engine"]}
        return out

    same_bytes = tokens * token_bytes
    tp_bytes = tp_tokens * token_bytes
    s_same, s_tp = summary(same, same_bytes), summary(tp21, tp_bytes)

    def ratio(s):
        a, b = s["kvbridge"]["gbps"], s["sglang_mooncake"]["gbps"]
        return round(a / b, 3) if a and b else None

    def kvb_segments(res):
        rec = res["kvbridge"]["record"]
        return rec["segments"] if rec else None

    def sgl_pieces(res, key="kv_pieces"):
        p = res["sglang_mooncake"]["pieces"]
        return sum(x[key] for x in p) if p else None

    tp_pages = -(-tp_tokens // page_size)
    sgl_expected = 2 * tp_pages * page_size * layers * 2  # send_kvcache_slice: per rank, token slot x layer x K/V
    kseg, sseg = kvb_segments(tp21), sgl_pieces(tp21)
    verified = {b: all(c[b]["verified"] == reps + 1 for c in [same, tp21] + [r for _, r in swept]) for b in BACKENDS}
    per_length = []
    sweep_token_bytes = token_bytes // layers * (sweep_layers or layers)
    for n, r in swept:
        sm = summary(r, n * sweep_token_bytes)
        per_length.append({"tokens": n, "bytes": n * sweep_token_bytes, "layers": sweep_layers or layers,
                           **{f"{b}_gbps": sm[b]["gbps"] for b in BACKENDS},
                           **{f"{b}_median_ms": sm[b]["median_ms"] for b in BACKENDS},
                           **{f"{b}_gbps_range": [round(n * sweep_token_bytes / max(r[b]["seconds"]) / 1e9, 4),
                                                  round(n * sweep_token_bytes / min(r[b]["seconds"]) / 1e9, 4)]
                              if r[b]["seconds"] else None for b in BACKENDS},
                           "runs": reps,
                           "verified": {b: r[b]["verified"] == reps + 1 for b in BACKENDS}})
    return {
        "geometry": {**geom, "tokens": tokens, "tp_tokens": tp_tokens, "transport": "mooncake tcp 127.0.0.1",
                     "pages": "contiguous 1..N on both sides", "bytes_same_tp": same_bytes, "bytes_tp2to1": tp_bytes},
        "kvbridge_gbps": s_same["kvbridge"]["gbps"],
        "sglang_mooncake_gbps": s_same["sglang_mooncake"]["gbps"],
        "ratio": ratio(s_same),
        "kvbridge_segments_same_tp": kvb_segments(same),
        "kvbridge_plan_same_tp": (same["kvbridge"]["record"] or {}).get("plan"),
        "sglang_segments_same_tp": sgl_pieces(same),
        "kvbridge_segments_tp2to1": kseg,
        "kvbridge_plan_tp2to1": (tp21["kvbridge"]["record"] or {}).get("plan"),
        "sglang_segments_tp2to1": sseg,
        "sglang_segments_tp2to1_expected": sgl_expected,
        "sglang_segments_tp2to1_how": "counted: pieces passed to the shared Mooncake engine's batch_transfer_sync "
                                      "during the request, metadata-row pieces excluded",
        "sglang_aux_pieces_tp2to1": sgl_pieces(tp21, "aux_pieces"),
        "sglang_max_pieces_per_call_tp2to1": max((x["max_pieces_per_call"] for x in tp21["sglang_mooncake"]["pieces"] or []),
                                                 default=None),
        "segments_ratio_tp2to1": round(sseg / kseg, 1) if kseg and sseg else None,
        "kvbridge_gbps_tp2to1": s_tp["kvbridge"]["gbps"],
        "sglang_mooncake_gbps_tp2to1": s_tp["sglang_mooncake"]["gbps"],
        "ratio_tp2to1": ratio(s_tp),
        "verified": verified,
        "per_length": per_length,
        "same_tp": s_same,
        "tp2to1": s_tp,
        "settings": {"KVBRIDGE_RECV_STAGING_BYTES": staging,
                     "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": env.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "default (1024)")},
        "reps": reps,
        "import_s": [round(x, 2) for x in import_s],
        "setup_s": {"same_tp": same["setup_s"], "tp2to1": tp21["setup_s"], **{f"sweep_{n}": r["setup_s"] for n, r in swept}},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
