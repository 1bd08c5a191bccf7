"""Test helpers: an independent reference reader of KV bytes, and a segment executor.

The reference reader computes every (layer, kv, token, head) address from first
principles (block id, slot, strides) with numpy, without any plan code, so tests can
check plans and repack kernels against it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvbridge.layout import KVLayout, Segments


def fill_random(layout: KVLayout, seed: int) -> None:
    """Fill every tensor of a local layout with random bytes."""
    g = torch.Generator().manual_seed(seed)
    for t in layout.tensors:
        b = t.reshape(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def snapshot(layout: KVLayout) -> list[np.ndarray]:
    """Copies of every tensor's bytes."""
    return [t.reshape(-1).view(torch.uint8).cpu().numpy().copy() for t in layout.tensors]


def unit_offsets(layout: KVLayout, blocks, first_token: int, start: int, stop: int, heads_local) -> np.ndarray:
    """Byte offsets [L, kv, T, H, head_bytes] of the given tokens and local heads,
    relative to the start of each (layer, kv)'s region tensor."""
    if layout.engine in ("vllm-cpu", "vllm-mla"):
        return vllm_unit_offsets(layout, blocks, first_token, start, stop, heads_local)
    blocks = np.asarray(blocks, dtype=np.int64)
    t = np.arange(start, stop) - first_token
    blk = blocks[t // layout.tokens_per_block]
    slot = t % layout.tokens_per_block
    h = np.asarray(heads_local, dtype=np.int64)
    starts = np.array([r.addr for r in layout.regions], dtype=np.int64)[layout.region_of]
    rel = (layout.base - starts)[:, :, None, None, None]
    return (
        rel
        + (blk * layout.block_stride + slot * layout.token_stride)[None, None, :, None, None]
        + (h * layout.head_stride)[None, None, None, :, None]
        + np.arange(layout.head_bytes)[None, None, None, None, :]
    )


def vllm_unit_offsets(layout: KVLayout, blocks, first_token: int, start: int, stop: int, heads_local) -> np.ndarray:
    """``unit_offsets`` for vLLM's CPU cache, from vLLM's own description and not the
    layout's strides: each layer tensor is ``[num_blocks, heads, block_size, 2 * head_size]``
    (its shape read here); inside a (block, head), K element (token t, dim j) is element
    ``j * block_size + t`` and V element (t, j) is ``block_size * head_size + t * head_size
    + j`` (cpu_attn_vec.hpp, reshape_and_cache). The last axis is each element's bytes.
    MLA (CPU_MLA): each layer ``[num_blocks, 1, block_size, latent]``, one row per token."""
    if layout.engine == "vllm-mla":
        nb, _, bs, d = layout.tensors[0].shape
        isz = layout.tensors[0].element_size()
        t = np.arange(start, stop) - first_token
        rows = np.asarray(blocks, dtype=np.int64)[t // bs] * bs + t % bs
        byte = (rows[:, None] * d * isz + np.arange(d * isz)[None, :])[None, :, None, :]  # [kv=1, T, H=1, bytes]
        return np.broadcast_to(byte[None], (len(layout.tensors),) + byte.shape).copy()
    nb, nh, bs, hd2 = layout.tensors[0].shape
    hd, isz = hd2 // 2, layout.tensors[0].element_size()
    blocks = np.asarray(blocks, dtype=np.int64)
    t = np.arange(start, stop) - first_token
    blk, slot = blocks[t // bs], t % bs
    h = np.asarray(heads_local, dtype=np.int64)
    j = np.arange(hd)
    tile = (blk[:, None] * nh + h[None, :]) * (bs * hd2)  # [T, H] first element of the (block, head)
    k = tile[:, :, None] + j[None, None, :] * bs + slot[:, None, None]  # [T, H, hd]
    v = tile[:, :, None] + bs * hd + slot[:, None, None] * hd + j[None, None, :]
    elems = np.stack([k, v])  # [kv, T, H, hd]
    byte = (elems[..., None] * isz + np.arange(isz)).reshape(2, t.size, h.size, hd * isz)
    return np.broadcast_to(byte[None], (len(layout.tensors),) + byte.shape).copy()


def read_units(layout: KVLayout, offsets: np.ndarray, data: list[np.ndarray] | None = None) -> np.ndarray:
    """Bytes at ``unit_offsets`` output, from the live tensors or a snapshot."""
    data = data if data is not None else snapshot(layout)
    out = np.empty(offsets.shape, dtype=np.uint8)
    for l in range(layout.num_layers):
        for k in range(layout.kv_factor):
            out[l, k] = data[layout.region_of[l, k]][offsets[l, k]]
    return out


def written_mask(layout: KVLayout, offsets: np.ndarray) -> list[np.ndarray]:
    """Per tensor, a boolean mask of the bytes ``offsets`` name."""
    masks = [np.zeros(t.numel() * t.element_size(), dtype=bool) for t in layout.tensors]
    for l in range(layout.num_layers):
        for k in range(layout.kv_factor):
            masks[layout.region_of[l, k]][offsets[l, k].reshape(-1)] = True
    return masks


def execute_segments(seg: Segments) -> None:
    """Copy each segment with memmove (test-only stand-in for a transport in one process)."""
    for s, d, n in zip(seg.src.tolist(), seg.dst.tolist(), seg.length.tolist()):
        ctypes.memmove(d, s, n)


class PipePeer:
    """A peer process driven over a Pipe: ``target(conn, spec, cfg)`` answers each command
    with a tuple, ``("error", text)`` on failure; its first message says it is ready."""

    def __init__(self, target, spec: dict, cfg: dict, *, ready_timeout: float = 60.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.spec = spec
        self.proc = ctx.Process(target=target, args=(child, spec, cfg), daemon=True)
        self.proc.start()
        self.ready = self.call(timeout=ready_timeout)

    def call(self, *cmd, timeout: float = 60.0):
        """Send ``cmd`` (if any) and return the answer; a hung peer raises TimeoutError."""
        if cmd:
            self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[:1]} within {timeout} s (hung?)")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise AssertionError(msg[1])
        return msg

    call_raw = call

    def stop(self) -> None:
        stop_process(self.conn, self.proc)


def stop_process(conn, proc, grace_s: float = 5.0) -> None:
    """Ask a peer process driven over ``conn`` to stop, then kill it if it does not."""
    if proc.is_alive():
        try:
            conn.send(("stop",))
            conn.poll(grace_s)
        except (BrokenPipeError, OSError):
            pass
    proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(grace_s)


# -- fault-injection hooks for peer processes ---------------------------------------------
# A peer process calls ``install_test_hooks(opts)`` first thing (its driver passes ``opts``
# through): ``netns`` moves the process into a network namespace (as ``ip netns exec``
# would), ``dir`` makes every Mooncake transport created afterwards write through a
# throttle the parent switches on and off with a file, and records the process's kvbridge
# warnings (room failures with their reasons, refused second releases) with their
# monotonic times, which are system-wide, so the parent can time them against its own.
_HOOKS: dict = {}


def enter_netns(name: str) -> None:
    """Move this process (its only thread, before it starts others) into ``ip netns`` namespace ``name``."""
    import os as _os

    libc = ctypes.CDLL(None, use_errno=True)
    fd = _os.open(f"/var/run/netns/{name}", _os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r} failed")
    finally:
        _os.close(fd)


class _ThrottledEngine:
    """A Mooncake engine whose piece submissions sleep ``delay_s`` each while the file
    ``<dir>/slow`` exists (the bytes still go through the real engine); after the second
    throttled piece it creates ``<dir>/started``: the transfer is under way and far from done."""

    def __init__(self, engine, folder: str, delay_s: float):
        self._engine, self._dir, self._delay, self._n, self._epoch = engine, folder, delay_s, 0, None

    def batch_transfer_async_write(self, *args):
        import os as _os
        import time as _time

        try:
            epoch = _os.stat(_os.path.join(self._dir, "slow")).st_mtime_ns
        except FileNotFoundError:
            epoch = None
        if epoch is not None:
            self._n = self._n + 1 if epoch == self._epoch else 1  # counted afresh each time it is switched on
            self._epoch = epoch
            if self._n == 2:
                open(_os.path.join(self._dir, "started"), "w").close()
            _time.sleep(self._delay)
        return self._engine.batch_transfer_async_write(*args)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _EventLog:
    """A logging handler appending kvbridge warnings as JSON lines ``{"t", "msg"}``."""

    def __init__(self, path: str):
        import logging

        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self._emit
        self.path = path

    def _emit(self, record) -> None:
        import json
        import time as _time

        with open(self.path, "a") as f:
            f.write(json.dumps({"t": _time.monotonic(), "msg": record.getMessage()}) + "\n")


def install_test_hooks(opts: dict | None) -> None:
    """Apply fault-injection hooks ``opts`` (``netns``, ``dir``, ``delay_s``, ``piece_bytes``)
    to this process; later calls change the folder and throttle of transports made after."""
    import logging
    import os as _os

    if not opts:
        return
    if opts.get("netns") and not _HOOKS.get("netns"):
        enter_netns(opts["netns"])
        _HOOKS["netns"] = opts["netns"]
    if not opts.get("dir"):
        return
    _HOOKS.update(dir=opts["dir"], delay_s=float(opts.get("delay_s", 0.05)), piece_bytes=int(opts.get("piece_bytes", 16 << 10)))
    ev = _HOOKS.get("events")
    if ev is None:
        ev = _HOOKS["events"] = _EventLog("")
        logging.getLogger("kvbridge").addHandler(ev.handler)
    ev.path = _os.path.join(opts["dir"], f"events-{_os.getpid()}.jsonl")
    if _HOOKS.get("patched"):
        return
    from kvbridge.common.transport import MooncakeTransport

    init = MooncakeTransport.__init__

    def throttled_init(self, *a, **kw):
        init(self, *a, **kw)
        self._engine = _ThrottledEngine(self._engine, _HOOKS["dir"], _HOOKS["delay_s"])
        self.max_piece_bytes = _HOOKS["piece_bytes"]  # many small pieces, one at a time: a transfer takes a while
        self.max_inflight_per_peer = 1

    MooncakeTransport.__init__ = throttled_init
    _HOOKS["patched"] = True


def read_events(folder: str) -> list[dict]:
    """Every peer process's recorded kvbridge warnings in ``folder``, oldest first."""
    import glob
    import json
    import os as _os

    out = []
    for p in glob.glob(_os.path.join(folder, "events-*.jsonl")):
        with open(p) as f:
            out += [dict(json.loads(line), pid=int(p.rsplit("-", 1)[1].split(".")[0])) for line in f if line.strip()]
    return sorted(out, key=lambda e: e["t"])
