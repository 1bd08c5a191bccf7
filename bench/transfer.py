"""``kvbridge bench transfer``: a real handoff against a raw Mooncake write, same run.

Two OS processes over Mooncake TCP on 127.0.0.1: a prefill peer with an SGLang-format
pool (NHD, page 64) and a decode peer with a TensorRT-LLM-format pool (HND, block 32),
32 layers x 8 KV heads x head_dim 128, bf16. Measured, interleaved over ``reps``:

- ``handoff``: 8192 tokens, request sent -> Success seen by the decode side (control
  round trip, plan, gather, write, done message: everything);
- ``raw``: Mooncake writes of the same total bytes: first ``RAW_PICK_ROUNDS`` rounds of
  every shape of ``RAW_SEGMENTS`` x ``RAW_DEPTHS`` (segment size, writes in flight) pick the
  fastest (``best_raw_shape``, each shape's GB/s in ``raw_shapes``); then in each repetition
  that shape is the baseline of ``ratio`` and ``same_layout_ratio``, and the one batch of
  4 MiB segments is reported beside it (``one_batch_*``);
- ``scattered``: the handoff into every-other destination block;
- ``same_layout``: the same tokens into a second SGLang pool of the prefill's own geometry
  (no repack: a direct plan), which shows what the protocol costs apart from the repack;
- ``small``: a 128-token handoff to a warm peer, against the fastest raw shape for its
  bytes (picked before, ``small_raw_shape``), each handoff paired with the write before it;
- ``small_orders``: the same request in each engine's order (``ORDERS``): SGLang's decode
  asks before the KV is ready, TensorRT-LLM's generation side after the context is over.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import os
import secrets
import statistics
import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from kvbridge.bench.machine import copy_floor, machine_notes, spread
from kvbridge.common.settings import HandoffConfig
from kvbridge.layout.plan import PlanCosts

__all__ = ["bench_transfer", "transfer_steps"]

GEOM = dict(layers=32, total_heads=8, head_dim=128, dtype="bf16")
# The small request in the two orders engines produce (``small_orders``), beside the one
# above (``small``: the KV ready and the request sent at once, a race neither engine runs).
ORDERS = {
    "request_first": "SGLang's order: the decode asks first; timed from the KV ready (send_chunk) to the decode's Success",
    "data_first": "TensorRT-LLM's order: the context is over before the generation side asks (10 ms later here); "
                  "timed from the request to the decode's Success",
}
DATA_FIRST_GAP_S = 0.010
ORDER_PAIRS = 13  # per repetition: pairs of a raw write and a handoff, each order
SRC_PAGE, DST_BLOCK = 64, 32
RAW_SEGMENTS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)  # bytes per segment of a raw write
RAW_DEPTHS = (0, 1, 2, 4, 8)  # writes in flight, one segment each; 0: every segment in one batch write
ONE_BATCH = (4 << 20, 0)
LINK_PAIRS = 25  # pairs behind each of the link's setup and repack_overlap (their medians)
OVERLAP_TOKENS = 2048  # the staged handoffs that measure repack_overlap (apart from the check's 1024)
CHECK_OVERLAP_PAIRS = 2  # of those, per repetition of the cost model's check
# the raw writes behind the cost model's wire: shaped as a staged send writes (parts of
# part_bytes, ring_parts in flight), so that its bandwidth is the handoff's own wire and no
# shape difference is left for repack_overlap or setup to absorb
WIRE_SHAPE = (HandoffConfig.part_bytes, HandoffConfig.ring_parts)
RAW_PICK_ROUNDS = 3  # rounds of every shape that pick the fastest, before the repetitions


def _cpu_seconds(pids) -> float | None:
    """User + system CPU seconds the processes ``pids`` have used so far (None off Linux)."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    except (OSError, ValueError, IndexError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def _bytes_per_token() -> int:
    return GEOM["layers"] * 2 * GEOM["total_heads"] * GEOM["head_dim"] * 2


def _timeline(recv: dict, send: dict) -> dict:
    """One handoff's critical path from both sides' records (``time.monotonic()`` is
    host-wide, so the two processes' marks compare), in seconds: ``request`` (the decode's
    request call until its frame reached the sender: building, sealing, the control
    channel), ``accept`` (opening and checking it until the sender took it), ``first_write``
    (the send worker, the plan and the first gather), ``writes`` (every part on the wire,
    later gathers beside them), ``done`` (the TransferDone handed to the control channel
    until its frame reached the decode), ``settle`` (opening it until the room settled),
    ``wake`` (until the waiting thread ran)."""
    return {"request": send["heard_at"] - recv["asked"], "accept": send["asked_at"] - send["heard_at"],
            "first_write": send["wrote_at"] - send["asked_at"], "writes": send["done_at"] - send["wrote_at"],
            "done": recv["done_heard"] - send["done_at"], "settle": recv["settled"] - recv["done_heard"],
            "wake": recv["woke"] - recv["settled"]}


def _serve(conn, handle) -> None:
    """Answer the parent's commands until "stop"; an exception goes back as ("error", text)."""
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        try:
            conn.send(handle(cmd))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _pool(engine: str, tokens: int, scattered_room: bool, seed: int | None):
    from kvbridge.layout import allocate_pool

    tpb = SRC_PAGE if engine == "sglang" else DST_BLOCK
    blocks = (2 if scattered_room else 1) * (-(-tokens // tpb)) + 4
    return allocate_pool(engine, tokens_per_block=tpb, num_blocks=blocks, seed=seed, **GEOM)


class _Echo:
    """A bare ZMQ ROUTER on a thread of its own that answers each message at once: the far
    end of ``control_floor_ms``, two one-way hops between the peers' processes with no work
    on either side, as the control channel's I/O thread waits for frames."""

    def __init__(self):
        import threading

        import zmq

        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-echo", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(50):
                    self._sock.send_multipart(self._sock.recv_multipart())
        finally:
            self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _prefill_peer(conn, tokens: int, cfg: dict) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.common.handoff import KVSender
    from kvbridge.common.settings import handoff_config
    from kvbridge.common.transport import MooncakeTransport

    lay = _pool("sglang", tokens, False, 1)
    transport = MooncakeTransport("127.0.0.1")
    sender = KVSender(lay, transport, config=handoff_config(cfg), workers=1)
    # raw-write source: a registered buffer as large as the biggest request
    raw_src = torch.empty(tokens * _bytes_per_token(), dtype=torch.uint8)
    raw_src.random_(0, 255)
    transport.register_tensor(raw_src)
    conn.send(("ready", sender.endpoint))
    echo: list = []

    def handle(cmd):
        if cmd[0] in ("serve", "serve_asked"):
            _, room, n = cmd
            pages = np.arange(1, 1 + -(-n // SRC_PAGE))
            sender.add_room(room, pages)
            if cmd[0] == "serve_asked":  # SGLang's order: the decode's request is here before the KV is
                end = time.monotonic() + 10
                while not sender.requests(room):
                    if time.monotonic() > end:
                        raise RuntimeError(f"room {room}: no request came within 10 s")
                    time.sleep(100e-6)
            ready = time.monotonic()
            sender.send_chunk(room, pages, 0, n, last=True, aux={"output_ids": [1]})
            return ("ok", ready)
        if cmd[0] == "raw":  # nbytes as segments of `piece` bytes: one batch (depth 0) or `depth` in flight
            _, session, dst, nbytes, piece, depth = cmd
            k = -(-nbytes // piece)
            offs = np.arange(k, dtype=np.int64) * piece
            lens = np.minimum(piece, nbytes - offs)
            src = raw_src.data_ptr() + offs
            t0 = time.perf_counter()
            if depth == 0:
                transport.write(session, src, dst + offs, lens, 60)
            else:
                inflight: deque = deque()
                for i in range(k):
                    if len(inflight) == depth:
                        inflight.popleft().wait()
                    inflight.append(transport.write_async(session, src[i:i + 1], dst + offs[i:i + 1], lens[i:i + 1], 60))
                while inflight:
                    inflight.popleft().wait()
            return ("ok", time.perf_counter() - t0)
        if cmd[0] == "raw_pieces":  # n pieces of `size` bytes, scattered by `stride`, in one write
            _, session, dst, n, size, stride = cmd
            offs = np.arange(n, dtype=np.int64) * stride
            t0 = time.perf_counter()
            transport.write(session, raw_src.data_ptr() + offs, dst + offs, np.full(n, size, dtype=np.int64), 60)
            return ("ok", time.perf_counter() - t0)
        if cmd[0] == "echo":  # the control floor's far end (``_Echo``)
            if not echo:
                echo.append(_Echo())
            return ("ok", echo[0].endpoint)
        if cmd[0] == "record":
            rec = sender.record(cmd[1])
            sender.forget(cmd[1])  # as an engine does once a room is over
            return ("ok", rec.as_dict() if rec else None)
        raise ValueError(cmd[0])

    _serve(conn, handle)
    for e in echo:
        e.close()
    sender.close()
    transport.close()


def _decode_peer(conn, tokens: int, cfg: dict) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.common.handoff import KVReceiver, RoomState
    from kvbridge.common.settings import handoff_config
    from kvbridge.common.transport import MooncakeTransport

    lay = _pool("trtllm", tokens, True, None)  # its contents are overwritten anyway
    same = _pool("sglang", tokens, False, None)  # the prefill's own geometry: nothing to repack
    for t in lay.tensors + same.tensors:  # but touched once, as a serving engine's pool is: no timed write pays first-touch page faults
        t.zero_()
    transport = MooncakeTransport("127.0.0.1")
    receivers = {False: KVReceiver(lay, transport, config=handoff_config(cfg, receiver=True)),
                 True: KVReceiver(same, transport, config=handoff_config(cfg, receiver=True))}
    conn.send(("ready", transport.session_id, lay.regions[0].addr))

    asked: dict = {}  # room -> (receiver, perf_counter when asked): "ask" then "wait"

    def ask(room, endpoint, n, scattered, same_layout):
        recv = receivers[same_layout]
        nblk = -(-n // (SRC_PAGE if same_layout else DST_BLOCK))
        blocks = recv.layout.first_block + (np.arange(0, 2 * nblk, 2) if scattered else np.arange(nblk))
        t0 = time.perf_counter()
        recv.request(room, endpoint, blocks, 0, n)
        asked[room] = (recv, t0)

    def wait(room):
        recv, t0 = asked.pop(room)
        state = recv.wait(room, 120)
        dt, woke = time.perf_counter() - t0, time.monotonic()
        rec = recv.record(room)
        reason = recv.failure_reason(room)  # before forget: after it the room is unknown
        recv.forget(room)
        return ("ok", state is RoomState.SUCCESS, dt, rec.bytes, rec.segments, rec.plan, f"{state}: {reason}",
                {"asked": rec.started, "done_heard": rec.heard_at, "settled": rec.finished or 0.0, "woke": woke})

    pingers: dict = {}  # echo endpoint -> DEALER

    def ping(endpoint):
        import zmq

        sock = pingers.get(endpoint)
        if sock is None:
            sock = pingers[endpoint] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(b"")  # connected and warm before the first timed ping
            sock.recv()
        t0 = time.perf_counter()
        sock.send(b"")
        sock.recv()
        return ("ok", time.perf_counter() - t0)

    def handle(cmd):
        if cmd[0] == "ping":
            return ping(cmd[1])
        if cmd[0] == "ask":  # SGLang's order: the request goes out before the prefill has the KV
            ask(*cmd[1:])
            return ("ok",)
        if cmd[0] == "wait":
            return wait(cmd[1])
        _, room, endpoint, n, scattered, same_layout = cmd
        ask(room, endpoint, n, scattered, same_layout)
        return wait(room)

    _serve(conn, handle)
    for sock in pingers.values():
        sock.close(0)
    for recv in receivers.values():
        recv.close()
    transport.close()


def _recv(conn, proc, timeout: float = 300.0):
    """A peer's answer; raises if it reported an error, died, or went silent."""
    end = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"benchmark peer {proc.name} died (exit code {proc.exitcode})")
        if time.monotonic() > end:
            raise RuntimeError(f"benchmark peer {proc.name} did not answer within {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"benchmark peer {proc.name}: {msg[1]}")
    return msg


def transfer_steps(reps: int, sweep: tuple[int, ...] = (), link_only: bool = False) -> int:
    """How many times ``bench_transfer`` calls ``progress`` (for a progress bar)."""
    return 3 + (0 if link_only else reps + len(sweep) + 3)


def _paired_cost(ctx, n: int, cfg: dict, pairs: int, a: tuple[str, dict], b: tuple[str, dict], what: str) -> dict:
    """The ``n``-token request between two fresh pairs of peers alike but for the settings
    ``a`` and ``b`` ((name, ``handoff_config`` fields)), interleaved ``pairs`` times: medians and
    p10-p90 of each (ms) and of their ratio, a over b."""
    peers = {}
    try:
        for kind, delta in (a, b):
            pc, pchild = ctx.Pipe()
            dc, dchild = ctx.Pipe()
            c = {**cfg, **delta}
            pre = ctx.Process(target=_prefill_peer, args=(pchild, n, c), daemon=True, name=f"prefill-{kind}")
            dec = ctx.Process(target=_decode_peer, args=(dchild, n, c), daemon=True, name=f"decode-{kind}")
            pre.start()
            dec.start()
            peers[kind] = (pc, pre, dc, dec)
        endpoints = {}
        for k, (pc, pre, dc, dec) in peers.items():
            endpoints[k] = _recv(pc, pre)[1]
            _recv(dc, dec)  # ready
        rooms = itertools.count(1)

        def handoff(kind: str) -> float:
            pc, pre, dc, dec = peers[kind]
            r = next(rooms)
            pc.send(("serve", r, n))
            _recv(pc, pre)
            dc.send(("pull", r, endpoints[kind], n, False, False))
            _, ok, dt, *rest = _recv(dc, dec)
            if not ok:
                raise RuntimeError(f"{kind} handoff failed: {rest[3]}")
            return dt

        got = {a[0]: [], b[0]: []}
        for k in got:  # warm: each first request connects
            handoff(k)
        for _ in range(pairs):
            for k in got:
                got[k].append(handoff(k))
    finally:
        for pc, pre, dc, dec in peers.values():
            for conn, proc in ((pc, pre), (dc, dec)):
                try:
                    conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    x, y = got[a[0]], got[b[0]]
    return {f"{a[0]}_ms": spread([v * 1e3 for v in x]), f"{b[0]}_ms": spread([v * 1e3 for v in y]),
            "ratio": spread([p / q for p, q in zip(x, y)], 1.0), "tokens": n, "what": what}


def _auth_cost(ctx, n: int, cfg: dict, pairs: int) -> dict:
    """What authentication costs: control frames sealed against plain."""
    return _paired_cost(ctx, n, cfg, pairs, ("sealed", {"secret": cfg["secret"]}), ("plain", {"secret": ""}),
                        f"the {n}-token request between two fresh pairs of peers, control frames sealed (HMAC-SHA256) "
                        "over the same without a secret, interleaved pairs")


def _integrity_cost(ctx, n: int, cfg: dict, pairs: int) -> dict:
    """What the content digest costs: the decode's integrity on against off."""
    return _paired_cost(ctx, n, cfg, pairs, ("verified", {"integrity": "on"}), ("unverified", {"integrity": "off"}),
                        f"the {n}-token cross-layout request between two fresh pairs of peers, content digests "
                        "taken and compared (XXH3-64 over the canonical rows, both sides) over the same without, "
                        "interleaved pairs")


def _copy_threads_cost(ctx, n: int, cfg: dict, pairs: int) -> dict:
    """The gather on every thread against one (the choice beside TCP, ``copy_choice``)."""
    import torch

    threads = torch.get_num_threads()
    return _paired_cost(ctx, n, cfg, pairs, ("all_threads", {"gather_threads": threads}), ("one_thread", {"gather_threads": 1}),
                        f"the {n}-token cross-layout handoff between two fresh pairs of peers, the sender's gather "
                        f"on {threads} threads over the same on one (TCP's choice), interleaved pairs; a ratio "
                        "over 1: one thread is faster beside this transport")


def bench_transfer(
    *,
    tokens: int = 8192,
    small_tokens: int = 128,
    reps: int = 3,
    chunk_bytes: int = 64 << 20,
    sweep: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384),
    link_only: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the transfer benchmark in two spawned processes; returns a JSON-ready dict.

    Also measures the link (bandwidth, per-segment cost, setup, repack) and checks the
    cost model against measured handoffs over ``sweep`` prompt lengths."""
    from kvbridge.common.costmodel import LinkProfile, predict_handoff_s

    say = progress or (lambda _m: None)
    ctx = mp.get_context("spawn")
    cap = max([tokens, small_tokens] + ([] if link_only else list(sweep)))
    # sealed control frames, as deployed (a routable bind needs a secret); the same small
    # request without one is measured beside it (``auth_cost``)
    cfg = dict(chunk_bytes=chunk_bytes, deadline_s=120.0, write_timeout_s=120.0, secret=secrets.token_hex(32))
    pc, pchild = ctx.Pipe()
    dc, dchild = ctx.Pipe()
    say("starting peers")
    pre = ctx.Process(target=_prefill_peer, args=(pchild, cap, cfg), daemon=True, name="prefill")
    dec = ctx.Process(target=_decode_peer, args=(dchild, cap, cfg), daemon=True, name="decode")
    pre.start()
    dec.start()
    try:
        endpoint = _recv(pc, pre)[1]
        _, session, dst_base = _recv(dc, dec)
        bytes_per_token = _bytes_per_token()
        room = iter(range(1, 1 << 30))

        peers = (pre.pid, dec.pid)
        cpu = {"handoff": [], "raw": [], "same_layout": []}  # both peers' CPU seconds per headline sample

        def ask(conn, proc, cmd: tuple, cpu_into: list | None = None):
            """Send ``cmd`` to a peer and return its answer; with ``cpu_into``, both peers' CPU
            seconds from the send to the answer go into it."""
            c0 = _cpu_seconds(peers) if cpu_into is not None else None
            conn.send(cmd)
            answer = _recv(conn, proc)
            c1 = _cpu_seconds(peers) if c0 is not None else None
            if c1 is not None:
                cpu_into.append(c1 - c0)
            return answer

        def handoff(n: int, scattered: bool = False, same_layout: bool = False,
                    cpu_into: list | None = None, order: str = "") -> tuple[float, dict]:
            """One handoff of ``n`` tokens; its time is the decode's request until its Success,
            or with ``order="request_first"`` the KV ready until then (see ``ORDERS``)."""
            r = next(room)
            if order == "request_first":
                ask(dc, dec, ("ask", r, endpoint, n, scattered, same_layout))
                ready = ask(pc, pre, ("serve_asked", r, n))[1]
                _, ok, dt, nbytes, segs, plan, reason, recv_t = ask(dc, dec, ("wait", r))
                dt = recv_t["woke"] - ready
            else:
                ask(pc, pre, ("serve", r, n))
                if order == "data_first":
                    time.sleep(DATA_FIRST_GAP_S)
                _, ok, dt, nbytes, segs, plan, reason, recv_t = ask(
                    dc, dec, ("pull", r, endpoint, n, scattered, same_layout), cpu_into)
            if not ok:
                raise RuntimeError(f"handoff failed: {reason}")
            pc.send(("record", r))
            rec = _recv(pc, pre)[1]
            return dt, {"bytes": nbytes, "segments": segs, "plan": plan, "repack_s": rec["repack_s"], "chunks": rec["chunks"],
                        "plan_s": rec["plan_s"], "transfer_s": rec["transfer_s"],
                        "timeline": _timeline(recv_t, rec)}

        def raw(n: int, cpu_into: list | None = None, shape: tuple[int, int] = ONE_BATCH) -> float:
            return ask(pc, pre, ("raw", session, dst_base, n * bytes_per_token, *shape), cpu_into)[1]

        def raw_pieces(n: int, size: int) -> float:
            pc.send(("raw_pieces", session, dst_base, n, size, 2 * size))
            return _recv(pc, pre)[1]

        say("warming up")
        raw(small_tokens)
        handoff(small_tokens)

        # -- the link: bandwidth, per-segment cost, setup, repack ---------------------
        say("measuring the link")
        link_tokens = min(cap, 4096)
        t_bw = statistics.median(raw(link_tokens, shape=WIRE_SHAPE) for _ in range(max(5, reps)))  # loopback TCP varies 2x run to run
        bw = link_tokens * bytes_per_token / t_bw
        n_small = 2000
        t_seg = statistics.median(raw_pieces(n_small, 4096) for _ in range(reps))
        per_seg = max(0.0, (t_seg - n_small * 4096 / bw) / n_small)
        # setup: each small handoff against the raw write of its bytes just before it (the
        # link drifts over seconds; a pair's difference does not)
        setups = []
        for _ in range(max(LINK_PAIRS, reps)):
            r0 = raw(small_tokens, shape=WIRE_SHAPE)
            setups.append(handoff(small_tokens)[0] - r0)
        setup = max(0.0, statistics.median(setups))
        # the gather's rate, and how much of it the wire hides: staged handoffs of
        # overlap_tokens, each between two raw writes of the same bytes (their mean is the
        # wire beside it), against repack + wire unhidden (PlanCosts.seconds: hidden = overlap
        # x PlanCosts.hideable_s). One sample varies by about +-1 here (the hideable part is a
        # quarter of the wire, which varies +-15% write to write), hence many pairs; and the
        # median of one stretch of seconds differs from the next by up to 1, so the cost
        # model's check measures it again beside its own handoffs
        overlap_tokens = min(cap, OVERLAP_TOKENS)

        def overlap_pairs(k: int) -> tuple[list[float], list[float]]:
            """``k`` samples of the overlap (unclamped) and of the gather's rate (bytes/s)."""
            hid, rate = [], []
            after = raw(overlap_tokens, shape=WIRE_SHAPE)
            for _ in range(k):
                before = after
                dt, hinfo = handoff(overlap_tokens)
                after = raw(overlap_tokens, shape=WIRE_SHAPE)
                wire_s, rep_s = (before + after) / 2, hinfo["repack_s"]
                if rep_s > 0:
                    rate.append(hinfo["bytes"] / rep_s)
                    hid.append((rep_s + wire_s + setup - dt) / PlanCosts.hideable_s(rep_s, wire_s))
            return hid, rate

        def overlap_of(hid: list[float], default: float) -> float:
            """The overlap from its samples: their median, held within [0, 1] as PlanCosts takes it."""
            return min(1.0, max(0.0, statistics.median(hid))) if hid else default

        handoff(overlap_tokens)  # untimed: the first handoff of this size meets its pages cold
        hidden, rates = overlap_pairs(max(LINK_PAIRS, reps))
        repack_bps = statistics.median(rates) if rates else 8e9
        overlap = overlap_of(hidden, 1.0)
        link = LinkProfile("mooncake-tcp-loopback", bw, per_seg, setup, repack_bps, source="measured",
                           repack_overlap=overlap)
        link_fig = {"name": link.name, "bandwidth_bytes_per_s": bw, "per_segment_s": per_seg, "setup_s": setup,
                    "repack_bytes_per_s": repack_bps, "repack_overlap": round(overlap, 3),
                    # each estimate's samples (medians above): setup ms; overlap, unclamped
                    "samples": {"setup_ms": spread([x * 1e3 for x in setups]),
                                "repack_overlap": spread(hidden)},
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if link_only:
            return {"link": link_fig}

        def fastest_shape(n: int, rounds: int) -> tuple[tuple[int, int], dict]:
            """The raw write shape with the lowest median time for ``n`` tokens' bytes over
            ``rounds`` rounds of every shape (each round in a rotated order), and each shape's
            median. Picked before the pairs it is held against: its time there is a fresh
            draw, not the best of many noisy ones."""
            shapes = [(seg, d) for seg in RAW_SEGMENTS if seg <= max(n * bytes_per_token, RAW_SEGMENTS[0])
                      for d in RAW_DEPTHS]
            got: dict[tuple[int, int], list[float]] = {sh: [] for sh in shapes}
            for i in range(rounds):
                k = i % len(shapes)
                for sh in shapes[k:] + shapes[:k]:
                    got[sh].append(raw(n, shape=sh))
            meds = {sh: statistics.median(v) for sh, v in got.items()}
            return min(meds, key=meds.get), meds

        # -- the headline handoff against raw writes ---------------------------------
        big = {"handoff": [], "raw": [], "best_raw": [], "scattered": [], "same_layout": [], "small": [],
               "small_raw": []}
        nbytes = tokens * bytes_per_token
        say("picking the fastest raw write shape")
        best, raw_shapes = fastest_shape(tokens, RAW_PICK_ROUNDS)
        info, sinfo, linfo = {}, {}, {}
        for i in range(reps):
            say(f"rep {i + 1}/{reps}")
            dt, linfo = handoff(tokens, same_layout=True, cpu_into=cpu["same_layout"])
            big["same_layout"].append(dt)
            # after a pull into the TensorRT-LLM pool, so the handoffs below find the first
            # part prestaged as every one did before (the sender prestages for its last pull)
            dt, sinfo = handoff(tokens, scattered=True)
            big["scattered"].append(dt)
            big["raw"].append(raw(tokens, cpu["raw"]))
            big["best_raw"].append(raw(tokens, shape=best))
            dt, info = handoff(tokens, cpu_into=cpu["handoff"])
            big["handoff"].append(dt)
        # the small request is cheap and one 16 MiB write here takes 5-25 ms from one try to
        # the next: many interleaved pairs, so that the medians hold still
        small_parts = []  # the sender's record of each small handoff: where its time went
        # the small request's baseline: the fastest raw shape for its bytes, picked first
        small_best, _ = fastest_shape(small_tokens, max(RAW_PICK_ROUNDS, reps))
        for i in range(25 * reps):
            big["small_raw"].append(raw(small_tokens, shape=small_best))
            dt, sinfo = handoff(small_tokens)
            big["small"].append(dt)
            small_parts.append((dt, sinfo))
        # the same request in the orders engines produce, each against the raw write just before it
        ordered = {o: {"handoff": [], "raw": [], "timeline": []} for o in ORDERS}
        echo = ask(pc, pre, ("echo",))[1]
        control_floor = []  # two bare ZMQ hops between the peers after the data-first order's idle
        for i in range(ORDER_PAIRS * reps):
            for o, got in ordered.items():
                got["raw"].append(raw(small_tokens, shape=small_best))
                dt, oinfo = handoff(small_tokens, order=o)
                got["handoff"].append(dt)
                got["timeline"].append(oinfo["timeline"])
            time.sleep(DATA_FIRST_GAP_S)
            control_floor.append(ask(dc, dec, ("ping", echo))[1])
        small_orders = {o: {"overhead_ms": spread([(h - r) * 1e3 for h, r in zip(v["handoff"], v["raw"])], 0.0),
                            "handoff_ms": spread([h * 1e3 for h in v["handoff"]]),
                            "raw_ms": spread([r * 1e3 for r in v["raw"]]), "what": ORDERS[o],
                            "timeline_ms": {k: spread([t[k] * 1e3 for t in v["timeline"]]) for k in v["timeline"][0]}}
                        for o, v in ordered.items()}
        med = {k: statistics.median(v) for k, v in big.items()}
        # spreads: each ratio from the pair measured in the same repetition
        spreads = {
            "ratio": spread([r / h for r, h in zip(big["best_raw"], big["handoff"])], 1.0),
            "same_layout_ratio": spread([r / h for r, h in zip(big["best_raw"], big["same_layout"])], 1.0),
            "one_batch_ratio": spread([r / h for r, h in zip(big["raw"], big["handoff"])], 1.0),
            "scattered_ratio": spread([h / s for h, s in zip(big["handoff"], big["scattered"])], 1.0),
            "small_overhead_ms": spread([(h - r) * 1e3 for h, r in zip(big["small"], big["small_raw"])], 0.0),
            "small_handoff_ms": spread([h * 1e3 for h in big["small"]]),
            "small_raw_ms": spread([r * 1e3 for r in big["small_raw"]]),
        }
        # the small request stage by stage (medians): the sender's plan, its gathers (the
        # first one before any byte is on the wire), its writes (submitting and waiting for
        # them), and the rest of the decode's measured time: its request reaching the
        # sender, the TransferDone coming back, the threads in between
        small_stages = {k: [] for k in ("plan", "gather", "wire", "control")}
        for dt, si in small_parts:
            small_stages["plan"].append(si["plan_s"])
            small_stages["gather"].append(si["repack_s"])
            small_stages["wire"].append(si["transfer_s"])
            small_stages["control"].append(dt - si["plan_s"] - si["repack_s"] - si["transfer_s"])
        small_breakdown = {k: round(statistics.median(v) * 1e3, 3) for k, v in small_stages.items()}
        small_timeline = {k: spread([si["timeline"][k] * 1e3 for _, si in small_parts])
                          for k in small_parts[0][1]["timeline"]} if small_parts else {}
        cpu_gib = {k: spread([x * (1 << 30) / nbytes for x in v]) for k, v in cpu.items() if v}
        machine = machine_notes()
        # what one copy of every byte costs here (the gather's floor), the peers idle
        floor = copy_floor(small_tokens * bytes_per_token)
        wide = {**spreads, **{f"small_orders.{o}.overhead_ms": v["overhead_ms"] for o, v in small_orders.items()}}
        warnings = [f"{k}: p10-p90 {v['p10']}-{v['p90']} is wider than the effect it reports "
                    f"(median {v['median']}, against {0.0 if k.endswith('_ms') else 1.0})"
                    for k, v in wide.items() if v.get("wide")]

        # -- the cost model against measured handoffs -------------------------------
        per_len = []
        for n in sweep:
            say(f"cost model check: {n} tokens")
            runs, raws, hid_now = [], [], []
            for _ in range(reps):  # interleaved: the link drifts up to 2x over seconds on loopback
                runs.append(handoff(n))
                raws.append(raw(n, shape=WIRE_SHAPE))
                hid_now += overlap_pairs(CHECK_OVERLAP_PAIRS)[0]
            mid = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            measured, parts = mid
            # the link as it is now (loopback bandwidth drifts up to 2x over a run): the raw
            # writes of this length, taken beside its handoffs, give the bandwidth, and the
            # staged handoffs of overlap_tokens between them the overlap
            overlap_now = overlap_of(hid_now, link.repack_overlap)
            now = dataclasses.replace(link, bandwidth_bytes_per_s=n * bytes_per_token / statistics.median(raws),
                                      repack_overlap=overlap_now)
            pred = predict_handoff_s(parts["bytes"], parts["segments"], now,
                                     staged=parts["plan"] == "staged_send")
            # the sender's own time: plan, the repack not overlapped... the rest is control and notify
            wire = parts["transfer_s"]
            # which term is off: the share of the gather the wire would have had to hide for
            # the prediction to be exact, against the overlap used (overlap_now); staged plans only
            implied = None
            if parts["plan"] == "staged_send":
                rep_n = parts["bytes"] / link.repack_bytes_per_s
                implied = round((pred.setup_s + pred.wire_s + pred.segments_s + rep_n - measured)
                                / PlanCosts.hideable_s(rep_n, pred.wire_s + pred.segments_s), 3)
            per_len.append({"tokens": n, "bytes": parts["bytes"], "measured_ms": round(measured * 1e3, 2),
                            "predicted_ms": round(pred.total_s * 1e3, 2),
                            "error": round(abs(pred.total_s - measured) / measured, 3),
                            "terms_ms": {k: round(getattr(pred, k) * 1e3, 2)
                                         for k in ("setup_s", "wire_s", "segments_s", "repack_s")},
                            "repack_overlap": {**spread(hid_now), "used": round(overlap_now, 3)},
                            "implied_overlap": implied,
                            "handoff_gbps": round(parts["bytes"] / measured / 1e9, 3),
                            "raw_gbps": round(parts["bytes"] / statistics.median(raws) / 1e9, 3),
                            "handoff_gbps_range": [round(parts["bytes"] / max(r[0] for r in runs) / 1e9, 3),
                                                   round(parts["bytes"] / min(r[0] for r in runs) / 1e9, 3)],
                            "raw_gbps_range": [round(parts["bytes"] / max(raws) / 1e9, 3),
                                               round(parts["bytes"] / min(raws) / 1e9, 3)],
                            "runs": len(runs),
                            "breakdown_ms": {"plan": round(parts["plan_s"] * 1e3, 2),
                                             "repack": round(parts["repack_s"] * 1e3, 2),
                                             "transfer": round(wire * 1e3, 2),
                                             "notify": round(max(0.0, measured - parts["plan_s"] - parts["repack_s"] - wire) * 1e3, 2)}})
        say("auth cost: sealed against plain control frames")
        auth_cost = _auth_cost(ctx, small_tokens, cfg, 25 * reps)
        say("integrity cost: content digests on against off")
        integrity_cost = [_integrity_cost(ctx, small_tokens, cfg, 25 * reps), _integrity_cost(ctx, tokens, cfg, 5 * reps)]
        say("copy threads: the gather on every thread against one, over TCP")
        copy_threads_cost = _copy_threads_cost(ctx, tokens, cfg, 5 * reps)
        return {
            "copy_threads_cost": copy_threads_cost,
            "auth_cost": auth_cost,
            "integrity_cost": integrity_cost,
            "geometry": {**GEOM, "tokens": tokens, "src": f"sglang page {SRC_PAGE} (NHD)",
                         "dst": f"trtllm tokens_per_block {DST_BLOCK} (HND)", "link": "mooncake tcp 127.0.0.1"},
            "bytes": nbytes,
            "handoff_gbps": round(nbytes / med["handoff"] / 1e9, 3),
            # the baseline: the fastest raw write of the same bytes (shape by median)
            "raw_gbps": round(nbytes / med["best_raw"] / 1e9, 3),
            "best_raw_shape": {"segment_mib": best[0] / 2**20, "depth": best[1] or "one batch"},
            "raw_shapes": [{"segment_mib": sh[0] / 2**20, "depth": sh[1] or "one batch",
                            "gbps": round(nbytes / t / 1e9, 3)} for sh, t in raw_shapes.items()],
            "ratio": round(med["best_raw"] / med["handoff"], 3),
            "one_batch_raw_gbps": round(nbytes / med["raw"] / 1e9, 3),
            "one_batch_ratio": round(med["raw"] / med["handoff"], 3),
            "scattered_gbps": round(nbytes / med["scattered"] / 1e9, 3),
            "scattered_ratio": round(med["handoff"] / med["scattered"], 3),
            # the protocol apart from the repack: the same tokens between two pools of one geometry
            "same_layout_gbps": round(nbytes / med["same_layout"] / 1e9, 3),
            "same_layout_ratio": round(med["best_raw"] / med["same_layout"], 3),
            "same_layout_plan": linfo.get("plan"),
            "same_layout_segments": linfo.get("segments"),
            # both peers' user + system CPU seconds per GiB moved (medians; empty off Linux)
            "cpu_s_per_gib": {k: round(statistics.median(v) * (1 << 30) / nbytes, 3) for k, v in cpu.items() if v},
            "small_tokens": small_tokens,
            "small_handoff_ms": round(med["small"] * 1e3, 3),
            "small_raw_ms": round(med["small_raw"] * 1e3, 3),
            "small_raw_shape": {"segment_mib": small_best[0] / 2**20, "depth": small_best[1] or "one batch"},
            "small_breakdown_ms": small_breakdown,
            "small_timeline_ms": small_timeline,
            "small_overhead_ms": round((med["small"] - med["small_raw"]) * 1e3, 3),
            "small_orders": small_orders,
            # what any ZMQ control plane pays here before any work: a bare request and reply
            # between the two peers' processes after the data-first order's idle (``_Echo``)
            "control_floor_ms": spread([x * 1e3 for x in control_floor]),
            # the same from each handoff and the raw write just before it (drift cancels)
            "small_overhead_paired_ms": round(statistics.median(
                h - r for h, r in zip(big["small"], big["small_raw"])) * 1e3, 3),
            "plan": info.get("plan"),
            "segments": info.get("segments"),
            "scattered_segments": sinfo.get("segments"),
            "chunks": info.get("chunks"),
            "repack_s": round(info.get("repack_s", 0.0), 4),
            "link": link_fig,
            "model_error_max": max(p["error"] for p in per_len),
            "model_check": per_len,
            "reps": reps,
            "small_reps": len(big["small"]),
            # medians with p10-p90 over the interleaved repetitions (ratios: per-repetition pairs;
            # small_overhead_ms: each small handoff minus the raw write just before it)
            "spread": spreads,
            "cpu_s_per_gib_spread": cpu_gib,
            "warmup": ("untimed before anything is measured: 1 raw write and 1 handoff of the small request; "
                       "then the link measurement (raw writes of up to 4096 tokens, small handoffs) runs before the headline"),
            "machine": machine,
            "copy_floor": floor,
            "warnings": machine["warnings"] + floor["warnings"] + warnings,
            "samples_s": {k: [round(x, 5) for x in v] for k, v in big.items()},
        }
    finally:
        for conn in (pc, dc):
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in (pre, dec):
            p.join(10)
            if p.is_alive():
                p.kill()
