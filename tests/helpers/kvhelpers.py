"""Test helpers: an independent reference reader of KV bytes, and a segment executor.

The reference reader takes every (layer, kv, token, head) address from the engine's own
indexing rule over its own tensors (``engine_kv.kv_addresses``), never from the layout
under test or any plan code, so tests can check plans and repack kernels against it.
"""

from __future__ import annotations

import ctypes
import functools

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


def unit_addresses(layout: KVLayout, blocks, first_token: int, start: int, stop: int, heads_local) -> np.ndarray:
    """Absolute byte addresses [L, kv, T, H, head_bytes] of the given tokens and local
    heads, by the engine's own indexing (``engine_kv.kv_addresses``), not the layout's."""
    from tests.helpers.engine_kv import kv_addresses

    return kv_addresses(layout, blocks, first_token, start, stop, heads_local)


def _tensor_of(layout: KVLayout, addrs: np.ndarray) -> tuple[int, int]:
    """(index, data_ptr) of the tensor of ``layout.tensors`` that holds every address."""
    lo, hi = int(addrs.min()), int(addrs.max())
    for i, t in enumerate(layout.tensors):
        p = t.data_ptr()
        if p <= lo and hi < p + t.numel() * t.element_size():
            return i, p
    raise AssertionError(f"addresses [{lo:#x}, {hi:#x}] are not inside one tensor of the {layout.engine} pool")


def read_units(layout: KVLayout, offsets: np.ndarray, data: list[np.ndarray] | None = None) -> np.ndarray:
    """Bytes at ``unit_addresses`` output (absolute addresses), from the live tensors or a snapshot."""
    data = data if data is not None else snapshot(layout)
    out = np.empty(offsets.shape, dtype=np.uint8)
    for l in range(offsets.shape[0]):
        for k in range(offsets.shape[1]):
            i, p = _tensor_of(layout, offsets[l, k])
            out[l, k] = data[i][offsets[l, k] - p]
    return out


def written_mask(layout: KVLayout, offsets: np.ndarray) -> list[np.ndarray]:
    """Per tensor, a boolean mask of the bytes ``offsets`` (absolute addresses) name."""
    masks = [np.zeros(t.numel() * t.element_size(), dtype=bool) for t in layout.tensors]
    for l in range(offsets.shape[0]):
        for k in range(offsets.shape[1]):
            i, p = _tensor_of(layout, offsets[l, k])
            masks[i][(offsets[l, k] - p).reshape(-1)] = True
    return masks


def execute_segments(seg: Segments, dst_within=None) -> None:
    """Copy each segment with memmove (test-only stand-in for a transport in one process).
    ``dst_within``: the ``(addr, nbytes)`` regions the writes may touch (a ``KVLayout``'s
    ``regions``, a staging buffer); a segment outside them fails the test before any byte
    moves, as the transport's write guard would, instead of corrupting this process."""
    if dst_within is not None and len(seg.dst):
        lo = np.asarray([r[0] for r in dst_within], dtype=np.int64)
        hi = lo + np.asarray([r[1] for r in dst_within], dtype=np.int64)
        order = np.argsort(lo)
        lo, hi = lo[order], hi[order]
        d = np.asarray(seg.dst, dtype=np.int64)
        i = np.searchsorted(lo, d, side="right") - 1
        ok = (i >= 0) & (d + np.asarray(seg.length, dtype=np.int64) <= hi[np.maximum(i, 0)])
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            raise AssertionError(f"segment {k} writes [{int(d[k]):#x}, +{int(seg.length[k])}) outside the destination's "
                                 "memory")
    for s, d, n in zip(seg.src.tolist(), seg.dst.tolist(), seg.length.tolist()):
        ctypes.memmove(d, s, n)


def run_plan(plan, dst_within=None) -> None:
    """Execute a ``TransferPlan`` in this process (staging where its kind needs it); with
    ``dst_within`` (the destination's regions), a write outside them and the staging
    buffer fails the test before any byte moves (``execute_segments``)."""
    from kvbridge.layout import PlanKind

    stage = torch.empty(plan.nbytes + 64, dtype=torch.uint8)
    inside = None if dst_within is None else [*dst_within, (stage.data_ptr(), stage.numel())]
    if plan.kind is PlanKind.DIRECT:
        execute_segments(plan.wire, inside)
    elif plan.kind is PlanKind.STAGED_SEND:
        plan.gather().run(stage)
        execute_segments(plan.wire.shifted(src_by=stage.data_ptr()), inside)
    elif plan.kind is PlanKind.STAGED_BOTH:
        sent = torch.empty(plan.nbytes + 64, dtype=torch.uint8)
        plan.gather().run(sent)
        execute_segments(plan.wire.shifted(src_by=sent.data_ptr(), dst_by=stage.data_ptr()), inside)
        plan.scatter().run(stage)
    else:
        execute_segments(plan.wire.shifted(dst_by=stage.data_ptr()), inside)
        plan.scatter().run(stage)


class PipePeer:
    """A peer process driven over a Pipe: ``target(conn, spec, cfg)`` answers each command
    with a tuple, ``("error", text)`` on failure; its first message says it is ready."""

    def __init__(self, target, spec: dict, cfg: dict, *, ready_timeout: float = 60.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.spec = spec
        self.proc = ctx.Process(target=_run_then_exit, args=(target, child, spec, cfg), daemon=True)
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


def _run_then_exit(target, conn, spec: dict, cfg: dict) -> None:
    """``target`` in the peer process; when it returns (what it opened closed), the process
    ends at once instead of through the interpreter's teardown (a second or more of torch's,
    which every stopping peer's driver waits for). An exception ends it as before."""
    import os
    import sys

    target(conn, spec, cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
# would); ``dir`` makes every Mooncake transport created afterwards consult the parent's
# switch file ``<dir>/armed`` on each write, and records the process's kvbridge warnings
# (room failures with their reasons, refused second releases) with their monotonic times,
# which are system-wide, so the parent can time them against its own.
#
# While ``armed`` exists it holds a JSON mode (``FaultSwitch.on`` writes it):
# ``piece_bytes`` / ``inflight`` (0: the transport's own defaults) replace the
# transport's ``max_piece_bytes`` / ``max_inflight_per_peer`` for the writes started
# while armed, ``delay_s`` makes each piece wait that long before it goes to the engine
# (the bytes still go through the real engine), and the ``started_at``-th piece creates
# ``<dir>/started`` (the transfer is under way; it holds the piece's batch number, pieces
# and bytes, ``FaultSwitch.held``). If ``<dir>/hold`` exists then, that piece waits (at
# most ``hold_s``) until the parent removes it: the piece is past kvbridge's per-piece
# write guard, so a parent that stops the process meanwhile knows a piece is in flight.
# ``poison_held``: once let go, the held batch's source bytes are overwritten with
# ``POISON_BYTE`` first (a late write then changes its destination whatever was there,
# even bytes equal to what the sender meant to send).
# Every write started while armed is noted in ``<dir>/writes-<pid>.jsonl`` (its segments,
# pieces and bytes, ``FaultSwitch.writes``). Not armed: the transport runs untouched (its
# defaults, no delay).
_HOOKS: dict = {}
POISON_BYTE = 0xA5  # what a held batch carries with ``poison_held``


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


def armed_mode(folder: str) -> dict | None:
    """The mode in ``<folder>/armed`` (None while not armed)."""
    import json
    import os as _os

    try:
        with open(_os.path.join(folder, "armed")) as f:
            return json.loads(f.read() or "{}")
    except (FileNotFoundError, ValueError):
        return None


class _FaultEngine:
    """A Mooncake engine that applies the armed mode's per-piece delay, marks the
    ``started_at``-th piece submitted since the parent armed it, and holds that piece
    while ``<dir>/hold`` exists (``flip``: its first piece leaves with one byte flipped)."""

    def __init__(self, engine, folder: str):
        self._engine, self._dir, self._n, self._epoch = engine, folder, 0, None

    def batch_transfer_async_write(self, *args):
        import os as _os
        import time as _time

        mode = armed_mode(self._dir)
        if mode is not None and mode.get("wire"):  # what reaches Mooncake: every piece's source, destination, length
            import json as _json

            row = {"t": _time.monotonic(), "epoch": mode.get("epoch"), "src": [int(x) for x in args[1]],
                   "dst": [int(x) for x in args[2]], "len": [int(x) for x in args[3]]}
            with open(_os.path.join(self._dir, f"wire-{_os.getpid()}.jsonl"), "a") as f:
                f.write(_json.dumps(row) + "\n")
        if mode is not None:
            epoch = mode.get("epoch")
            self._n = self._n + 1 if epoch == self._epoch else 1  # counted afresh each time it is armed
            self._epoch = epoch
            if self._n == int(mode.get("started_at", 2)):
                import json as _json

                # this batch: its number since the switch was armed, its pieces and bytes (held past the guard)
                with open(_os.path.join(self._dir, "started.tmp"), "w") as f:
                    f.write(_json.dumps({"pid": _os.getpid(), "batch": self._n, "pieces": len(args[3]),
                                         "bytes": int(sum(args[3]))}))
                _os.replace(_os.path.join(self._dir, "started.tmp"), _os.path.join(self._dir, "started"))
                end = _time.monotonic() + float(mode.get("hold_s", 30.0))
                while _os.path.exists(_os.path.join(self._dir, "hold")) and _time.monotonic() < end:
                    _time.sleep(0.002)
                if mode.get("poison_held"):  # the held batch carries the poison byte: wherever it lands, it shows
                    for src, n in zip(args[1], args[3]):
                        ctypes.memset(int(src), POISON_BYTE, int(n))
                if mode.get("flip"):  # this batch's first piece leaves with one byte flipped; its source stays as it is
                    args = self._flipped(args)
            if mode.get("delay_s"):
                _time.sleep(float(mode["delay_s"]))
        return self._engine.batch_transfer_async_write(*args)

    def _flipped(self, args):
        """``args`` with the first piece read from a registered copy of its bytes, one flipped."""
        src, n = int(args[1][0]), int(args[3][0])
        copy = ctypes.create_string_buffer(n)
        ctypes.memmove(copy, src, n)
        copy[n // 2] = copy[n // 2][0] ^ 0xFF
        if self._engine.register_memory(ctypes.addressof(copy), n) != 0:
            raise RuntimeError("flip: cannot register the flipped copy")
        self._keep = getattr(self, "_keep", []) + [copy]  # registered for the process's life
        return (args[0], [ctypes.addressof(copy), *list(args[1])[1:]], *args[2:])

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
    """Apply fault-injection hooks ``opts`` (``netns``, ``dir``) to this process; a later
    call moves the event log and the switch to its ``dir`` for transports made after."""
    import logging
    import os as _os

    if not opts:
        return
    if opts.get("netns") and not _HOOKS.get("netns"):
        enter_netns(opts["netns"])
        _HOOKS["netns"] = opts["netns"]
    if not opts.get("dir"):
        return
    _HOOKS["dir"] = opts["dir"]
    ev = _HOOKS.get("events")
    if ev is None:
        ev = _HOOKS["events"] = _EventLog("")
        logging.getLogger("kvbridge").addHandler(ev.handler)
    ev.path = _os.path.join(opts["dir"], f"events-{_os.getpid()}.jsonl")
    if _HOOKS.get("patched"):
        return
    from kvbridge.common.transport import MooncakeTransport

    init = MooncakeTransport.__init__

    def hooked_init(self, *a, **kw):
        init(self, *a, **kw)
        folder = _HOOKS["dir"]
        self._engine = _FaultEngine(self._engine, folder)
        defaults = (self.max_piece_bytes, self.max_inflight_per_peer)
        write_async = self.write_async

        def armed_write_async(*wa, **wk):
            armed = armed_mode(folder)
            mode = armed or {}
            self.max_piece_bytes = int(mode.get("piece_bytes") or defaults[0])
            self.max_inflight_per_peer = int(mode.get("inflight") or defaults[1])
            if armed is not None:  # each write started while armed: its segments, pieces and bytes
                _log_write(folder, armed.get("epoch"), wa[3] if len(wa) > 3 else wk["lengths"], self.max_piece_bytes,
                           self.max_inflight_per_peer)
            return write_async(*wa, **wk)

        self.write_async = armed_write_async

    MooncakeTransport.__init__ = hooked_init
    _HOOKS["patched"] = True


def _log_write(folder: str, epoch, lengths, piece_bytes: int, inflight: int) -> None:
    """Append one armed write to ``<folder>/writes-<pid>.jsonl``: the epoch it was armed in,
    its segments, the pieces the transport cuts them into (``piece_bytes``) and its bytes."""
    import json
    import os as _os
    import time as _time

    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    lens = lens[lens > 0]
    row = {"t": _time.monotonic(), "epoch": epoch, "segments": int(lens.size), "bytes": int(lens.sum()),
           "pieces": int((-(-lens // piece_bytes)).sum()), "piece_bytes": piece_bytes, "inflight": inflight}
    with open(_os.path.join(folder, f"writes-{_os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


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


def wait_until(cond, timeout_s: float, what: str, poll_s: float = 0.002) -> float:
    """Poll ``cond()`` until it holds; returns when it held (monotonic). TimeoutError
    naming ``what`` after ``timeout_s``."""
    import time as _time

    end = _time.monotonic() + timeout_s
    while not cond():
        if _time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout_s:.1f} s")
        _time.sleep(poll_s)
    return _time.monotonic()


class FaultSwitch:
    """The parent's side of ``install_test_hooks``: a folder the peers watch (pass
    ``hooks`` to them), armed in a mode for one transfer, and their recorded warnings."""

    def __init__(self, folder: str | None = None):
        """``folder``: the one the peers were started with (default: a new one)."""
        import os as _os
        import tempfile

        self.dir = folder or tempfile.mkdtemp(prefix="kvb-faults-")
        _os.makedirs(self.dir, exist_ok=True)
        self.hooks = {"dir": self.dir}
        self.started_path = self._path("started")  # created by the piece that marks a transfer under way
        self._epoch = 0

    def _path(self, name: str) -> str:
        import os as _os

        return _os.path.join(self.dir, name)

    def _rm(self, *names: str) -> None:
        import os as _os

        for n in names:
            try:
                _os.unlink(self._path(n))
            except FileNotFoundError:
                pass

    def on(self, mode: dict, hold: bool = False) -> None:
        """Arm the peers' next writes in ``mode`` (``piece_bytes``, ``inflight``,
        ``delay_s``, ``started_at``); ``hold``: the ``started_at``-th piece waits, past
        kvbridge's write guard, until ``release``."""
        import json
        import os as _os

        self._rm("started", "hold")
        if hold:
            open(self._path("hold"), "w").close()
        self._epoch += 1
        tmp = self._path("armed.tmp")
        with open(tmp, "w") as f:
            json.dump(dict(mode, epoch=self._epoch), f)
        _os.replace(tmp, self._path("armed"))

    def off(self) -> None:
        self._rm("armed", "started", "hold")

    def release(self) -> None:
        """Let a held piece go."""
        self._rm("hold")

    def started(self) -> bool:
        import os as _os

        return _os.path.exists(self.started_path)

    def held(self) -> dict:
        """The batch that marked the transfer under way (held, with ``hold``): ``pid`` of the
        process, ``batch`` (its number since the switch was armed), its ``pieces`` and ``bytes``."""
        import json

        try:
            with open(self.started_path) as f:
                return json.loads(f.read() or "{}")
        except (FileNotFoundError, ValueError):
            return {}

    def writes(self, pid: int | None = None) -> list[dict]:
        """The writes started while armed this time (``on``), oldest first, each with its
        ``pid``, ``segments``, ``pieces`` (as the transport cut them) and ``bytes``."""
        import glob
        import json
        import os as _os

        out = []
        for p in glob.glob(self._path("writes-*.jsonl")):
            wpid = int(p.rsplit("-", 1)[1].split(".")[0])
            if pid is not None and wpid != pid:
                continue
            with open(p) as f:
                out += [dict(json.loads(line), pid=wpid) for line in f if line.strip()]
        return sorted((w for w in out if w.get("epoch") == self._epoch), key=lambda w: w["t"])

    def wire(self, pid: int) -> list[tuple[int, int, int]]:
        """Every piece process ``pid`` handed Mooncake while armed this time with ``wire``
        (``on({"wire": True})``), in order: (source address, destination address, bytes)."""
        import json
        import os as _os

        path = self._path(f"wire-{pid}.jsonl")
        if not _os.path.exists(path):
            return []
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [p for r in sorted(rows, key=lambda r: r["t"]) if r["epoch"] == self._epoch
                for p in zip(r["src"], r["dst"], r["len"])]

    def events(self, since: float, pid: int | None = None) -> list[dict]:
        return [e for e in read_events(self.dir) if e["t"] >= since and (pid is None or e["pid"] == pid)]

    def logged(self, since: float, pid: int, text: str) -> float | None:
        """When (monotonic) ``pid`` first logged a warning containing ``text`` since ``since``."""
        return next((e["t"] for e in self.events(since, pid) if text in e["msg"]), None)

    def double_releases(self, since: float) -> list[str]:
        return [e["msg"] for e in self.events(since) if "already released" in e["msg"]]

    def close(self) -> None:
        import shutil

        self.off()
        shutil.rmtree(self.dir, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def _tiny_description():
    from kvbridge.common.protocol import LayoutDescription
    from kvbridge.layout import allocate_pool

    lay = allocate_pool("sglang", layers=2, total_heads=2, head_dim=8, dtype="bfloat16", tokens_per_block=16, num_blocks=4)
    return LayoutDescription.of(lay)


def tiny_description(**over):
    """A real small SGLang layout's wire description (``LayoutDescription``, the same one
    each call), fields replaced by ``over``: for tests of messages and records (they check
    types and bounds, not geometry)."""
    import msgspec

    return msgspec.structs.replace(_tiny_description(), **over)


def tiny_record(i: int = 0, *, engine: str = "sglang", endpoint: str | None = None, **layout):
    """Prefill TP rank ``i``'s bootstrap record (its JSON form) on ``tiny_description(**layout)``."""
    import msgspec

    from kvbridge.common.protocol import RankRecord

    return msgspec.to_builtins(RankRecord(endpoint=endpoint or f"tcp://127.0.0.1:{40000 + i}",
                                          session=f"127.0.0.1:{41000 + i}", engine=engine, page_size=16,
                                          layout=tiny_description(**layout)))
