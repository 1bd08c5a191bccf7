"""``kvbridge bench sglang``: kvbridge's SGLang backend against SGLang's own Mooncake
backend and, where NIXL is installed, SGLang's own NIXL backend, side by side, in one run.

The backends are driven identically, in the call order
of SGLang's schedulers (prefill.py / decode.py, sglang 0.5.23): real ``MHATokenToKVPool``
pools, ``KVArgs`` filled as ``_init_kv_manager`` fills them, SGLang's bootstrap servers,
the same page ids, Mooncake TCP on 127.0.0.1. Each worker process holds ONE pool per
case and, over it, one manager of each backend (``KVBridgeKVManager`` and SGLang's
``MooncakeKVManager`` with SGLang's shared transfer engine), so both move the very same
bytes between the very same addresses. Transfers alternate between the backends (the
order flips every rep), medians over ``reps``.

SGLang's NIXL backend (``NixlKVManager``, UCX) runs in a pair of worker processes of its
own, over pools of the same geometry and the same seeded bytes registered as host memory
(``DRAM``), with UCX's transports limited by ``nixl_tls`` (default ``tcp``, the transport
the Mooncake backends use here; ``""`` lets UCX choose: shared memory on one host). An
idle UCX agent spins its progress thread (on this 2-core class it slowed a two-thread copy
in another process 1.4-1.8x), so those two processes are stopped (SIGSTOP) while the other
backends transfer, and resumed for NIXL's own transfers, which take their turn in the same
alternation. It runs the same-TP and sweep cases; TP 2 -> 1 into host memory SGLang
refuses (``NotImplementedError`` "heterogeneous-TP direct-to-host KV transfer", sglang
0.5.23 ``disaggregation/nixl/conn.py``), so that case leaves it out and says so.

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

This module is the parent (cases, timing, summary); the worker processes are
``kvbridge.bench.sglang_worker``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import signal
import statistics
import time
from typing import Callable

from .sglang_worker import worker_main

__all__ = ["bench_sglang", "sglang_steps"]

log = logging.getLogger(__name__)

BACKENDS = ("kvbridge", "sglang_mooncake", "sglang_nixl")
NIXL_TP2TO1 = ("SGLang's NIXL backend refuses TP 2 -> 1 into host memory: NotImplementedError 'NIXL "
               "heterogeneous-TP direct-to-host KV transfer is not implemented safely yet' (sglang 0.5.23 "
               "disaggregation/nixl/conn.py)")


def nixl_installed() -> bool:
    """Whether the ``nixl`` package (its meta package and a backend wheel) can be found."""
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "MC_FORCE_TCP": "1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_LOG_LEVEL": "WARNING",
    "NIXL_LOG_LEVEL": "WARN",  # NIXL's Python logger writes to stdout, where `--json` prints
    "NO_PROXY": "127.0.0.1,localhost",
}

# -- parent ----------------------------------------------------------------------------


class _Peer:
    def __init__(self, ctx, env: dict, name: str):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, env), daemon=True, name=name)
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


class _Group:
    """The worker processes one or more backends run in: prefill ranks and one decode rank.
    A group with ``paused`` set is held stopped (SIGSTOP) while other groups transfer."""

    def __init__(self, backends: tuple[str, ...], pre: list[_Peer], dec: _Peer, paused: bool = False):
        self.backends, self.pre, self.dec, self.paused = backends, pre, dec, paused

    def signal(self, sig) -> None:
        if self.paused:
            for p in self.pre + [self.dec]:
                os.kill(p.proc.pid, sig)
            if sig == signal.SIGCONT:
                time.sleep(0.05)  # its threads run again before the clock starts


def _run_case(groups: list[_Group], case: dict, reps: int, timeout: float, say, room_ids, keep: dict | None = None) -> dict:
    """Set a case up on the workers, transfer (warm-up + ``reps`` per backend, alternating),
    verify every transfer, tear down. Returns per-backend samples and checks. ``keep``:
    per backend, the last successful transfer's rows (``rows``) of each prefill rank and of
    the decode, for a check outside the bench."""
    p_tp, d_tp, ps = case["p_tp"], case["d_tp"], case["page_size"]
    assert d_tp == 1, "the decode side is one rank here"
    setup_s = {}
    npages = -(-case["tokens"] // ps)
    src_pages = list(range(1, npages + 1))
    dst_pages = list(range(1, npages + 1))
    want, group_of = {}, {}
    for g in groups:
        g.signal(signal.SIGCONT)
        sub = {**case, "backends": g.backends}
        tag = "_" + "_".join(g.backends) if g.paused else ""
        for rank, p in enumerate(g.pre):  # rank 0 starts the bootstrap servers
            setup_s[f"prefill{rank}{tag}"] = p.call("setup", "prefill", sub, rank)
        setup_s[f"decode{tag}"] = g.dec.call("setup", "decode", sub, 0)
        digests = [p.call("digest", src_pages, 1)[0] for p in g.pre]  # per prefill rank, its heads
        g.signal(signal.SIGSTOP)
        for b in g.backends:
            want[b], group_of[b] = digests, g
    res = {b: {"seconds": [], "send_s": [], "ok": 0, "failed": 0, "verified": 0, "reasons": [], "pieces": None,
               "record": None, "engine": []} for b in group_of}
    order = list(group_of)
    for i in range(reps + 1):  # rep 0 warms up connections; not timed
        for backend in order:
            g = group_of[backend]
            pre, d = g.pre, g.dec
            g.signal(signal.SIGCONT)
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
                g.signal(signal.SIGSTOP)
                continue
            r["ok"] += 1
            if keep is not None:
                keep[(case["name"], backend)] = {"prefill": [p.call("rows", src_pages) for p in pre],
                                                 "decode": d.call("rows", dst_pages), "tokens": case["tokens"]}
            got = d.call("digest", dst_pages, p_tp)
            good = got == want[backend] and pulled["output_id"] == first
            r["verified"] += int(good)
            if not good:
                r["reasons"].append(f"room {room}: decode pages or metadata row differ from the prefill's")
            if backend == "sglang_mooncake":
                r["pieces"] = [s["pieces"] for s in served]
            elif backend == "kvbridge":
                r["record"] = pulled.get("record")
            if i > 0:
                r["seconds"].append(pulled["seconds"])
                r["send_s"].append(max(s["send_to_success_s"] for s in served))
                if backend == "sglang_mooncake":  # where SGLang's time went, per prefill rank
                    r["engine"].append([{"send_to_first_write_s": round(x["pieces"]["send_to_first_write_s"] or 0, 4),
                                         "engine_write_s": round(x["pieces"]["kv_write_s"] or 0, 4)} for x in served])
                elif backend == "kvbridge":
                    rec = pulled.get("record") or {}
                    r["engine"].append({"decode_scatter_s": round(rec.get("repack_s") or 0.0, 4)})
            g.signal(signal.SIGSTOP)
        order.reverse()
    for g in groups:
        g.signal(signal.SIGCONT)
        for p in g.pre + [g.dec]:
            p.call("teardown")
        g.signal(signal.SIGSTOP)
    res["setup_s"] = setup_s
    return res


def sglang_steps(reps: int, sweep: tuple[int, ...] = (), nixl: bool | None = None) -> int:
    """How many times ``bench_sglang`` calls ``progress`` (for a progress bar)."""
    nixl = nixl_installed() if nixl is None else nixl
    return 1 + (2 + len(sweep)) * (reps + 1) * 2 + (1 + len(sweep)) * (reps + 1) * int(nixl)


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
    keep: dict | None = None,
    nixl: bool | None = None,
    nixl_tls: str = "tcp",
) -> dict:
    """Run the benchmark in spawned worker processes (three, five with NIXL); returns a
    JSON-ready dict.
    ``keep``: filled per (case name, backend) with the last transfer's token rows on each
    side (see ``_run_case``).

    ``mc_tcp_max_queued``: if set, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` for the worker
    processes (Mooncake's default is 1024 per peer; SGLang's slice path may need more at
    larger ``tp_tokens``). It applies to the whole process, hence to both backends.
    ``sweep``: prompt lengths of the same-TP case measured again, one case each, with
    ``sweep_layers`` layers (default ``layers``; ``kvbridge bench all`` passes the transfer
    suite's, so both sweeps move the same bytes per token).
    ``nixl``: run SGLang's NIXL backend too (``None``: where the ``nixl`` package is
    installed); ``nixl_tls``: UCX's ``UCX_TLS`` for it (``""``: UCX's own choice)."""
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
    nixl = nixl_installed() if nixl is None else nixl
    if nixl and nixl_tls:
        env["UCX_TLS"] = nixl_tls
    run_backends = BACKENDS if nixl else BACKENDS[:2]
    ctx = mp.get_context("spawn")
    say("starting workers (each imports SGLang)")
    # 0, 1: prefill ranks, 2: decode (kvbridge and SGLang's Mooncake backend); 3, 4: prefill and
    # decode of SGLang's NIXL backend, stopped while the others transfer: an idle UCX agent
    # spins its progress thread, which would take a core from them
    peers = [_Peer(ctx, env, f"sglang-bench-{i}") for i in range(5 if nixl else 3)]
    base = 20000 + random.randint(0, 2000) * 8
    rooms = iter(range(random.randint(1 << 20, 1 << 30), 1 << 31))
    try:
        import_s = [p.recv(300)[1] for p in peers]
        geom = dict(layers=layers, heads=heads, head_dim=head_dim, dtype=dtype, page_size=page_size)

        def case(name, ntok, p_tp, port0, seed, **over):
            slots = (-(-ntok // page_size) + 2) * page_size
            return dict(name=name, tokens=ntok, p_tp=p_tp, d_tp=1, slots=slots, seed=seed,
                        ports={b: port0 + i for i, b in enumerate(BACKENDS)}, **{**geom, **over})

        one_to_one = [_Group(BACKENDS[:2], [peers[0]], peers[2])]
        if nixl:
            one_to_one.append(_Group(BACKENDS[2:], [peers[3]], peers[4], paused=True))
        same = _run_case(one_to_one, case("same_tp", tokens, 1, base, 1), reps, timeout_s, say, rooms, keep)
        tp21 = _run_case([_Group(BACKENDS[:2], peers[:2], peers[2])], case("tp2to1", tp_tokens, 2, base + 3, 2),
                         reps, timeout_s, say, rooms, keep)
        s_layers = sweep_layers or layers
        swept = [(int(n), _run_case(one_to_one, case(f"sweep {n} tokens", int(n), 1, base + 6 + 3 * i, 3 + i,
                                                     layers=s_layers), reps, timeout_s, say, rooms))
                 for i, n in enumerate(sweep)]
    finally:
        for p in peers:
            try:
                os.kill(p.proc.pid, signal.SIGCONT)  # a stopped worker cannot stop itself
            except OSError:
                pass
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
            if b not in res:
                continue
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

    def ratio(s, other="sglang_mooncake"):
        if other not in s:
            return None
        a, b = s["kvbridge"]["gbps"], s[other]["gbps"]
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
    verified = {b: all(c[b]["verified"] == reps + 1 for c in [same, tp21] + [r for _, r in swept] if b in c) for b in run_backends}
    per_length = []
    sweep_token_bytes = token_bytes // layers * (sweep_layers or layers)
    for n, r in swept:
        sm = summary(r, n * sweep_token_bytes)
        per_length.append({"tokens": n, "bytes": n * sweep_token_bytes, "layers": sweep_layers or layers,
                           **{f"{b}_gbps": sm[b]["gbps"] for b in run_backends},
                           **{f"{b}_median_ms": sm[b]["median_ms"] for b in run_backends},
                           **{f"{b}_gbps_range": [round(n * sweep_token_bytes / max(r[b]["seconds"]) / 1e9, 4),
                                                  round(n * sweep_token_bytes / min(r[b]["seconds"]) / 1e9, 4)]
                              if r[b]["seconds"] else None for b in run_backends},
                           "runs": reps,
                           "verified": {b: r[b]["verified"] == reps + 1 for b in run_backends}})
    return {
        "geometry": {**geom, "tokens": tokens, "tp_tokens": tp_tokens, "transport": "mooncake tcp 127.0.0.1",
                     "pages": "contiguous 1..N on both sides", "bytes_same_tp": same_bytes, "bytes_tp2to1": tp_bytes},
        "kvbridge_gbps": s_same["kvbridge"]["gbps"],
        "sglang_mooncake_gbps": s_same["sglang_mooncake"]["gbps"],
        "ratio": ratio(s_same),
        "sglang_nixl_gbps": s_same["sglang_nixl"]["gbps"] if nixl else None,
        "ratio_vs_nixl": ratio(s_same, "sglang_nixl"),
        "nixl": {"ran": nixl, "transport": f"UCX, UCX_TLS={nixl_tls or '(UCX chooses)'}, host memory (DRAM)",
                 "tp2to1": NIXL_TP2TO1} if nixl else
                {"ran": False, "why": "left out (nixl=False)" if nixl_installed() else
                 "the nixl package is not installed (it is pinned in requirements/sglang.txt)"},
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
