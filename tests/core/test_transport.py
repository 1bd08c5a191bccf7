"""MooncakeTransport over TCP on 127.0.0.1.

The writer (prefill-like) and the targets (decode-like) run in separate OS processes
started with the "spawn" context; each registers its buffer and answers commands over
a pipe. Small Mooncake timeouts are set in the children's environment so a dead or
stopped peer is noticed quickly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from kvbridge.common.transport import (
    BatchResult,
    MooncakeTransport,
    TransportError,
    TransportTimeout,
    split_pieces,
)
from tests.helpers.peek import registered_ranges

CHILD_ENV = {
    "MC_FORCE_TCP": "1",
    "MC_LOG_LEVEL": "ERROR",
    "MC_TRANSFER_TIMEOUT": "5",
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "2",
}
MiB = 1 << 20


# ---------------------------------------------------------------------------- children


def _pattern(seed: int, n: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy()


def _child(conn, nbytes: int, env: dict, transport_kw: dict) -> None:
    """A peer process: one transport, one registered buffer, commands over ``conn``."""
    os.environ.update(env)
    t = MooncakeTransport(**transport_kw)
    buf = np.zeros(nbytes, dtype=np.uint8)
    base = buf.ctypes.data
    t.register(base, nbytes)

    def fill(seed):
        buf[:] = _pattern(seed, nbytes)

    def verify(fill_seed, src_seed, src_nbytes, src_off, dst_off, lengths):
        expected = _pattern(fill_seed, nbytes)
        src = _pattern(src_seed, src_nbytes)
        for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist()):
            expected[d : d + n] = src[s : s + n]
        bad = np.flatnonzero(buf != expected)
        return int(bad.size), (int(bad[0]) if bad.size else -1)

    last = {}

    def write(session, src_off, dst_addrs, lengths, deadline_s, overlap=False, stop_after=None):
        t0 = time.monotonic()
        asked = []

        def guard():  # lets ``stop_after`` pieces through, then says why not
            asked.append(1)
            return "told to stop by the test" if len(asked) > stop_after else None

        try:
            if stop_after is not None:
                try:  # the first pieces are submitted inside write_async: it may raise there
                    t.write_async(session, base + np.asarray(src_off), dst_addrs, lengths, deadline_s, guard=guard).wait()
                except TransportError as e:
                    return {"ok": False, "msg": str(e), "asked": len(asked)}
                return {"ok": True, "asked": len(asked)}
            if overlap:
                h = t.write_async(session, base + np.asarray(src_off), dst_addrs, lengths, deadline_s)
                in_flight_after_submit = not h.done
                busy = float(np.sqrt(np.arange(1 << 20, dtype=np.float64)).sum())  # overlapped work
                polls = 0
                while not h.poll():
                    polls += 1
                    time.sleep(1e-4)
                r = h.wait()
                extra = {"in_flight_after_submit": in_flight_after_submit, "polls": polls, "busy": busy}
            else:
                last["handle"] = h = t.write_async(session, base + np.asarray(src_off), dst_addrs, lengths, deadline_s)
                r = h.wait()
                extra = {}
            return {"ok": True, "result": r, "elapsed": time.monotonic() - t0, **extra}
        except TransportError as e:
            return {"ok": False, "type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}

    def write_then_abort(session, src_off, dst_addrs, lengths):
        h = t.write_async(session, base + np.asarray(src_off), dst_addrs, lengths, 10.0)
        h.abort("aborted by the test")
        try:
            h.wait()
        except TransportError as e:
            return str(e)
        return "no error"

    handlers = {
        "settle": lambda timeout_s: last["handle"].settle(timeout_s),
        "write_then_abort": write_then_abort,
        "fill": fill,
        "verify": verify,
        "write": write,
        "probe": lambda session: t.probe(session),
    }
    conn.send((t.session_id, base, nbytes))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        cmd, kw = msg
        try:
            conn.send(("ok", handlers[cmd](**kw)))
        except Exception as e:  # report, keep serving
            conn.send(("err", f"{type(e).__name__}: {e}"))
    t.close()


class Peer:
    """Parent-side handle of a child peer process."""

    def __init__(self, nbytes: int, **transport_kw):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_conn, nbytes, CHILD_ENV, transport_kw), daemon=True)
        self.proc.start()
        self._ready = False

    def ready(self, timeout: float = 60.0) -> "Peer":
        if not self._ready:
            assert self.conn.poll(timeout), "peer process did not start"
            self.session, self.addr, self.nbytes = self.conn.recv()
            self._ready = True
        return self

    def call(self, cmd: str, timeout: float = 30.0, **kw):
        self.conn.send((cmd, kw))
        assert self.conn.poll(timeout), f"peer did not answer {cmd!r} within {timeout}s"
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def pair():
    """A writer (1 MiB max piece, to exercise splitting) and a healthy target."""
    writer = Peer(160 * MiB, max_piece_bytes=1 * MiB)
    target = Peer(192 * MiB)
    try:
        yield writer.ready(), target.ready()
    finally:
        writer.stop()
        target.stop()


def _scattered(rng, n_small: int, slot: int, n_big: int, big: int, src_nbytes: int):
    """Non-overlapping destination offsets: ``n_small`` pieces of 1..slot/2 bytes, one
    per ``slot``-byte slot, then ``n_big`` pieces of ``big`` bytes; random order."""
    small_len = rng.integers(1, slot // 2 + 1, n_small)
    small_dst = np.arange(n_small) * slot + rng.integers(0, slot // 2, n_small)
    big_dst = n_small * slot + np.arange(n_big) * (big + 4096)
    dst = np.concatenate([small_dst, big_dst]).astype(np.int64)
    lengths = np.concatenate([small_len, np.full(n_big, big)]).astype(np.int64)
    src = rng.integers(0, src_nbytes - lengths + 1).astype(np.int64)
    order = rng.permutation(dst.size)
    return src[order], dst[order], lengths[order]


# ---------------------------------------------------------------------------- two processes


def test_scattered_write_is_exact(pair):
    writer, target = pair
    rng = np.random.default_rng(7)
    src_off, dst_off, lengths = _scattered(rng, n_small=3500, slot=8192, n_big=3, big=5 * MiB // 2, src_nbytes=writer.nbytes)
    target.call("fill", seed=11)
    writer.call("fill", seed=12)
    out = writer.call("write", session=target.session, src_off=src_off, dst_addrs=target.addr + dst_off, lengths=lengths, deadline_s=15.0)
    assert out["ok"], out
    r: BatchResult = out["result"]
    assert r.bytes == int(lengths.sum()) and r.segments == lengths.size
    assert r.pieces == 3500 + 3 * 3  # 2.5 MiB splits into three 1 MiB-capped pieces
    assert r.pieces > 2048  # more than one Mooncake call may carry with default TCP settings
    assert r.seconds > 0 and r.gbps > 0
    bad, first = target.call("verify", fill_seed=11, src_seed=12, src_nbytes=writer.nbytes, src_off=src_off, dst_off=dst_off, lengths=lengths)
    assert bad == 0, f"{bad} wrong bytes on the target, first at offset {first}"


def test_write_async_overlaps_with_work(pair):
    writer, target = pair
    n, piece = 64, 2 * MiB
    src_off = np.arange(n, dtype=np.int64) * piece
    dst_off = np.arange(n, dtype=np.int64)[::-1].copy() * piece
    lengths = np.full(n, piece, dtype=np.int64)
    target.call("fill", seed=21)
    writer.call("fill", seed=22)
    out = writer.call("write", session=target.session, src_off=src_off, dst_addrs=target.addr + dst_off, lengths=lengths, deadline_s=15.0, overlap=True)
    assert out["ok"], out
    assert out["in_flight_after_submit"], "a 128 MiB write finished before write_async returned"
    assert out["result"].bytes == n * piece and out["result"].pieces == n * 2
    bad, _ = target.call("verify", fill_seed=21, src_seed=22, src_nbytes=writer.nbytes, src_off=src_off, dst_off=dst_off, lengths=lengths)
    assert bad == 0
    # An aborted write raises on wait; what it left in flight does not block the next one.
    msg = writer.call("write_then_abort", session=target.session, src_off=src_off, dst_addrs=target.addr + dst_off, lengths=lengths)
    assert "aborted by the test" in msg and target.session in msg
    out = writer.call("write", session=target.session, src_off=src_off, dst_addrs=target.addr + dst_off, lengths=lengths, deadline_s=15.0)
    assert out["ok"], out


def test_write_guard_stops_before_the_next_piece(pair):
    """A write's guard is asked right before each piece goes to the engine: once it says
    no, nothing more is submitted, the pieces already handed over land, the rest of the
    target is untouched."""
    writer, target = pair
    n, piece = 12, 1 * MiB
    src_off = np.arange(n, dtype=np.int64) * piece
    dst_off = np.arange(n, dtype=np.int64) * (piece + 4096)
    lengths = np.full(n, piece, dtype=np.int64)
    target.call("fill", seed=31)
    writer.call("fill", seed=32)
    out = writer.call("write", session=target.session, src_off=src_off, dst_addrs=target.addr + dst_off,
                      lengths=lengths, deadline_s=15.0, stop_after=3)
    assert not out["ok"] and "stopped before piece 3: told to stop by the test" in out["msg"], out
    assert out["asked"] == 4
    k = 3  # exactly the first three pieces (they land), nothing of the others
    end = time.monotonic() + 10
    while True:
        bad, first = target.call("verify", fill_seed=31, src_seed=32, src_nbytes=writer.nbytes, src_off=src_off[:k],
                                 dst_off=dst_off[:k], lengths=lengths[:k])
        if bad == 0 or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert bad == 0, f"{bad} wrong bytes on the target, first at offset {first}"


def test_unregistered_remote_range_fails_cleanly(pair):
    writer, target = pair
    assert writer.call("probe", session=target.session)
    outside = target.addr + target.nbytes + 4 * MiB
    out = writer.call("write", session=target.session, src_off=[0], dst_addrs=[outside], lengths=[4096], deadline_s=5.0)
    assert not out["ok"] and out["type"] == "TransportError", out
    assert target.session in out["msg"]
    assert out["elapsed"] < 5.0
    # One bad piece among good ones fails the write too, and the writer stays usable.
    out = writer.call("write", session=target.session, src_off=[0, 0], dst_addrs=[target.addr, outside], lengths=[64, 64], deadline_s=5.0)
    assert not out["ok"], out
    target.call("fill", seed=31)
    writer.call("fill", seed=32)
    out = writer.call("write", session=target.session, src_off=[100], dst_addrs=[target.addr + 5000], lengths=[3000], deadline_s=10.0)
    assert out["ok"], out
    bad, _ = target.call("verify", fill_seed=31, src_seed=32, src_nbytes=writer.nbytes, src_off=np.array([100]), dst_off=np.array([5000]), lengths=np.array([3000]))
    assert bad == 0


def test_unknown_peer_fails_at_once(pair):
    writer, _ = pair
    out = writer.call("write", session="127.0.0.1:1", src_off=[0], dst_addrs=[1 << 30], lengths=[64], deadline_s=5.0)
    assert not out["ok"] and out["type"] == "TransportError", out
    assert "127.0.0.1:1" in out["msg"] and out["elapsed"] < 5.0
    assert writer.call("probe", session="127.0.0.1:1") is False


def test_killed_peer_ends_in_error_within_deadline(pair):
    writer, _ = pair
    victim = Peer(32 * MiB).ready()
    try:
        out = writer.call("write", session=victim.session, src_off=[0], dst_addrs=[victim.addr], lengths=[MiB], deadline_s=5.0)
        assert out["ok"], out
        victim.proc.kill()
        victim.proc.join(5)
        out = writer.call("write", session=victim.session, src_off=np.arange(8) * MiB, dst_addrs=victim.addr + np.arange(8) * MiB, lengths=np.full(8, MiB), deadline_s=3.0)
        assert not out["ok"] and out["type"] in ("TransportError", "TransportTimeout"), out
        assert victim.session in out["msg"]
        assert out["elapsed"] < 4.0, out
        assert writer.call("settle", timeout_s=3.0) is True  # what was in flight to a dead peer fails fast
        assert writer.call("probe", session=victim.session) is False
    finally:
        victim.stop()


def test_stopped_peer_times_out(pair):
    writer, _ = pair
    victim = Peer(144 * MiB).ready()
    try:
        out = writer.call("write", session=victim.session, src_off=[0], dst_addrs=[victim.addr], lengths=[MiB], deadline_s=5.0)
        assert out["ok"], out
        os.kill(victim.proc.pid, signal.SIGSTOP)
        n = 128  # 128 MiB: far more than the socket buffers hold
        out = writer.call("write", session=victim.session, src_off=np.arange(n) * MiB, dst_addrs=victim.addr + np.arange(n) * MiB, lengths=np.full(n, MiB), deadline_s=1.0)
        assert not out["ok"] and out["type"] == "TransportTimeout", out
        assert victim.session in out["msg"] and "pieces" in out["msg"] and "bytes" in out["msg"]
        assert out["elapsed"] < 2.5, out
        assert writer.call("settle", timeout_s=0.2) is False  # still stuck in the stopped peer
        os.kill(victim.proc.pid, signal.SIGCONT)
        assert writer.call("settle", timeout_s=10.0) is True  # resumed: the abandoned pieces finish
    finally:
        victim.proc.kill()
        victim.proc.join(5)


def _stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (``kill`` returns once
    the signal is sent; on a loaded machine the threads may run on for milliseconds)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # a thread that just ended
                pass
        if states and all(st in "tT" for st in states):
            return
        assert time.monotonic() < end, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.01)


def test_a_completed_write_is_in_the_peers_memory(pair):
    """What a sender's TransferDone rests on: a completed write has been copied into the
    peer's memory, not only into a socket. Mooncake 0.3.13's TCP transport acknowledges a
    write once its peer applied it (its protocol v2; ``MC_TCP_PROTO=1`` selects v1, whose
    writes complete in the local socket: 33 KiB to a stopped peer then complete in ~1 ms).
    So a write to a stopped peer does not complete, and the bytes of the write that
    completes once it runs again are there, read at once."""
    writer, _ = pair
    victim = Peer(4 * MiB).ready()
    n = 33 * 1024  # a 33-token prompt's KV in the vLLM tests: one piece, far less than a socket buffer
    args = dict(session=victim.session, src_off=[4096], dst_addrs=[victim.addr], lengths=[n])
    try:
        writer.call("fill", seed=11)
        assert writer.call("write", deadline_s=5.0, **args)["ok"]  # connects
        victim.call("fill", seed=5)
        _stop(victim.proc.pid)
        out = writer.call("write", deadline_s=1.0, **args)
        assert not out["ok"] and out["type"] == "TransportTimeout", out
        os.kill(victim.proc.pid, signal.SIGCONT)
        assert writer.call("settle", timeout_s=10.0) is True
        assert writer.call("write", deadline_s=5.0, **args)["ok"]
        bad, first = victim.call("verify", fill_seed=5, src_seed=11, src_nbytes=writer.nbytes, src_off=np.array([4096]),
                                 dst_off=np.array([0]), lengths=np.array([n]))
        assert bad == 0, f"{bad} bytes differ from byte {first} on"
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
        victim.stop()


# ---------------------------------------------------------------------------- one process


def test_split_pieces_matches_a_loop():
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 50, 200).astype(np.int64)
    src = rng.integers(1, 1 << 40, 200).astype(np.int64)
    dst = rng.integers(1, 1 << 40, 200).astype(np.int64)
    ps, pd, pl = split_pieces(src, dst, lengths, 7)
    want = [(s + o, d + o, min(7, n - o)) for s, d, n in zip(src, dst, lengths) for o in range(0, n, 7)]
    assert list(zip(ps.tolist(), pd.tolist(), pl.tolist())) == [tuple(map(int, w)) for w in want]
    assert pl.dtype == np.int64 and int(pl.sum()) == int(lengths.sum())
    same = split_pieces(src, dst, np.minimum(lengths, 7), 7)
    assert int(same[2].sum()) == int(np.minimum(lengths, 7).sum())


@pytest.fixture(scope="module")
def local():
    with pytest.MonkeyPatch.context() as mp_:
        for k, v in CHILD_ENV.items():
            mp_.setenv(k, v)
        t = MooncakeTransport()
        try:
            yield t
        finally:
            t.close()


def test_session_id_and_registration(local):
    host, port = local.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    a = np.zeros(1 << 16, dtype=np.uint8)
    local.register(a.ctypes.data, a.nbytes)
    local.register(a.ctypes.data, a.nbytes)  # idempotent
    assert registered_ranges(local)[a.ctypes.data] == a.nbytes
    with pytest.raises(TransportError, match="registered with"):
        local.register(a.ctypes.data, 100)
    with pytest.raises(TransportError, match="overlaps"):
        local.register(a.ctypes.data + 8, 100)
    local.unregister(a.ctypes.data)
    local.unregister(a.ctypes.data)  # unknown: ignored
    assert a.ctypes.data not in registered_ranges(local)


def test_register_tensor(local):
    import torch
    t = torch.zeros(4, 1024, dtype=torch.float16)
    addr, nbytes = local.register_tensor(t)
    assert (addr, nbytes) == (t.data_ptr(), 8192)
    with pytest.raises(TransportError, match="non-contiguous"):
        local.register_tensor(t.t())
    local.unregister(addr)


def test_bad_inputs_raise_transport_error(local):
    a = np.zeros(4096, dtype=np.uint8)
    local.register(a.ctypes.data, a.nbytes)
    base = a.ctypes.data
    try:
        peer = "127.0.0.1:1"
        with pytest.raises(TransportError, match="differ in length"):
            local.write(peer, [base], [1, 2], [1])
        with pytest.raises(TransportError, match="negative"):
            local.write(peer, [base], [1 << 30], [-1])
        with pytest.raises(TransportError, match="outside registered local memory"):
            local.write(peer, [base + 4000], [1 << 30], [200])
        with pytest.raises(TransportError, match="1-d"):
            local.write(peer, [[base]], [[1]], [[1]])
        with pytest.raises(TransportError, match="integers"):
            local.write(peer, [1.5], [1.5], [1.0])
        empty = local.write(peer, [], [], [])
        assert empty.bytes == 0 and empty.segments == 0 and empty.pieces == 0
        zero = local.write(peer, [base], [1 << 30], [0])  # zero-length: nothing to move
        assert zero.bytes == 0 and zero.segments == 0
    finally:
        local.unregister(base)


def test_failed_initialize_and_closed_transport_raise():
    with pytest.MonkeyPatch.context() as mp_:
        for k, v in CHILD_ENV.items():
            mp_.setenv(k, v)
        with pytest.raises(TransportError, match="initialize"):
            MooncakeTransport(protocol="xgmi")  # refused by the binding, returns -1
        t = MooncakeTransport()
        t.close()
        t.close()
        assert t.closed
        with pytest.raises(TransportError, match="closed"):
            t.register(4096, 4096)
        with pytest.raises(TransportError, match="closed"):
            t.write("127.0.0.1:1", [4096], [4096], [1])


def test_a_closed_sender_gives_back_its_staging_registration():
    """A sender registers its staging rings and prestage buffer with the transport and
    unregisters them at close (the pool stays: the engine owns it), so senders made one
    after another on one transport never meet their predecessors' freed memory as
    'overlaps registered'."""
    from prometheus_client import CollectorRegistry

    from kvbridge.common.handoff import KVSender
    from kvbridge.common.metrics import KVBridgeMetrics
    from kvbridge.common.settings import BridgeSettings
    from kvbridge.layout.pools import allocate_pool

    lay = allocate_pool("sglang", layers=1, total_heads=1, head_dim=16, dtype="bf16", tokens_per_block=16,
                        num_blocks=4, tp_size=1, tp_rank=0, seed=3)
    pool = {int(x.data_ptr()) for x in lay.tensors}
    t = MooncakeTransport("127.0.0.1")
    try:
        for _ in range(4):
            s = KVSender(lay, t, config=BridgeSettings().handoff(), metrics=KVBridgeMetrics(CollectorRegistry()))
            assert len(registered_ranges(t)) > len(pool)  # rings (and the prestage) registered beside the pool
            s.close()
            assert set(registered_ranges(t)) == pool, "a closed sender left staging registered"
    finally:
        t.close()
