"""``kvbridge bench load``: many concurrent handoffs between two processes, each checksummed.

A prefill process (``KVSender``, SGLang-format NHD pool, page 64) and a decode process
(``KVReceiver``, TensorRT-LLM-format HND pool, block 32) over Mooncake TCP on 127.0.0.1;
geometry ``GEOM`` (2 layers x 2 KV heads x head_dim 64, bf16: 1 KiB per token) so that
``inflight`` requests of ``max_tokens`` fit in pools of modest size, sized exactly for that.

Workload: ``count`` requests with prompt lengths drawn (seeded) log-uniformly from
``min_tokens..max_tokens`` (many short prompts, a long tail), at most ``inflight``
outstanding on the decode side at any time. For each request the prefill "computes" its
KV: it writes a room-specific slice of a seeded noise buffer, in canonical order
``[layer, kv, token, head, head_dim]``, into the blocks it allocated (one ``index_copy_``
per layer and K/V), adds the room and sends it in one chunk. The decode side allocates
blocks, asks for the room and, when it lands, gathers its blocks back into canonical order
(one ``index_select`` + ``permute`` over the pool) and compares their BLAKE2b digest with
the digest of the same noise slice, regenerated locally from the seed: a handoff is
``corrupted`` when they differ, ``failed`` when the room ended Failed (reasons counted),
``lost`` when it never ended. Both sides count their free blocks at the end (leaks) and
report their peak RSS.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import resource
import threading
import time
from collections import Counter
from typing import Callable

import numpy as np
import torch

from kvbridge.bench.freelist import BlockFreeList

__all__ = ["bench_load", "GEOM", "read_room", "schedule", "token_bytes", "write_room"]

GEOM = dict(layers=2, total_heads=2, head_dim=64, dtype="bf16")
SRC_PAGE, DST_BLOCK = 64, 32
_NOISE_SEED_OFFSET = 1000


def token_bytes() -> int:
    """Bytes of one token's KV over all layers, K and V and heads."""
    return GEOM["layers"] * 2 * GEOM["total_heads"] * GEOM["head_dim"] * 2


def schedule(count: int, min_tokens: int, max_tokens: int, seed: int) -> np.ndarray:
    """Prompt lengths (int64 ``[count]``), log-uniform in ``[min_tokens, max_tokens]``."""
    rng = np.random.default_rng(seed)
    lo, hi = np.log(min_tokens), np.log(max_tokens + 1)
    return np.clip(np.exp(rng.uniform(lo, hi, count)).astype(np.int64), min_tokens, max_tokens)


def _noise(max_tokens: int, seed: int) -> torch.Tensor:
    """Random bytes (uint8 ``[2 * max_tokens * token_bytes()]``), the same in every process."""
    g = torch.Generator().manual_seed(seed + _NOISE_SEED_OFFSET)
    return torch.randint(0, 256, (2 * max_tokens * token_bytes(),), dtype=torch.uint8, generator=g)


def _room_bytes(noise: torch.Tensor, room: int, n: int) -> torch.Tensor:
    """The canonical KV bytes of ``room`` (``n`` tokens): a room-dependent noise slice."""
    size = n * token_bytes()
    off = (room * 7919 * 64) % (noise.numel() - size + 1)
    return noise[off : off + size]


def _digest(data: torch.Tensor) -> bytes:
    return hashlib.blake2b(data.contiguous().numpy(), digest_size=16).digest()


def _rss_mb() -> float:
    """Peak resident set size of this process so far, MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _rss_now_mb() -> float:
    """Current resident set size of this process, MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_room(lay, blocks: np.ndarray, data: torch.Tensor) -> None:
    """Prefill side: put a room's KV ``data`` (uint8, canonical ``[layer, kv, token, head,
    head_bytes]``) into ``blocks`` of an SGLang-format pool ``lay`` (per layer and K/V a
    ``[slots, heads, head_dim]`` tensor; slot = block * page + token): one ``index_copy_``
    per layer and K/V."""
    nkv = lay.num_layers * lay.kv_factor
    data = data.view(nkv, -1, lay.num_heads * lay.head_bytes)  # [layer*kv, tokens, heads*head_bytes]
    n, tpb = data.shape[1], lay.tokens_per_block
    t = torch.arange(n)
    slots = torch.from_numpy(np.asarray(blocks, dtype=np.int64))[t // tpb] * tpb + t % tpb
    for layer in range(lay.num_layers):
        for kv in range(lay.kv_factor):
            dst = lay.tensors[lay.region_of[layer, kv]]
            dst.view(torch.uint8).reshape(dst.shape[0], -1).index_copy_(0, slots, data[layer * lay.kv_factor + kv])


def read_room(lay, blocks: np.ndarray, n: int) -> torch.Tensor:
    """Decode side: the first ``n`` tokens held in ``blocks`` of a TensorRT-LLM-format pool
    ``lay`` (one ``[blocks, layers, kv, heads * tpb * head_dim]`` tensor, HND inside a block),
    gathered into canonical order: uint8 ``[layer, kv, token, head, head_bytes]``."""
    pool = lay.tensors[0].view(torch.uint8).reshape(lay.num_blocks, lay.num_layers, lay.kv_factor, lay.num_heads,
                                                    lay.tokens_per_block, lay.head_bytes)
    got = pool.index_select(0, torch.from_numpy(np.asarray(blocks, dtype=np.int64))).permute(1, 2, 0, 4, 3, 5)
    return got.reshape(lay.num_layers, lay.kv_factor, -1, lay.num_heads, lay.head_bytes)[:, :, :n]


def _pool(engine: str, inflight: int, max_tokens: int, seed: int | None):
    from kvbridge.layout import allocate_pool

    tpb = SRC_PAGE if engine == "sglang" else DST_BLOCK
    blocks = inflight * -(-max_tokens // tpb) + (1 if engine == "sglang" else 0)  # SGLang's page 0 is padding
    return allocate_pool(engine, tokens_per_block=tpb, num_blocks=blocks, seed=seed, **GEOM)


def sample_room(folder: str, side: str, room: int, n: int, lay, blocks: np.ndarray) -> None:
    """Save a room's blocks as the pool holds them, indexed by block id only (no layout):
    prefill (SGLang format): ``pages`` uint8 ``[layers * kv, blocks, page, heads, head_bytes]``
    (K of every layer, then V); decode (TensorRT-LLM format): ``blocks`` uint8
    ``[blocks, layers, kv, heads * tpb * head_bytes]``."""
    idx = torch.from_numpy(np.asarray(blocks, dtype=np.int64))
    if side == "prefill":
        tpb = lay.tokens_per_block
        data = torch.stack([t.view(torch.uint8).reshape(-1, tpb, *t.shape[1:-1], t.shape[-1] * t.element_size())
                            .index_select(0, idx) for t in lay.tensors])
    else:
        data = lay.tensors[0].view(torch.uint8).index_select(0, idx)
    torch.save({"n": int(n), "data": data.clone()}, os.path.join(folder, f"{side}-{room}.pt"))


def _prefill_peer(conn, sizes: list[int], inflight: int, max_tokens: int, seed: int, cfg: dict,
                  sample_dir: str | None = None) -> None:
    """Register rooms (at most 2 x inflight open), write their KV, serve them; report at the end."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.common.handoff import KVSender
    from kvbridge.common.settings import handoff_config
    from kvbridge.common.transport import MooncakeTransport

    lay = _pool("sglang", inflight, max_tokens, 1)
    free = BlockFreeList(lay.first_block, lay.num_blocks)
    transport = MooncakeTransport("127.0.0.1")
    sender = KVSender(lay, transport, config=handoff_config(cfg), workers=2)
    noise = _noise(max_tokens, seed)
    rss0 = _rss_now_mb()
    conn.send(("ready", sender.endpoint))
    open_rooms = threading.Semaphore(2 * inflight)
    done: queue.SimpleQueue = queue.SimpleQueue()
    failures: Counter = Counter()
    stop = threading.Event()

    def work() -> None:
        tpb = lay.tokens_per_block
        for room, n in enumerate(sizes, start=1):
            while not open_rooms.acquire(timeout=0.5):
                if stop.is_set():
                    return
            blocks = None
            while blocks is None and not stop.is_set():
                blocks = free.alloc(-(-n // tpb), 0.5)
            if blocks is None:
                return
            write_room(lay, blocks, _room_bytes(noise, room, n))  # the prefill "computes" the room's KV
            if sample_dir:
                sample_room(sample_dir, "prefill", room, n, lay, blocks)

            def release(b, ok, room=room):
                free.free(b)
                done.put((room, ok))
                open_rooms.release()

            sender.add_room(room, blocks, release=release)
            sender.send_chunk(room, blocks, 0, n, last=True, aux={"output_ids": [room % 50000]})

    th = threading.Thread(target=work, daemon=True)
    th.start()
    finished = 0
    rss_mid = None
    to_forget: list[int] = []
    while True:
        try:
            room, ok = done.get(timeout=0.2)
        except queue.Empty:
            room = None
        if room is not None:
            finished += 1
            if finished == len(sizes) // 2:
                rss_mid = _rss_now_mb()
            if not ok:
                failures[sender.failure_reason(room)[:200]] += 1
            to_forget.append(room)
        for r in to_forget[:]:  # a room is dropped once its worker let go of it
            sender.forget(r)
            if sender.record(r) is None:
                to_forget.remove(r)
        if conn.poll():
            cmd = conn.recv()
            if cmd[0] == "stop":
                stop.set()
                th.join(5)
                time.sleep(0.2)  # late releases of rooms that failed just now
                while not done.empty():
                    room, ok = done.get()
                    finished += 1
                    if not ok:
                        failures[sender.failure_reason(room)[:200]] += 1
                conn.send(("report", {"rooms_finished": finished, "free_blocks": free.free_count, "total_blocks": free.total,
                                      "double_frees": free.double_frees, "failures": dict(failures),
                                      "peak_rss_mb": _rss_mb(), "rss_ready_mb": rss0, "rss_mid_mb": rss_mid,
                                      "rss_end_mb": _rss_now_mb()}))
                break
    sender.close()
    transport.close()


def _decode_peer(conn, sizes: list[int], inflight: int, max_tokens: int, seed: int, endpoint: str, cfg: dict,
                 lost_after_s: float, sample_dir: str | None = None) -> None:
    """Keep ``inflight`` requests outstanding; verify each landed room by checksum."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.common.handoff import KVReceiver
    from kvbridge.common.settings import handoff_config
    from kvbridge.common.transport import MooncakeTransport

    lay = _pool("trtllm", inflight, max_tokens, None)
    lay.tensors[0].zero_()  # touch every page now, so RSS growth during the run is kvbridge's, not the pool's
    free = BlockFreeList(lay.first_block, lay.num_blocks)
    transport = MooncakeTransport("127.0.0.1")
    recv = KVReceiver(lay, transport, config=handoff_config(cfg, receiver=True))
    noise = _noise(max_tokens, seed)
    rss0 = _rss_now_mb()
    conn.send(("ready",))
    landed: queue.SimpleQueue = queue.SimpleQueue()
    started: dict[int, tuple[float, np.ndarray, int]] = {}
    lat, failures = [], Counter()
    corrupted = succeeded = failed = 0
    nbytes = 0
    outstanding = max_out = 0
    area = 0.0  # integral of outstanding over time, for the mean
    t_last = t0 = time.perf_counter()
    last_progress = 0.0
    it = iter(enumerate(sizes, start=1))
    pending = next(it, None)
    rss_mid = None

    def verify(room: int, n: int, blocks: np.ndarray) -> bool:
        return _digest(read_room(lay, blocks, n)) == _digest(_room_bytes(noise, room, n))

    while pending is not None or started:
        now = time.perf_counter()
        while pending is not None and outstanding < inflight:
            room, n = pending
            blocks = free.alloc(-(-n // lay.tokens_per_block), 0.0)
            if blocks is None:
                break
            area += outstanding * (now - t_last)
            t_last = now
            started[room] = (time.perf_counter(), blocks, n)
            outstanding += 1
            max_out = max(max_out, outstanding)
            recv.request(room, endpoint, blocks, 0, n, release=lambda b, ok, room=room: landed.put((room, ok)))
            pending = next(it, None)
        try:
            room, ok = landed.get(timeout=0.5)
        except queue.Empty:
            oldest = min((s for s, _, _ in started.values()), default=now)
            if time.perf_counter() - oldest > lost_after_s:
                break  # what is still outstanding is lost
            continue
        t_start, blocks, n = started.pop(room)
        now = time.perf_counter()
        area += outstanding * (now - t_last)
        t_last = now
        outstanding -= 1
        if ok:
            lat.append(now - t_start)
            if sample_dir:
                sample_room(sample_dir, "decode", room, n, lay, blocks)
            if verify(room, n, blocks):
                succeeded += 1
                nbytes += n * token_bytes()
            else:
                corrupted += 1
        else:
            failed += 1
            failures[recv.failure_reason(room)[:200]] += 1
        free.free(blocks)
        recv.forget(room)
        if rss_mid is None and succeeded + corrupted + failed >= len(sizes) // 2:
            rss_mid = _rss_now_mb()
        if now - last_progress > 0.2:
            last_progress = now
            conn.send(("progress", succeeded + corrupted + failed, outstanding))
    wall = time.perf_counter() - t0
    lost = len(started)
    conn.send(("report", {"succeeded": succeeded, "corrupted": corrupted, "failed": failed, "lost": lost,
                          "failures": dict(failures), "latencies_s": lat, "bytes": nbytes, "wall_s": wall,
                          "max_inflight": max_out, "mean_inflight": area / wall if wall > 0 else 0.0,
                          "free_blocks": free.free_count + sum(b.size for _, b, _ in started.values()),
                          "total_blocks": free.total, "double_frees": free.double_frees, "peak_rss_mb": _rss_mb(),
                          "rss_ready_mb": rss0, "rss_mid_mb": rss_mid, "rss_end_mb": _rss_now_mb()}))
    recv.close()
    transport.close()


def bench_load(*, count: int = 500, inflight: int = 32, min_tokens: int = 16, max_tokens: int = 8192, seed: int = 0,
               deadline_s: float = 120.0, progress: Callable[[int, int, int], None] | None = None,
               sample_dir: str | None = None) -> dict:
    """Run the load benchmark in two spawned processes; returns a JSON-ready dict.

    ``progress(done, total, outstanding)`` is called as handoffs finish. ``sample_dir``:
    each side also saves every room's raw pool bytes there (``sample_room``), for a check
    outside the bench."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    if count < 1 or inflight < 1:
        raise ValueError(f"count and inflight must be positive, got {count}, {inflight}")
    sizes = schedule(count, min_tokens, max_tokens, seed).tolist()
    cfg = dict(chunk_bytes=4 << 20, deadline_s=deadline_s, write_timeout_s=deadline_s)
    ctx = mp.get_context("spawn")
    pc, pchild = ctx.Pipe()
    dc, dchild = ctx.Pipe()
    pre = ctx.Process(target=_prefill_peer, args=(pchild, sizes, inflight, max_tokens, seed, cfg, sample_dir), daemon=True,
                      name="kvbridge-load-prefill")
    pre.start()
    dec = None
    try:
        endpoint = _expect(pc, pre, "ready", 120)[1]
        dec = ctx.Process(target=_decode_peer, args=(dchild, sizes, inflight, max_tokens, seed, endpoint, cfg,
                                                     deadline_s + 30, sample_dir), daemon=True, name="kvbridge-load-decode")
        dec.start()
        _expect(dc, dec, "ready", 120)
        while True:
            msg = _expect(dc, dec, None, deadline_s + 120)
            if msg[0] == "progress":
                if progress:
                    progress(msg[1], count, msg[2])
                continue
            d = msg[1]
            break
        pc.send(("stop",))
        p = _expect(pc, pre, "report", 60)[1]
    finally:
        for proc, conn in ((dec, dc), (pre, pc)):
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
    lat_ms = np.array(d["latencies_s"]) * 1e3
    pct = (lambda q: float(np.percentile(lat_ms, q)) if lat_ms.size else None)
    sizes_a = np.array(sizes)
    reasons = Counter(d["failures"])
    return {
        "handoffs": count,
        "succeeded": d["succeeded"],
        "lost": d["lost"],
        "corrupted": d["corrupted"],
        "failed": d["failed"],
        "failure_reasons": dict(reasons),
        "prefill_failure_reasons": p["failures"],
        "inflight_limit": inflight,
        "max_inflight": d["max_inflight"],
        "mean_inflight": round(d["mean_inflight"], 2),
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": float(lat_ms.max()) if lat_ms.size else None,
        "throughput_handoffs_s": d["succeeded"] / d["wall_s"] if d["wall_s"] else 0.0,
        "throughput_gbps": d["bytes"] / d["wall_s"] / 1e9 if d["wall_s"] else 0.0,
        "bytes": d["bytes"],
        "wall_s": d["wall_s"],
        "peak_rss_mb": max(d["peak_rss_mb"], p["peak_rss_mb"]),
        "peak_rss_mb_prefill": p["peak_rss_mb"],
        "peak_rss_mb_decode": d["peak_rss_mb"],
        # peak minus the RSS once set up (pools allocated and registered, before the first handoff)
        "rss_growth_mb": {"prefill": round(p["peak_rss_mb"] - p["rss_ready_mb"], 1),
                          "decode": round(d["peak_rss_mb"] - d["rss_ready_mb"], 1)},
        # current RSS after half of the handoffs and at the end: flat when memory is bounded
        "rss_mid_end_mb": {"prefill": [_r1(p["rss_mid_mb"]), _r1(p["rss_end_mb"])],
                           "decode": [_r1(d["rss_mid_mb"]), _r1(d["rss_end_mb"])]},
        "options": {"count": count, "inflight": inflight, "min_tokens": min_tokens, "max_tokens": max_tokens,
                    "seed": seed},
        "blocks_leaked": {"prefill": p["total_blocks"] - p["free_blocks"], "decode": d["total_blocks"] - d["free_blocks"]},
        "double_frees": {"prefill": p["double_frees"], "decode": d["double_frees"]},
        "tokens": {"min": int(sizes_a.min()), "p50": int(np.median(sizes_a)), "mean": float(sizes_a.mean()),
                   "max": int(sizes_a.max()), "distribution": "log-uniform", "seed": seed},
        "geometry": {**GEOM, "token_bytes": token_bytes(), "prefill": f"sglang page {SRC_PAGE}",
                     "decode": f"trtllm block {DST_BLOCK}",
                     "pool_mb_each": round(inflight * -(-max_tokens // DST_BLOCK) * DST_BLOCK * token_bytes() / 2**20, 1)},
        "transport": "Mooncake TCP, 127.0.0.1, two processes",
    }


def _r1(v):
    return None if v is None else round(v, 1)


def _expect(conn, proc, kind: str | None, timeout: float):
    """The next message from a peer process (of ``kind`` if given); raises if it died or hung."""
    end = time.monotonic() + timeout
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"{proc.name} exited with code {proc.exitcode}")
        if time.monotonic() > end:
            raise TimeoutError(f"{proc.name} sent nothing for {timeout:.0f} s")
    msg = conn.recv()
    if kind is not None and msg[0] != kind:
        raise RuntimeError(f"{proc.name}: expected {kind!r}, got {msg!r:.300}")
    return msg
