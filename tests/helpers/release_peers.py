"""Prefill and decode peer processes for the release-rule rows (tests/faults/test_release_rule.py).

Each runs a real kvbridge sender or receiver over Mooncake TCP on 127.0.0.1 with the
transport as shipped (pieces, in-flight bound), behind the fault hooks of
``kvhelpers.install_test_hooks`` (the parent's ``FaultSwitch`` holds one piece past the
write guard to force a window). The decode fills every block the moment it goes back to
its "engine" (the release callback) with a poison pattern, through the engine's own
indexing (SGLang: slots ``page * page_size + offset`` of every per-layer K and V tensor;
TensorRT-LLM: ``pool[block]``), and later says whether any poisoned byte changed.
"""

from __future__ import annotations

import os
import time

import numpy as np

from tests.helpers.handoff_peers import _config, build_pool, serve, until
from tests.helpers.kvhelpers import install_test_hooks

POISON = 0xA5


def _block_views(spec: dict, tensors: list, block: int) -> list:
    """Every byte of ``block``, by the engine's own indexing (uint8 views)."""
    tpb = spec["tpb"]
    if spec["engine"] == "sglang":  # per-layer [slots, heads, head_dim]; slot = page * page_size + offset
        return [t[block * tpb:(block + 1) * tpb].view(-1).view(__import__("torch").uint8) for t in tensors]
    if spec["engine"] == "trtllm":  # [blocks, layers, kv, heads * tpb * head_dim]
        return [tensors[0][block].reshape(-1).view(__import__("torch").uint8)]
    raise ValueError(f"no indexing rule for engine {spec['engine']!r}")


def prefill_main(conn, spec: dict, cfg: dict) -> None:
    """Prefill peer: ``serve`` a room whole, ``abort`` it, ``poll`` it as its engine sees it."""
    install_test_hooks(cfg.pop("hooks", None))
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from kvbridge.common.handoff import KVSender
    from kvbridge.common.transport import MooncakeTransport

    lay, _ = build_pool(spec)
    transport = MooncakeTransport("127.0.0.1")
    sender = KVSender(lay, transport, config=_config(cfg))
    released: dict[int, float] = {}
    conn.send(("ready", sender.endpoint, os.getpid()))

    def handle(op, *args):
        if op == "serve":
            room, ntok = args
            tpb = lay.tokens_per_block
            blocks = np.random.default_rng(room).permutation(np.arange(lay.first_block, lay.num_blocks))[: -(-ntok // tpb)]
            sender.add_room(room, blocks, release=lambda b, ok, room=room: released.setdefault(room, time.monotonic()))
            sender.send_chunk(room, blocks, 0, ntok, last=True, aux={"output_ids": [7]})
            return ("serving", blocks.tolist())
        if op == "poll":  # as the prefill engine sees it, and whether the source blocks went back
            room = args[0]
            return ("poll", sender.poll(room).name, released.get(room))
        if op == "abort":
            sender.abort(args[0], "aborted by prefill (test)")
            return ("aborted", time.monotonic())
        if op == "skew_plans":  # a planner bug: every direct plan's writes one destination block further
            import dataclasses

            from kvbridge.common import send_pipeline

            real = send_pipeline.plan_transfer

            def skewed(src, src_blocks, dst, dst_blocks, *a, **kw):
                plan = real(src, src_blocks, dst, dst_blocks, *a, **kw)
                return dataclasses.replace(plan, wire=plan.wire.shifted(dst_by=dst.block_stride))

            send_pipeline.plan_transfer = skewed
            return ("skewed",)
        if op == "swap_blocks":  # a planner bug: the first two destination blocks swapped (bytes stay in the room)
            from kvbridge.common import send_pipeline

            real = send_pipeline.plan_transfer

            def swapped(src, src_blocks, dst, dst_blocks, *a, **kw):
                dst_blocks = np.array(dst_blocks, dtype=np.int64)
                dst_blocks[[0, 1]] = dst_blocks[[1, 0]]
                return real(src, src_blocks, dst, dst_blocks, *a, **kw)

            send_pipeline.plan_transfer = swapped
            return ("swapped",)
        if op == "unswap":
            from kvbridge.common import send_pipeline
            from kvbridge.layout import plan_transfer

            send_pipeline.plan_transfer = plan_transfer
            return ("unswapped",)
        if op == "inflight":  # pieces (and bytes) in the transfer engine now, and the next piece (held past its guard)
            pieces = nbytes = held = 0
            for h in list(transport._handles):
                inflight = list(h._inflight)
                pieces += len(inflight)
                nbytes += sum(h._len[i] for _, i in inflight)
                nxt = max((i for _, i in inflight), default=h._next - 1) + 1
                if not h.done and nxt < h.pieces:
                    held = max(held, h._len[nxt])
            return ("inflight", pieces, nbytes, held)
        raise ValueError(op)

    serve(conn, handle, sender, transport)


def decode_main(conn, spec: dict, cfg: dict) -> None:
    """Decode peer: ``pull`` into fresh blocks whose release poisons them; ``state``;
    ``poisoned`` says whether every released block still holds only the poison."""
    install_test_hooks(cfg.pop("hooks", None))
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    import zmq
    from prometheus_client import REGISTRY

    from kvbridge.common import protocol as P
    from kvbridge.common.handoff import KVReceiver
    from kvbridge.common.transport import MooncakeTransport

    lay, tensors = build_pool(spec)
    transport = MooncakeTransport("127.0.0.1")
    recv = KVReceiver(lay, transport, config=_config(cfg, receiver=True))
    next_block = [lay.first_block]
    pulled: dict[int, list[int]] = {}  # room -> its blocks
    before: dict[int, list] = {}  # room -> every block's bytes when it was asked for (watch_outside)
    released: dict[int, tuple[float, list[int]]] = {}  # room -> (when, blocks)
    raw = []  # DEALERs of replays
    conn.send(("ready", transport.session_id, os.getpid()))

    def fresh(n: int) -> np.ndarray:
        a = next_block[0]
        if a + n > lay.num_blocks:
            a = lay.first_block
        next_block[0] = a + n
        return np.arange(a, a + n, dtype=np.int64)

    def poison(room):
        def release(blocks, ok):
            for b in blocks:  # the engine has the block back: it is reused at once
                for v in _block_views(spec, tensors, int(b)):
                    v.fill_(POISON)
            released[room] = (time.monotonic(), [int(b) for b in blocks])
        return release

    def handle(op, *args):
        if op == "pull":
            room, endpoint, ntok = args[:3]
            opts = args[3] if len(args) > 3 else {}
            blocks = fresh(-(-ntok // lay.tokens_per_block))
            pulled[room] = blocks.tolist()
            if opts.get("watch_outside"):
                before[room] = [[v.clone() for v in _block_views(spec, tensors, b)]
                                for b in range(lay.first_block, lay.num_blocks)]
            if opts.get("replay_first"):  # a captured copy of this request, sent first from another endpoint
                req = P.TransferRequest(room=room, model=recv.config.model, layout=P.LayoutDescription.of(lay),
                                        block_ids=blocks.tolist(), first_token=0, token_start=0, token_stop=ntok,
                                        session=transport.session_id, sent_at=time.time())
                s = zmq.Context.instance().socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(endpoint)
                s.send(P.pack(req, recv.config.keyring(), P.link(endpoint, to_prefill=True)))
                raw.append(s)
                until(lambda: os.path.exists(opts["replay_first"]), time.monotonic() + 20, "the replay's write started")
            recv.request(room, endpoint, blocks, 0, ntok, release=poison(room), deadline_s=opts.get("deadline_s"))
            return ("pulling", blocks.tolist())
        if op == "state":
            room = args[0]
            gauge = sum(s.value for m in REGISTRY.collect() if m.name == "kvbridge_quarantined_blocks"
                        for s in m.samples if s.labels.get("role") == "receiver")
            return ("state", {"state": recv.poll(room).name, "reason": recv.failure_reason(room),
                              "quarantined": recv.quarantined(room), "quarantine": recv.quarantine(),
                              "released_at": released.get(room, (None,))[0], "gauge": gauge,
                              "digest": getattr(recv.record(room), "digest_algorithm", "")})
        if op == "abort":
            recv.abort(args[0], "aborted by decode (test)")
            return ("aborted", time.monotonic())
        if op == "stale_before_check":  # a late write of an earlier room lands in the room's 2nd block before it is admitted
            check = recv._verify

            def late(r, peer, msg):
                recv._verify = check
                for v in _block_views(spec, tensors, pulled[r.room][1]):
                    v.fill_(POISON)
                return check(r, peer, msg)

            recv._verify = late
            return ("armed",)
        if op == "integrity":  # this rank's checks, as counted
            return ("integrity", {s.labels["result"]: s.value for m in REGISTRY.collect()
                                  if m.name == "kvbridge_integrity_checks" for s in m.samples
                                  if s.name.endswith("_total")})
        if op == "outside":  # blocks outside the room's that changed since it was asked for
            room = args[0]
            mine = set(pulled[room])
            changed = [b for b, was in zip(range(lay.first_block, lay.num_blocks), before[room]) if b not in mine
                       and any(bool((v != w).any()) for v, w in zip(_block_views(spec, tensors, b), was))]
            return ("outside", changed[:8])
        if op == "poisoned":  # every byte of every released block of the room is still the poison
            when, blocks = released[args[0]]
            bad = [b for b in blocks for v in _block_views(spec, tensors, b) if bool((v != POISON).any())]
            return ("poisoned", not bad, sorted(set(bad))[:8])
        raise ValueError(op)

    try:
        serve(conn, handle, recv, transport)
    finally:
        for s in raw:
            s.close(0)
