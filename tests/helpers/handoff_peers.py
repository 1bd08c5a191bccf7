"""Prefill and decode peers that run in their own OS processes for the handoff tests.

Each peer owns a pool in one engine's exact format (SGLang: per-layer K/V tensors
``[slots, heads, head_dim]`` with padding page 0; TensorRT-LLM: one ``[blocks, layers,
kv_factor, heads*tokens_per_block*head_dim]`` pool), filled with bytes derived from a
seed, a real Mooncake transport on 127.0.0.1 and a kvbridge sender or receiver. The
parent drives them over a Pipe. A decode peer rebuilds each prefill peer's pool from its
seed to know what every moved byte must be, and checks that nothing else changed.
"""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

from kvbridge.bench.freelist import BlockFreeList
from tests.helpers.kvhelpers import install_test_hooks

def build_pool(spec: dict):
    """(layout, tensors) of a pool of ``spec``'s geometry filled from ``spec['seed']``."""
    from kvbridge.layout.pools import allocate_pool

    lay = allocate_pool(spec["engine"], layers=spec["layers"], total_heads=spec["total_heads"], head_dim=spec["head_dim"],
                        dtype=spec["dtype"], tokens_per_block=spec["tpb"], num_blocks=spec["blocks"], tp_size=spec["tp"],
                        tp_rank=spec["rank"], mla=spec.get("mla", False), seed=spec["seed"], isa=spec.get("isa", "vec"))
    if spec.get("kv_scales") is not None:  # the engine's fp8 scales, as its plugin reports them
        lay = lay.with_scales(spec["kv_scales"])
    return lay, list(lay.tensors)


def engine_read(spec: dict, tensors: list, blocks, positions) -> np.ndarray:
    """``[layers, kv, T, heads, element bytes]`` uint8 of ``positions`` in ``blocks``, read by
    the engine's own indexing rule (tests/helpers/engine_kv.py), not through ``KVLayout``."""
    import torch

    from tests.helpers.engine_kv import sglang_kv, trtllm_kv, vllm_kv

    eng, tpb = spec["engine"], spec["tpb"]
    if eng == "sglang":  # K of every layer, then V: each [slots, heads, head_dim]
        n = spec["layers"]
        kv = sglang_kv(tensors[:n], tensors[n:] or None, blocks, tpb, positions)
    elif eng == "trtllm":  # one [blocks, layers, kv, heads * tpb * head_dim] pool
        kv = trtllm_kv(tensors[0], blocks, tpb, spec["head_dim"], positions)
    elif eng == "vllm" and spec.get("mla"):  # per layer [blocks, 1, block_size, latent]: one row per token
        rows = [(int(blocks[t // tpb]), t % tpb) for t in positions]
        kv = torch.stack([torch.stack([c[b, 0, s] for b, s in rows]) for c in tensors])[:, None, :, None, :]
    elif eng == "vllm":
        kv = vllm_kv(tensors, blocks, tpb, positions, isa=spec.get("isa", "vec"))
    else:
        raise ValueError(f"no indexing rule for engine {eng!r}")
    return kv.contiguous().view(torch.uint8).numpy().copy()


def _config(cfg: dict, receiver: bool = False):
    """The peer's HandoffConfig, built the way the engine plugins build it: the shared
    settings through their reader (``kvbridge.common.settings``; none from this process's
    environment), then ``handoff()``, whose plan costs follow the link."""
    from kvbridge.common.settings import handoff_config
    from kvbridge.layout import PlanKind

    cfg = dict(cfg)
    if "kinds" in cfg:
        cfg["kinds"] = tuple(PlanKind(k) for k in cfg["kinds"])
    return handoff_config(cfg, receiver=receiver)


def until(cond, deadline: float, what: str) -> None:
    """Wait for ``cond()`` until the monotonic ``deadline``; TimeoutError naming ``what``."""
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not the case by the deadline: {what}")
        time.sleep(0.002)


def serve(conn, handle, *parts) -> None:
    """Answer the parent's commands with ``handle`` until it says stop, then close
    ``parts`` (a kvbridge side, its transport...) in order, whatever happened."""
    try:
        _serve(conn, handle)
    finally:
        for part in parts:
            part.close()


def _serve(conn, handle):
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            conn.send(("stopped",))
            return
        try:
            conn.send(handle(*cmd))
        except Exception as e:  # report, do not die: the parent asserts
            conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))


def prefill_main(conn, spec: dict, cfg: dict) -> None:
    """Prefill peer: serves rooms from its pool."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.common.handoff import KVSender, RoomState
    from kvbridge.common.transport import MooncakeTransport

    cfg = dict(cfg)
    install_test_hooks(cfg.pop("hooks", None))
    lay, tensors = build_pool(spec)
    alloc = BlockFreeList(lay.first_block, lay.num_blocks, spec["seed"] + 7)
    transport = MooncakeTransport("127.0.0.1")
    sender = KVSender(lay, transport, config=_config(cfg))
    released: set[int] = set()

    def release_for(room):
        def release(b, ok):
            alloc.free(b)
            released.add(room)
        return release

    conn.send(("ready", sender.endpoint, alloc.free_count))

    def handle(op, *args):
        if op == "serve":
            room, num_tokens, chunk_tokens = args[:3]
            delay = args[3] if len(args) > 3 else 0.0
            nblk = -(-num_tokens // lay.tokens_per_block)
            blocks = alloc.alloc(nblk)
            sender.add_room(room, blocks, release=release_for(room))
            tpb = lay.tokens_per_block
            bounds = list(range(0, num_tokens, chunk_tokens)) + [num_tokens]
            for a, b in zip(bounds[:-1], bounds[1:]):
                if delay:
                    time.sleep(delay)
                first = (a // tpb) * tpb
                last = b == num_tokens
                sender.send_chunk(room, blocks[first // tpb : -(-b // tpb)], a, b, last=last, first_token=first,
                                  aux={"output_ids": [room % 50000], "cached_tokens": 0} if last else None)
            return ("serving", blocks.tolist())
        if op == "serve_layers":  # a layer-wise prefill: each chunk's layers handed over one step at a time
            room, num_tokens, chunk_tokens, opts = args
            step, finish = opts.get("layer_step", 1), opts.get("finish", False)
            nblk = -(-num_tokens // lay.tokens_per_block)
            blocks = alloc.alloc(nblk)
            sender.add_room(room, blocks, release=release_for(room))
            tpb, nl = lay.tokens_per_block, lay.num_layers
            bounds = list(range(0, num_tokens, chunk_tokens)) + [num_tokens]
            pieces, landed = 0, []
            aux = {"output_ids": [room % 50000], "cached_tokens": 0}
            for a, b in zip(bounds[:-1], bounds[1:]):
                first = (a // tpb) * tpb
                last = b == num_tokens and not finish
                for lo in range(0, nl, step):
                    hi = min(nl, lo + step)
                    before = sender.record(room).bytes
                    sender.send_chunk(room, blocks[first // tpb : -(-b // tpb)], a, b, last=last, first_token=first,
                                      aux=aux if last else None, layers=(lo, hi))
                    pieces += 1
                    if opts.get("await_each"):  # the decode asked already: this layer lands before the next is given
                        until(lambda: sender.record(room).bytes > before, time.monotonic() + 20,
                              f"room {room} tokens [{a}, {b}) layers [{lo}, {hi}) on the wire")
                        landed.append(sender.record(room).bytes)
                    if pieces == opts.get("die_after"):  # the prefill process dies mid-forward
                        os._exit(0)
            if finish:
                sender.finish(room, aux)
            return ("serving", blocks.tolist(), pieces, landed)
        if op == "register":  # a room whose KV is not ready yet
            room, num_tokens = args
            blocks = alloc.alloc(-(-num_tokens // lay.tokens_per_block))
            sender.add_room(room, blocks, release=release_for(room))
            return ("registered", blocks.tolist())
        if op == "engine_read":  # blocks, positions -> bytes by the engine's own indexing
            return ("read", engine_read(spec, tensors, *args))
        if op == "pid":
            return ("pid", os.getpid())
        if op == "pool":  # where the engine's tensors lie: [(address, bytes)]
            return ("pool", [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])
        if op == "asked":  # decode ranks whose request for the room the sender accepted
            return ("asked", len(sender.requests(args[0])))
        if op == "declined":  # a decline the sender holds for a room it has not been given yet
            return ("declined", args[0] in sender._declined)
        if op == "wait":
            room, timeout = args
            end = time.monotonic() + timeout
            while sender.poll(room) not in (RoomState.SUCCESS, RoomState.FAILED) and time.monotonic() < end:
                time.sleep(0.002)
            rec = sender.record(room)
            # a failing room releases its blocks once its writes are over (within the quiesce time)
            until(lambda: room in released, end + sender.config.quiesce_s + 1.0, f"room {room}'s blocks released")
            return ("done", sender.poll(room).name, sender.failure_reason(room), rec.as_dict() if rec else None,
                    alloc.free_count, alloc.double_frees)
        if op == "abort":
            sender.abort(args[0])
            return ("aborted",)
        if op == "free":
            return ("free", alloc.free_count, alloc.double_frees)
        if op == "prestage":  # prestage slots free now, and first parts used / given up so far
            from prometheus_client import REGISTRY

            def count(outcome):
                return REGISTRY.get_sample_value("kvbridge_prestaged_parts_total", {"outcome": outcome}) or 0.0

            return ("prestage", len(sender.pipeline.prestage_free), count("used"), count("unused"))
        raise ValueError(op)

    serve(conn, handle, sender, transport)


def decode_main(conn, spec: dict, cfg: dict) -> None:
    """Decode peer: pulls rooms into its pool and verifies every byte."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.common.handoff import KVReceiver
    from kvbridge.common.transport import MooncakeTransport
    from kvbridge.layout import HeadMap
    from tests.helpers.kvhelpers import read_units, snapshot, unit_addresses, written_mask

    cfg = dict(cfg)
    install_test_hooks(cfg.pop("hooks", None))
    lay, tensors = build_pool(spec)
    alloc = BlockFreeList(lay.first_block, lay.num_blocks, spec["seed"] + 11)
    transport = MooncakeTransport("127.0.0.1")
    recv = KVReceiver(lay, transport, config=_config(cfg, receiver=True))
    conn.send(("ready", transport.session_id, alloc.free_count))

    def handle(op, *args):
        if op == "pull":
            room, endpoints, start, stop, receivers, sources = args[:6]
            opts = args[6] if len(args) > 6 else {}
            nblk = -(-stop // lay.tokens_per_block)
            blocks = alloc.alloc_every_other(nblk) if opts.get("scattered") else alloc.alloc(nblk)
            if opts.get("descending"):
                blocks = np.sort(blocks)[::-1].copy()
            before = snapshot(lay)
            t0 = time.perf_counter()
            recv.request(room, endpoints, blocks, start, stop, release=lambda b, ok: None if ok else alloc.free(b),
                         receivers=receivers, deadline_s=opts.get("deadline_s"))
            state = recv.wait(room, opts.get("timeout", 60))
            elapsed = time.perf_counter() - t0
            rec = recv.record(room)
            result = {"state": state.name, "reason": recv.failure_reason(room), "record": rec.as_dict(), "aux": recv.aux(room),
                      "elapsed": elapsed, "free": alloc.free_count, "blocks": blocks.tolist()}
            if state.name == "SUCCESS" and opts.get("verify", True):
                after = snapshot(lay)
                masks = None
                ok = True
                for src_spec, src_blocks in sources:
                    slay, _ = build_pool(src_spec)
                    hm = HeadMap.between(slay, lay)
                    so = unit_addresses(slay, src_blocks, 0, start, stop, range(hm.src_start, hm.src_start + hm.count))
                    do = unit_addresses(lay, blocks, 0, start, stop, range(hm.dst_start, hm.dst_start + hm.count))
                    ok &= bool(np.array_equal(read_units(slay, so), read_units(lay, do, after)))
                    m = written_mask(lay, do)
                    masks = m if masks is None else [x | y for x, y in zip(masks, m)]
                result["bytes_ok"] = ok
                result["untouched_ok"] = all(np.array_equal(a[~m], b[~m]) for a, b, m in zip(after, before, masks))
                result["written_bytes"] = int(sum(m.sum() for m in masks))
            if opts.get("release_after", True) and state.name == "SUCCESS":
                alloc.free(blocks)  # the "request finished": its blocks go back
                result["free"] = alloc.free_count
            return ("pulled", result)
        if op == "engine_read":
            return ("read", engine_read(spec, tensors, *args))
        if op == "pid":
            return ("pid", os.getpid())
        if op == "pool":  # where the engine's tensors lie: [(address, bytes)]
            return ("pool", [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])
        if op == "start_pull":  # fire and return at once (fault tests)
            room, endpoints, start, stop = args[:4]
            blocks = alloc.alloc(-(-stop // lay.tokens_per_block))
            recv.request(room, endpoints, blocks, start, stop, release=lambda b, ok: alloc.free(b))
            return ("started", blocks.tolist())
        if op == "wait":
            room, timeout = args
            t0 = time.perf_counter()
            state = recv.wait(room, timeout)
            return ("done", state.name, recv.failure_reason(room), time.perf_counter() - t0, alloc.free_count,
                    alloc.double_frees)
        if op == "abort":
            recv.abort(args[0])
            return ("aborted",)
        if op == "decline":  # the decode side computes the prompt itself: no block allocated
            room, endpoints, reason = args
            from prometheus_client import REGISTRY

            rec = recv.decline(room, endpoints, reason)
            return ("declined", rec.as_dict(), alloc.free_count,
                    REGISTRY.get_sample_value("kvbridge_fallbacks_total", {"role": "receiver", "reason": "below_break_even"}))
        if op == "free":
            return ("free", alloc.free_count, alloc.double_frees)
        raise ValueError(op)

    serve(conn, handle, recv, transport)
