"""A prefill peer and a decode peer in their own OS processes, for the hostile-input tests.

Each owns a pool filled from a seed, a real Mooncake transport on 127.0.0.1 and a
kvbridge ``KVSender`` / ``KVReceiver``; the parent drives them over a Pipe. Both keep
what kvbridge logs (WARNING and up) so the parent can assert that a refusal was logged,
and the decode peer can snapshot its whole pool and say which bytes changed outside
given blocks (vectorized: one difference mask per tensor against a mask of the blocks'
byte ranges).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from kvbridge.bench.freelist import BlockFreeList

from tests.helpers.handoff_peers import _config, build_pool, serve


class _Keep(logging.Handler):
    """Keeps (level, message) of every kvbridge record at WARNING and up."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[tuple[str, str]] = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


def _capture() -> _Keep:
    h = _Keep()
    logging.getLogger("kvbridge").addHandler(h)
    logging.getLogger("kvbridge").setLevel(logging.WARNING)
    return h


def _common(op, args, keep, alloc):
    if op == "logs":  # and forget them
        out, keep.records[:] = list(keep.records), []
        return ("logs", out)
    if op == "free":
        return ("free", alloc.free_count, alloc.double_frees)
    if op == "ping":
        return ("pong", os.getpid())
    if op == "rss":  # this process's resident set, bytes
        with open("/proc/self/status") as f:
            return ("rss", next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:")))
    if op == "refused":  # kvbridge_refused_frames by (channel, reason)
        from kvbridge.common.rooms import default_metrics

        fam = default_metrics().auth_refused.collect()[0]
        return ("refused", {f"{s.labels['channel']}/{s.labels['reason']}": s.value for s in fam.samples
                            if s.name.endswith("_total")})
    return None


def prefill_main(conn, spec: dict, cfg: dict) -> None:
    """Prefill peer: a KVSender over a seeded pool."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    keep = _capture()
    from kvbridge.common.handoff import KVSender
    from kvbridge.common.transport import MooncakeTransport

    lay, _ = build_pool(spec)
    alloc = BlockFreeList(lay.first_block, lay.num_blocks, spec["seed"] + 7)
    transport = MooncakeTransport("127.0.0.1")
    sender = KVSender(lay, transport, config=_config(cfg))
    rooms: dict[int, tuple] = {}
    conn.send(("ready", sender.endpoint, alloc.free_count))

    def handle(op, *args):
        got = _common(op, args, keep, alloc)
        if got is not None:
            return got
        if op == "register":  # the room exists; its KV is not computed yet
            room, n = args
            blocks = alloc.alloc(-(-n // lay.tokens_per_block))
            sender.add_room(room, blocks, release=lambda b, ok: alloc.free(b))
            rooms[room] = (blocks, n)
            return (op, blocks.tolist())
        if op == "compute":  # its KV is ready: one chunk
            room = args[0]
            blocks, n = rooms[room]
            sender.send_chunk(room, blocks, 0, n, last=True, aux={"output_ids": [7]})
            return (op,)
        if op == "state":
            room, timeout = args
            end = time.monotonic() + timeout
            while sender.poll(room).name not in ("SUCCESS", "FAILED") and time.monotonic() < end:
                time.sleep(0.005)
            time.sleep(0.05)  # a failing room releases once its writes are over
            return ("state", sender.poll(room).name, sender.failure_reason(room), alloc.free_count)
        raise ValueError(op)

    serve(conn, handle, sender, transport)


def _outside_mask(lay, blocks, t_index: int, nbytes: int) -> np.ndarray:
    """Bytes of tensor ``t_index`` NOT inside ``blocks`` (any layer, K or V)."""
    from kvbridge.layout import block_ranges

    inside = np.zeros(nbytes + 1, dtype=np.int64)
    rng = block_ranges(lay, np.asarray(blocks, dtype=np.int64))
    addr = lay.regions[t_index].addr
    rng = rng[(rng[:, 1] > addr) & (rng[:, 0] < addr + nbytes)] - addr
    np.add.at(inside, np.clip(rng[:, 0], 0, nbytes), 1)
    np.add.at(inside, np.clip(rng[:, 1], 0, nbytes), -1)
    return np.cumsum(inside[:-1]) == 0


def decode_main(conn, spec: dict, cfg: dict) -> None:
    """Decode peer: a KVReceiver over a seeded pool that can say what changed in it."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    keep = _capture()
    from kvbridge.common.handoff import KVReceiver
    from kvbridge.common.transport import MooncakeTransport
    from kvbridge.layout import HeadMap
    from tests.helpers.kvhelpers import read_units, snapshot, unit_addresses

    lay, _ = build_pool(spec)
    alloc = BlockFreeList(lay.first_block, lay.num_blocks, spec["seed"] + 11)
    transport = MooncakeTransport("127.0.0.1")
    recv = KVReceiver(lay, transport, config=_config(cfg, receiver=True))
    snaps: dict[str, list[np.ndarray]] = {}
    conn.send(("ready", transport.session_id, alloc.free_count, lay.describe()))

    def handle(op, *args):
        got = _common(op, args, keep, alloc)
        if got is not None:
            return got
        if op == "snap":  # keep a copy of the whole pool under a name
            snaps[args[0]] = snapshot(lay)
            return ("snapped",)
        if op == "changed":  # bytes that differ from snapshot `name`, outside `blocks`
            name, blocks = args
            now = snapshot(lay)
            n = 0
            for i, (a, b) in enumerate(zip(snaps[name], now)):
                n += int(((a != b) & _outside_mask(lay, blocks, i, a.size)).sum())
            return ("changed", n)
        if op == "start_pull":  # allocate, ask, return at once
            room, endpoints, n = args[:3]
            opts = args[3] if len(args) > 3 else {}
            blocks = alloc.alloc(-(-n // lay.tokens_per_block))
            recv.request(room, endpoints, blocks, 0, n, release=lambda b, ok: alloc.free(b),
                         deadline_s=opts.get("deadline_s"))
            return ("started", blocks.tolist())
        if op == "wait":
            room, timeout = args
            state = recv.wait(room, timeout)
            time.sleep(0.02)
            return ("done", state.name, recv.failure_reason(room), alloc.free_count)
        if op == "verify":  # room's bytes against the prefill's seeded pool; changes outside it since snapshot `name`
            blocks, n, src_spec, src_blocks, name = args
            after = snapshot(lay)
            slay, _ = build_pool(src_spec)
            hm = HeadMap.between(slay, lay)
            so = unit_addresses(slay, src_blocks, 0, 0, n, range(hm.src_start, hm.src_start + hm.count))
            do = unit_addresses(lay, blocks, 0, 0, n, range(hm.dst_start, hm.dst_start + hm.count))
            ok = bool(np.array_equal(read_units(slay, so), read_units(lay, do, after)))
            changed = sum(int(((a != b) & _outside_mask(lay, blocks, i, a.size)).sum())
                          for i, (a, b) in enumerate(zip(snaps[name], after)))
            return ("verified", ok, changed)
        if op == "pull_verify":  # a legitimate handoff, every byte checked against the prefill's seeded pool
            room, endpoint, n, src_spec, src_blocks = args
            blocks = alloc.alloc(-(-n // lay.tokens_per_block))
            before = snapshot(lay)
            recv.request(room, endpoint, blocks, 0, n, release=lambda b, ok: None if ok else alloc.free(b))
            state = recv.wait(room, 60)
            out = {"state": state.name, "reason": recv.failure_reason(room), "aux": recv.aux(room)}
            if state.name == "SUCCESS":
                after = snapshot(lay)
                slay, _ = build_pool(src_spec)
                hm = HeadMap.between(slay, lay)
                so = unit_addresses(slay, src_blocks, 0, 0, n, range(hm.src_start, hm.src_start + hm.count))
                do = unit_addresses(lay, blocks, 0, 0, n, range(hm.dst_start, hm.dst_start + hm.count))
                out["bytes_ok"] = bool(np.array_equal(read_units(slay, so), read_units(lay, do, after)))
                out["outside_changed"] = sum(int(((a != b) & _outside_mask(lay, blocks, i, a.size)).sum())
                                             for i, (a, b) in enumerate(zip(before, after)))
            alloc.free(blocks) if state.name == "SUCCESS" else None
            out["free"] = alloc.free_count
            return ("pulled", out)
        raise ValueError(op)

    serve(conn, handle, recv, transport)
