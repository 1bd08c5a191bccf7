"""Fault injection: prefill and decode in separate OS processes, each fault for both plugins.

Faults: decode killed mid-transfer (SIGKILL), prefill killed mid-transfer, prefill stopped
(SIGSTOP: it hangs) then continued, abort from the prefill side and from the decode side
mid-transfer, a room that never gets its peer, a bootstrap server (SGLang) / discovery bus
(TensorRT-LLM) that is down; the link cut between two hosts is in test_cross_host.py.

"Mid-transfer" is made deterministic by a throttle in the peer processes
(``kvhelpers.install_test_hooks``): while the parent holds the file ``slow``, each piece a
Mooncake transport submits waits 20-40 ms (the bytes still go through the real engine
over TCP), and the second piece creates ``started``; the parent injects the fault then,
with dozens of pieces still to go. Timeouts are short (peer timeout 1.5 s, deadlines of a
few seconds), so each case takes seconds.

Asserted in every case: each surviving side ends Failed with a reason naming the fault,
within its bound plus one second (measured: fault -> terminal state); kvbridge released
every block it leased exactly once (lease gauges back to zero, no refused second release
in the peers' logs, the engine's free counts back to where they were, no double free);
pages a failed decode request held do not change after it reported Failed; the next
request between the surviving peers (or a restarted one) is byte-exact. The TensorRT-LLM
decode falls back to recomputing the prompt (``on_failure="recompute"``) and its KV must
then equal the prefill's. Results are printed as a matrix at the end of the run and
written to ``build/reliability/faults.json`` (``scripts/reliability_report.py`` turns them
into docs/reliability.md).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import socket
import tempfile
import time

import numpy as np
import pytest

pytest.importorskip("mooncake")

from kvbridge.adapters.trtllm import Handle  # noqa: E402
from kvhelpers import read_events  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

FAULTS = ["abort_decode", "abort_prefill", "sigstop_prefill", "never_peer", "bootstrap_down", "kill_decode",
          "kill_prefill"]
RESULTS: list[dict] = []  # one row per (plugin, fault): the matrix printed by conftest
PEER_TIMEOUT_S = 1.5
OUT = os.environ.get("KVBRIDGE_RELIABILITY_DIR", os.path.join(os.path.dirname(__file__), "..", "build", "reliability"))


def _wait_file(path: str, timeout: float = 30.0) -> float:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear: the transfer never got under way")
        time.sleep(0.002)
    return time.monotonic()


class Throttle:
    """The parent's switch for the peers' write throttle, and their recorded warnings."""

    def __init__(self, delay_s: float):
        self.dir = tempfile.mkdtemp(prefix="kvb-faults-")
        self.hooks = {"dir": self.dir, "delay_s": delay_s, "piece_bytes": 16 << 10}

    def on(self) -> None:
        for f in ("started",):
            if os.path.exists(os.path.join(self.dir, f)):
                os.unlink(os.path.join(self.dir, f))
        open(os.path.join(self.dir, "slow"), "w").close()

    def off(self) -> None:
        for f in ("slow", "started"):
            if os.path.exists(os.path.join(self.dir, f)):
                os.unlink(os.path.join(self.dir, f))

    @property
    def started(self) -> str:
        return os.path.join(self.dir, "started")

    def events(self, since: float, pid: int | None = None) -> list[dict]:
        return [e for e in read_events(self.dir) if e["t"] >= since and (pid is None or e["pid"] == pid)]

    def double_releases(self, since: float) -> list[str]:
        return [e["msg"] for e in self.events(since) if "already released" in e["msg"]]

    def failed_at(self, since: float, pid: int, room: int) -> tuple[float, str] | None:
        """When (monotonic) and why the sender in ``pid`` failed ``room``, from its log."""
        tag = f"sender: room {room} failed: "
        for e in self.events(since, pid):
            if e["msg"].startswith(tag):
                return e["t"], e["msg"][len(tag):]
        return None


def _record(row: dict) -> None:
    """Keep a case's row for the matrix and merge it into ``OUT/faults.json``."""
    key = (row["plugin"], row["fault"])
    RESULTS[:] = [r for r in RESULTS if (r["plugin"], r["fault"]) != key] + [row]
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "faults.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    rows = [r for r in rows if (r["plugin"], r["fault"]) != key] + [row]
    with open(path, "w") as f:
        json.dump({"peer_timeout_s": PEER_TIMEOUT_S, "rows": rows}, f, indent=1)


def _state(res: dict) -> str:
    """An SGLang peer's result state (KVPoll) as a name."""
    return {0: "FAILED", 4: "SUCCESS"}.get(res["state"], str(res["state"]))


def _side(name: str, state: str, reason: str, elapsed: float, bound: float, must: tuple[str, ...]) -> dict:
    """One surviving side's outcome, checked: Failed, a reason naming the fault, in time."""
    assert state == "FAILED", f"{name}: ended {state}, not Failed ({reason})"
    assert any(m.lower() in reason.lower() for m in must), f"{name}: reason {reason!r} names none of {must}"
    assert elapsed <= bound + 1.0, f"{name}: terminal {elapsed:.2f} s after the fault, bound {bound:.1f} s + 1 s"
    return {"side": name, "state": state, "reason": reason[:160], "seconds": round(elapsed, 3), "bound_s": bound}


def format_matrix() -> list[str]:
    """The fault matrix as text lines (printed at the end of the run)."""
    plugins = sorted({r["plugin"] for r in RESULTS})
    by = {(r["plugin"], r["fault"]): r for r in RESULTS}
    rows = []
    for fault in FAULTS + ["link_cut", "gate_recompute"]:
        cells = []
        for p in plugins:
            r = by.get((p, fault))
            if r is None:
                cells.append("-")
            elif r.get("skipped"):
                cells.append("skipped: " + r["skipped"][:34])
            else:
                worst = max((s["seconds"] - s["bound_s"] for s in r["sides"]), default=0.0)
                sides = ", ".join(f"{s['side']} {s['seconds']:.1f}/{s['bound_s']:.1f}s" for s in r["sides"])
                cells.append(("ok " if r["ok"] else "FAIL ") + sides + ("" if worst <= 1 else " LATE")
                             + (" GAP:write-after-resume" if r.get("late_write_after_resume") else ""))
        rows.append((fault, cells))
    width = max([44] + [len(c) + 2 for _, cells in rows for c in cells])
    lines = [f"{'fault':<18}" + "".join(f"{p:<{width}}" for p in plugins)]
    lines += [f"{fault:<18}" + "".join(f"{c:<{width}}" for c in cells) for fault, cells in rows]
    lines.append("cells: surviving side, fault -> terminal s / bound s; every block released once; next request byte-exact")
    return lines


# -- SGLang plugin ----------------------------------------------------------------------
SGL_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "3", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3",
           "KVBRIDGE_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)}
SGL_DEADLINE_S = 6.0  # the kvbridge room deadline the plugin derives: bootstrap + waiting timeouts
SGL_HEARTBEAT_S = 1.0  # kvbridge's default (the SGLang plugin keeps it)
SGL_QUIESCE_S = 1.0


class SGLangFarm:
    """SGLang processes (each imports SGLang once, ~10 s): the prefill, the decode and a
    spare started ahead, so a killed peer is replaced without waiting for an import."""

    def __init__(self):
        from test_sglang_backend import Peer

        self._peer = Peer
        self.ctx = mp.get_context("spawn")
        self.throttle = Throttle(0.02)
        self.port = 19300 + random.randint(0, 300) * 3
        self.spares = [Peer(self.ctx) for _ in range(2)]
        self.pre = self.take(spare=False)
        self.dec = self.take()  # and a spare starts importing while the first cases run
        self.case = None
        self.room = 100
        self.setup()

    def take(self, spare=True):
        p = self.spares.pop(0)
        p.recv(timeout=240)
        if spare:
            self.spares.append(self._peer(self.ctx))
        return p

    def new_case(self) -> dict:
        self.port += 1
        return dict(mla=False, dtype="bfloat16", layers=3, heads=4, head_dim=8, lora=16, rope=8, slots=2048,
                    page_size=16, p_tp=1, d_tp=1, seed=7, port=self.port, env=SGL_ENV, hooks=self.throttle.hooks)

    def setup(self, prefill=True, decode=True):
        if prefill or self.case is None:
            self.case = self.new_case()
        if prefill:
            self.pre.call("setup", "prefill", self.case, 0)
        if decode:
            self.dec.call("setup", "decode", self.case, 0)

    def next_room(self) -> int:
        self.room += 1
        return self.room

    def start(self, room: int, ntok: int = 200, serve_opts=(), pull_opts=(), pre=True, dec=True) -> list:
        pages = [int(x) for x in np.random.default_rng(room).permutation(np.arange(1, 129))[: -(-ntok // 16)]]
        if pre:
            self.pre.conn.send(("serve", room, pages, ntok, 3, room % 1000 + 7, 20.0, *serve_opts))
        if dec:
            self.dec.conn.send(("pull", room, ntok, 0, 20.0, *pull_opts))
        return pages

    def request_ok(self) -> bool:
        """One request between the current peers, every byte compared."""
        self.throttle.off()
        room = self.next_room()
        pages = self.start(room)
        s, d = self.pre.recv()[1], self.dec.recv()[1]
        assert s["state"] == 4 and d["state"] == 4, (s, d)
        want = self.pre.call("rows", pages, 0, 0, 200)  # the request's 200 tokens, per buffer
        assert d["output_id"] == room % 1000 + 7 and d["untouched"]
        for b, got in enumerate(d["content"]):
            assert np.array_equal(got, want[b]), f"next request: buffer {b} differs"
        return True

    def health_ok(self, *peers) -> bool:
        for p in peers:
            h = p.call("health")
            assert h["open_rooms"] == 0 and all(v == 0 for v in h["blocks_held"].values()), h
        return True

    def kill(self, p, sig=signal.SIGKILL) -> float:
        t = time.monotonic()
        os.kill(p.proc.pid, sig)
        return t

    def close(self):
        for p in [self.pre, self.dec] + self.spares:
            p.stop()


def _sgl_case(farm: SGLangFarm, fault: str) -> dict:
    th = farm.throttle
    t_case = time.monotonic()
    sides: list[dict] = []
    extra: dict = {}
    settle = 0.5
    if fault in ("abort_decode", "abort_prefill", "sigstop_prefill", "kill_decode", "kill_prefill"):
        th.on()
        room = farm.next_room()
        farm.start(room, serve_opts=(th.started,) if fault == "abort_prefill" else (),
                   pull_opts=(th.started if fault == "abort_decode" else None,
                              3.0 if fault == "sigstop_prefill" else settle))
        t_fault = _wait_file(th.started)
        if fault == "abort_decode":
            d, s = farm.dec.recv()[1], farm.pre.recv()[1]
            sides.append(_side("decode", _state(d), d.get("reason", ""),
                               d["t_end"] - d["t_abort"], SGL_QUIESCE_S, ("aborted",)))
            sides.append(_side("prefill", _state(s), s["reason"],
                               s["t_end"] - d["t_abort"], SGL_HEARTBEAT_S, ("aborted by decode",)))
            assert d["stable_after_fail"], "a write landed in the decode's pages after it reported Failed"
        elif fault == "abort_prefill":
            s, d = farm.pre.recv()[1], farm.dec.recv()[1]
            sides.append(_side("prefill", _state(s), s["reason"],
                               s["t_end"] - s["t_abort"], SGL_QUIESCE_S, ("aborted",)))
            sides.append(_side("decode", _state(d), d.get("reason", ""),
                               d["t_end"] - s["t_abort"], SGL_HEARTBEAT_S, ("aborted by prefill",)))
            assert d["stable_after_fail"], "a write landed in the decode's pages after it reported Failed"
        elif fault == "sigstop_prefill":
            farm.kill(farm.pre, signal.SIGSTOP)
            # the decode gives the silent prefill up after the peer timeout; the prefill then
            # resumes while the decode still watches the pages it released (3 s): a stalled
            # sender must not write into them once it runs again
            time.sleep(PEER_TIMEOUT_S + 0.5)
            t_cont = farm.kill(farm.pre, signal.SIGCONT)
            d = farm.dec.recv(timeout=30)[1]
            sides.append(_side("decode", _state(d), d.get("reason", ""),
                               d["t_end"] - t_fault, PEER_TIMEOUT_S, ("unreachable",)))
            assert d["t_end"] < t_cont, "the decode did not give the stopped prefill up within the peer timeout"
            s = farm.pre.recv()[1]
            sides.append(_side("prefill (continued)", _state(s), s["reason"],
                               s["t_end"] - t_cont, SGL_HEARTBEAT_S, ("aborted by decode", "unreachable", "silent")))
            # KNOWN GAP, recorded rather than asserted: a peer timeout cannot tell a dead prefill
            # from a stopped one; the piece a stopped prefill had under way lands when it
            # resumes, in pages the decode already released (only a fence on the receiver's
            # memory, e.g. write leases the receiver outlives, would close this)
            extra["late_write_after_resume"] = not d["stable_after_fail"]
        elif fault == "kill_decode":
            farm.kill(farm.dec)
            s = farm.pre.recv()[1]
            sides.append(_side("prefill", _state(s), s["reason"],
                               s["t_end"] - t_fault, PEER_TIMEOUT_S, ("write", "piece", "silent", "transfer", "peer")))
            farm.health_ok(farm.pre)
            farm.dec.stop()
            farm.dec = farm.take()  # a restarted decode instance
            farm.setup(prefill=False)
        else:  # kill_prefill
            farm.kill(farm.pre)
            d = farm.dec.recv()[1]
            sides.append(_side("decode", _state(d), d.get("reason", ""),
                               d["t_end"] - t_fault, PEER_TIMEOUT_S, ("unreachable", "failed the room")))
            assert d["stable_after_fail"]
            farm.health_ok(farm.dec)
            farm.pre.stop()
            farm.pre = farm.take()  # a restarted prefill instance, same bootstrap address
            farm.pre.call("setup", "prefill", farm.case, 0)
    elif fault == "never_peer":
        # a prefill room no decode asks for, and a decode pulling a room no prefill serves
        th.off()
        r1, r2 = farm.next_room(), farm.next_room()
        t0 = time.monotonic()
        farm.start(r1, dec=False)
        farm.start(r2, pre=False, pull_opts=(None, settle))
        s, d = farm.pre.recv()[1], farm.dec.recv()[1]
        sides.append(_side("prefill", _state(s), s["reason"], s["t_end"] - t0,
                           SGL_DEADLINE_S, ("timed out", "timeout", "deadline", "bootstrap")))
        sides.append(_side("decode", _state(d), d.get("reason", ""),
                           d["t_end"] - t0, SGL_DEADLINE_S, ("unknown room", "deadline", "timed out")))
    elif fault == "bootstrap_down":
        # the prefill instance's bootstrap server stops: a decode that knows the prefill
        # already keeps working with it; a decode that must look it up fails cleanly
        th.off()
        farm.pre.call("bootstrap_down")
        farm.request_ok()
        farm.dec.call("setup", "decode", farm.case, 0)  # a decode instance that has not met this prefill yet
        t0 = time.monotonic()
        d = farm.dec.call("pull", farm.next_room(), 200, 0, SGL_DEADLINE_S, timeout=60)
        sides.append(_side("decode (new)", _state(d), d.get("reason", ""),
                           time.monotonic() - t0, SGL_DEADLINE_S, ("parallel info", "bootstrap")))
        farm.health_ok(farm.dec)
        farm.setup()  # the prefill instance restarts its bootstrap server (a fresh case: new port)
    t_check = time.monotonic()
    farm.health_ok(*(p for p in (farm.pre, farm.dec)))
    dbl = th.double_releases(t_case)
    assert not dbl, dbl
    next_ok = farm.request_ok()
    return {"plugin": "sglang", "fault": fault, "ok": True, "sides": sides, "double_releases": len(dbl),
            "blocks_ok": True, "next_ok": next_ok, "case_s": round(time.monotonic() - t_case, 2),
            "check_s": round(time.monotonic() - t_check, 2), **extra}


@pytest.fixture(scope="module")
def sgl_farm():
    pytest.importorskip("sglang")
    farm = SGLangFarm()
    yield farm
    farm.close()


@pytest.mark.sglang
@pytest.mark.parametrize("fault", FAULTS)
def test_sglang_fault(sgl_farm, fault):
    row = _sgl_case(sgl_farm, fault)
    _record(row)


@pytest.mark.sglang
def test_sglang_link_cut(sgl_farm):
    """The SGLang plugin across two hosts (network namespaces joined by a veth pair, made
    here; see test_cross_host.py): a handoff byte-exact, then the link cut mid-transfer:
    both sides fail within the peer timeout, kvbridge holds nothing, the decode's pages do
    not change after it failed; with the link back, the next request is byte-exact."""
    from test_cross_host import MC_TIMEOUT_S, Hosts, _netns_unusable, _skip

    why = _netns_unusable()
    if why:
        _record({"plugin": "sglang", "fault": "link_cut", "skipped": why, "ok": True, "sides": []})
        _skip(why)
    farm, th = sgl_farm, sgl_farm.throttle
    hosts = Hosts()
    saved = (farm.pre, farm.dec, farm.case)
    try:
        hosts.up()
        farm.pre, farm.dec = farm.take(), farm.take(spare=False)  # fresh processes: each enters its namespace
        case = farm.new_case()
        case["hosts"] = {"prefill": hosts.ip[hosts.a], "decode": hosts.ip[hosts.b]}
        case["netns"] = {"prefill": hosts.a, "decode": hosts.b}
        case["env"] = dict(case["env"], MC_TRANSFER_TIMEOUT=str(MC_TIMEOUT_S), MC_TCP_PROGRESS_TIMEOUT_SEC=str(MC_TIMEOUT_S),
                           NO_PROXY=f"127.0.0.1,localhost,{hosts.ip[hosts.a]},{hosts.ip[hosts.b]}")
        farm.case = case
        farm.pre.call("setup", "prefill", case, 0)
        farm.dec.call("setup", "decode", case, 0)
        farm.request_ok()  # across the link, byte-exact
        for ns in (hosts.a, hosts.b):
            bound = hosts.listeners(ns)
            assert bound and not [x for x in bound if x.startswith("127.")], (ns, bound)
        t_case = time.monotonic()
        th.on()
        farm.start(farm.next_room(), pull_opts=(None, 0.5))
        t_fault = _wait_file(th.started)
        hosts.link(False)
        try:
            d = farm.dec.recv(timeout=30)[1]
            s = farm.pre.recv(timeout=30)[1]
        finally:
            hosts.link(True)
            th.off()
        sides = [_side("decode", _state(d), d.get("reason", ""),
                       d["t_end"] - t_fault, PEER_TIMEOUT_S, ("unreachable",)),
                 _side("prefill", _state(s), s["reason"], s["t_end"] - t_fault,
                       PEER_TIMEOUT_S, ("silent", "write", "timed out", "transfer", "aborted by decode"))]
        assert d["stable_after_fail"], "a write landed in the decode's pages after it reported Failed"
        end = time.monotonic() + PEER_TIMEOUT_S + MC_TIMEOUT_S + 2
        while True:  # the prefill's stuck pieces are given up by Mooncake within its own timeout
            try:
                farm.health_ok(farm.pre, farm.dec)
                break
            except AssertionError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)
        assert not th.double_releases(t_case)
        farm.request_ok()  # the link is back: the same two peers, byte-exact
        _record({"plugin": "sglang", "fault": "link_cut", "ok": True, "sides": sides, "double_releases": 0,
                 "blocks_ok": True, "next_ok": True, "case_s": round(time.monotonic() - t_case, 2)})
    finally:
        for p in (farm.pre, farm.dec):
            if p not in saved:
                p.stop()
        farm.pre, farm.dec, farm.case = saved
        hosts.down()


# -- TensorRT-LLM plugin ----------------------------------------------------------------
TRT_CFG = dict(host="127.0.0.1", deadline_s=5.0, heartbeat_s=0.2, peer_timeout_s=PEER_TIMEOUT_S, quiesce_s=0.5,
               chunk_bytes=1 << 20)
PROMPT = 512  # 16 blocks of 32 tokens, 32 KiB each: 32 throttled pieces, about 1.3 s on the wire


class TRTFarm:
    """A one-rank TensorRT-LLM prefill server and decode server (trtllm_driver), replaced
    when a fault kills one."""

    def __init__(self):
        from trtllm_driver import pool_spec

        self.throttle = Throttle(0.04)
        self.cfg = dict(TRT_CFG, hooks=self.throttle.hooks)
        self.pspec = pool_spec(tpb=32, blocks=48, seed=61)
        self.dspec = pool_spec(tpb=32, blocks=48, seed=62)
        self.servers = []
        self.pre = self.new(False)
        self.dec = self.new(True)
        self.rid = 0
        self.tx = None  # transceiver ranks (prefill, decode), made on first use

    def new(self, decode: bool):
        from trtllm_driver import Server

        s = Server([self.dspec if decode else self.pspec], self.cfg, decode)
        self.servers.append(s)
        return s

    def ids(self) -> tuple[int, int, int]:
        self.rid += 1
        return self.rid, 1000 + self.rid, 5000 + self.rid  # prefill request, decode request, room

    def start(self, send=True, recv=True, endpoints=None, prefill_bus=None):
        from test_trtllm_connector import _req

        prid, drid, room = self.ids()
        src = None
        if send:
            self.pre.step([_req(prid, PROMPT, 1, Handle("send", room))])
            src = {"specs": [self.pspec], "blocks": self.pre.ask("blocks", prid)}
        if recv:
            h = Handle("recv", room, prefill=prefill_bus) if prefill_bus else \
                Handle("recv", room, endpoints=tuple(endpoints or self.pre.sender_endpoints))
            self.dec.step([_req(drid, PROMPT, 2, h, source=src or {"specs": [self.pspec], "blocks": list(range(17))})])
        return prid, drid, room

    def until(self, servers, cond, timeout=30.0) -> float:
        """Step ``servers`` until ``cond()``; returns when it held (monotonic)."""
        return until(servers, cond, timeout)

    def clean(self, *servers) -> bool:
        from test_trtllm_connector import _check_clean

        for s in servers:
            _check_clean(s)
        return True

    def load(self, drid: int) -> tuple[dict, dict]:
        return self.dec.last[0]["results"][drid], self.dec.check()[0]["finished_loads"][drid]

    def request_ok(self) -> bool:
        from test_trtllm_connector import _done, _drained

        self.throttle.off()
        _, drid, _ = self.start()
        self.until([self.pre, self.dec], lambda: _done(self.dec, [drid]) and _drained(self.dec) and _drained(self.pre))
        res, ld = self.load(drid)
        assert res == {"tokens": 2, "cancelled": False, "computed": 1, "kv_ok": True}, (res, ld)
        assert ld["verdict"] == "ok"
        return True

    def pid(self, s) -> int:
        return s.ranks[0][1].pid

    def close(self):
        self.throttle.off()
        for s in self.servers + list(self.tx or ()):
            s.stop()


def until(servers, cond, timeout=30.0) -> float:
    """Step TensorRT-LLM ``servers`` until ``cond()``; returns when it held (monotonic)."""
    from trtllm_driver import run_until

    run_until(servers, cond, timeout)
    return time.monotonic()


def _recompute_ok(res: dict) -> bool:
    """The decode computed the whole prompt itself and its KV equals the prefill's."""
    assert res["kv_ok"] and res["computed"] == PROMPT and res["tokens"] == 2 and not res["cancelled"], res
    return True


def _trt_case(farm: TRTFarm, fault: str) -> dict:
    from test_trtllm_connector import _done, _drained

    th = farm.throttle
    t_case = time.monotonic()
    sides: list[dict] = []
    recompute = None
    cfg = TRT_CFG
    if fault in ("abort_prefill", "abort_decode"):
        return _trt_abort(farm, fault)
    if fault in ("sigstop_prefill", "kill_decode", "kill_prefill"):
        th.on()
        pre_pid = farm.pid(farm.pre)
        _, drid, room = farm.start()
        t_fault = _wait_file(th.started)
        if fault == "sigstop_prefill":
            os.kill(pre_pid, signal.SIGSTOP)
            try:
                t_end = farm.until([farm.dec], lambda: _done(farm.dec, [drid]) and _drained(farm.dec))
            finally:
                t_cont = time.monotonic()
                os.kill(pre_pid, signal.SIGCONT)
            res, ld = farm.load(drid)
            sides.append(_side("decode", "FAILED", ld["reason"], t_end - t_fault, cfg["peer_timeout_s"], ("unreachable",)))
            recompute = _recompute_ok(res)
            farm.until([farm.pre], lambda: _drained(farm.pre))
            failed = th.failed_at(t_case, pre_pid, room)
            assert failed, "the continued prefill never failed the room"
            sides.append(_side("prefill (continued)", "FAILED", failed[1], max(0.0, failed[0] - t_cont),
                               cfg["heartbeat_s"] + cfg["quiesce_s"], ("aborted by decode", "silent", "write", "transfer")))
        elif fault == "kill_decode":
            os.kill(farm.pid(farm.dec), signal.SIGKILL)
            farm.until([farm.pre], lambda: _drained(farm.pre))
            failed = th.failed_at(t_case, pre_pid, room)
            assert failed, "the prefill never failed the room"
            sides.append(_side("prefill", "FAILED", failed[1], failed[0] - t_fault, cfg["peer_timeout_s"],
                               ("write", "piece", "silent", "transfer", "peer")))
            farm.clean(farm.pre)
            farm.dec.stop()
            farm.dec = farm.new(True)  # a restarted decode server
        else:  # kill_prefill
            os.kill(pre_pid, signal.SIGKILL)
            t_end = farm.until([farm.dec], lambda: _done(farm.dec, [drid]) and _drained(farm.dec))
            res, ld = farm.load(drid)
            sides.append(_side("decode", "FAILED", ld["reason"], t_end - t_fault, cfg["peer_timeout_s"],
                               ("unreachable", "failed the room")))
            recompute = _recompute_ok(res)
            farm.clean(farm.dec)
            farm.pre.stop()
            farm.pre = farm.new(False)  # a restarted prefill server
    elif fault == "never_peer":
        th.off()
        pre_pid = farm.pid(farm.pre)
        t0 = time.monotonic()
        _, _, room1 = farm.start(recv=False)  # a prefill room no decode asks for
        _, drid, _ = farm.start(send=False)  # a decode pulling a room no prefill serves
        t_end = farm.until([farm.pre, farm.dec], lambda: _drained(farm.pre) and _done(farm.dec, [drid]) and _drained(farm.dec))
        failed = th.failed_at(t_case, pre_pid, room1)
        assert failed, "the unclaimed prefill room never failed"
        sides.append(_side("prefill", "FAILED", failed[1], failed[0] - t0, cfg["deadline_s"], ("deadline",)))
        res, ld = farm.load(drid)
        sides.append(_side("decode", "FAILED", ld["reason"], t_end - t0, cfg["deadline_s"], ("unknown room", "deadline")))
        recompute = _recompute_ok(res)
    elif fault == "bootstrap_down":
        # the prefill server's discovery bus is down (its scheduler gone): the decode cannot
        # find the prefill ranks, fails the load and recomputes
        th.off()
        with socket.socket() as sk:  # a port nothing listens on any more: the bus of a server that is gone
            sk.bind(("127.0.0.1", 0))
            bus = f"tcp://127.0.0.1:{sk.getsockname()[1]}"
        t0 = time.monotonic()
        _, drid, _ = farm.start(send=False, prefill_bus=bus)
        t_end = farm.until([farm.dec], lambda: _done(farm.dec, [drid]) and _drained(farm.dec))
        res, ld = farm.load(drid)
        sides.append(_side("decode", "FAILED", ld["reason"], t_end - t0, cfg["peer_timeout_s"], ("no answer",)))
        recompute = _recompute_ok(res)
    farm.clean(farm.pre, farm.dec)
    dbl = th.double_releases(t_case)
    assert not dbl, dbl
    next_ok = farm.request_ok()
    farm.clean(farm.pre, farm.dec)
    return {"plugin": "trtllm", "fault": fault, "ok": True, "sides": sides, "double_releases": len(dbl), "blocks_ok": True,
            "next_ok": next_ok, "recompute_ok": recompute, "case_s": round(time.monotonic() - t_case, 2)}


def _trt_abort(farm: TRTFarm, fault: str) -> dict:
    """Abort from either side mid-transfer: TensorRT-LLM cancels a request in transmission
    through its cache transceiver (``cancel_request``, retried until True), so these cases
    drive kvbridge's transceiver (trtllm_driver.TransceiverRank) in py_executor.py's order."""
    from trtllm_driver import TransceiverRank

    th = farm.throttle
    t_case = time.monotonic()
    if farm.tx is None:
        farm.tx = (TransceiverRank(farm.pspec, farm.cfg), TransceiverRank(farm.dspec, farm.cfg))
    pre, dec = farm.tx
    prid, drid, _ = farm.ids()
    th.on()
    ctx = pre.call("context", prid, PROMPT)
    source = {"specs": [farm.pspec], "blocks": pre.call("blocks", prid)}
    dec.call("gen", drid, PROMPT, ctx, source)
    _wait_file(th.started)
    side, rid = (pre, prid) if fault == "abort_prefill" else (dec, drid)
    t_abort = time.monotonic()
    assert side.call("cancel", rid) is False  # the abort is under way; blocks still held
    g = dec.call("poll_gen", drid, source, timeout=30)
    t_dec = time.monotonic()
    c = pre.call("poll_ctx", 1, timeout=30)
    t_pre = time.monotonic()
    assert side.call("cancel", rid) is True  # nothing can touch its blocks any more
    assert g["state"] == "DISAGG_TRANS_ERROR" and g["free"] == dec.free0, g
    assert c["failed"] == [prid] and c["free"] == pre.free0, c
    reasons = {e["pid"]: e["msg"] for e in th.events(t_case) if "room" in e["msg"] and ("fail" in e["msg"])}
    pre_reason = reasons.get(pre.proc.pid, "")
    dec_reason = reasons.get(dec.proc.pid, "")
    sides = [_side("prefill", "FAILED", pre_reason, t_pre - t_abort, farm.cfg["quiesce_s"] + farm.cfg["heartbeat_s"],
                   ("cancelled by the engine", "aborted by decode")),
             _side("decode", "FAILED", dec_reason, t_dec - t_abort, farm.cfg["quiesce_s"] + farm.cfg["heartbeat_s"],
                   ("cancelled by the engine", "aborted by prefill"))]
    dbl = th.double_releases(t_case)
    assert not dbl, dbl
    th.off()  # the next request between the same two ranks, byte-exact
    prid, drid, _ = farm.ids()
    ctx = pre.call("context", prid, PROMPT)
    source = {"specs": [farm.pspec], "blocks": pre.call("blocks", prid)}
    dec.call("gen", drid, PROMPT, ctx, source)
    g = dec.call("poll_gen", drid, source, timeout=30)
    c = pre.call("poll_ctx", 1, timeout=30)
    assert g["state"] == "DISAGG_GENERATION_TRANS_COMPLETE" and g["kv_ok"] and g["tokens"] == ctx["first_gen_tokens"], g
    assert c["done"] == [prid] and c["free"] == pre.free0 and g["free"] == dec.free0
    return {"plugin": "trtllm", "fault": fault, "ok": True, "sides": sides, "double_releases": 0, "blocks_ok": True,
            "next_ok": True, "via": "cache transceiver", "case_s": round(time.monotonic() - t_case, 2)}


@pytest.fixture(scope="module")
def trt_farm():
    farm = TRTFarm()
    yield farm
    farm.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_trtllm_fault(trt_farm, fault):
    row = _trt_case(trt_farm, fault)
    _record(row)
    if row.get("skipped"):
        pytest.skip(row["skipped"])


def test_trtllm_cost_gate_recompute_with_prefill_gone(trt_farm, tmp_path):
    """Decode-side recompute fallback where configured: a decode server with the cost gate on
    (tcp preset, the model's config, break-even about 52 tokens). A 30-token prompt is
    computed on the decode (its prefill room declined and released); a 512-token prompt
    whose prefill is gone (nothing listens at its endpoint any more) fails its load within
    the peer timeout and falls back to recompute (``on_failure``). Both KVs equal the
    prefill's, both requests produce their tokens, every block is back."""
    from test_trtllm_connector import _check_clean, _done, _drained, _req

    farm = trt_farm
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 1000}))
    gate = dict(farm.cfg, cost_link="tcp", cost_model=str(tmp_path), cost_prefill_tps=1e6,
                cost_decode_prefill_tps=1000, cost_queue_s=0.05)
    from trtllm_driver import Server

    dec = Server([farm.dspec], gate, True)
    farm.servers.append(dec)
    t_case = time.monotonic()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        gone = f"tcp://127.0.0.1:{sk.getsockname()[1]}"
    prid, drid, room = farm.ids()
    farm.pre.step([_req(prid, 30, 1, Handle("send", room))])
    src = {"specs": [farm.pspec], "blocks": farm.pre.ask("blocks", prid)}
    _, drid2, room2 = farm.ids()
    t0 = time.monotonic()
    dec.step([_req(drid, 30, 2, Handle("recv", room, endpoints=tuple(farm.pre.sender_endpoints)), source=src),
              _req(drid2, PROMPT, 2, Handle("recv", room2, endpoints=(gone,)),
                   source={"specs": [farm.pspec], "blocks": list(range(16, 32))})])
    t_end = until([farm.pre, dec], lambda: _done(dec, [drid, drid2]) and _drained(dec) and _drained(farm.pre))
    res = dec.last[0]["results"]
    assert res[drid] == {"tokens": 2, "cancelled": False, "computed": 30, "kv_ok": True}, res[drid]
    d = _check_clean(dec)[0]
    assert d["fallbacks"][drid]["reason"].startswith("recompute: below break-even"), d["fallbacks"]
    ld = d["finished_loads"][drid2]
    side = _side("decode (prefill gone)", "FAILED", ld["reason"], t_end - t0, farm.cfg["peer_timeout_s"],
                 ("unreachable", "no answer", "failed the room"))
    assert ld["verdict"] == "recompute"
    _recompute_ok(res[drid2])
    _check_clean(farm.pre)  # the declined room's blocks came back
    assert not farm.throttle.double_releases(t_case)
    _record({"plugin": "trtllm", "fault": "gate_recompute", "ok": True, "sides": [side], "double_releases": 0,
             "blocks_ok": True, "next_ok": True, "recompute_ok": True,
             "note": "30-token prompt below break-even computed on the decode (room declined); 512-token prompt with "
                     "its prefill gone recomputed after the failed load", "case_s": round(time.monotonic() - t_case, 2)})
