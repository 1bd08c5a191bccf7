"""Fault injection: prefill and decode in separate OS processes, each fault for both plugins.

Faults: decode killed mid-transfer (SIGKILL), prefill killed mid-transfer (SGLang also with
layer-wise sends: killed after its first layer went, before its last was computed), prefill stopped
(SIGSTOP: it hangs) then continued, abort from the prefill side and from the decode side
mid-transfer, a room that never gets its peer, a bootstrap server (SGLang) / discovery bus
(TensorRT-LLM) that is down; the link cut between two hosts is here for SGLang and in
test_cross_host.py for TensorRT-LLM (with the TensorRT-LLM kill rows at the transport's
defaults).

SGLang: real SGLang pools and kvbridge's SGLang backend classes in separate processes
(``sglang_peers``). TensorRT-LLM: the TensorRT-LLM stand-in (``kvbridge.demo.trtllm``, one
OS process per rank running the tiny Llama's real forward), a request tied to its handoff
by announcing its ``Handle`` to each server's bus; an abort there is the client cancelling
the request (``StandInServer.cancel``).

"Mid-transfer", three ways:

- held at the transport's shipped settings (``abort_decode``, ``abort_prefill``,
  ``sigstop_prefill``): pieces and in-flight bound as shipped (every piece its own batch),
  no delay; the parent's ``FaultSwitch(hold=True)`` holds one batch of the prefill's write
  *past kvbridge's write guard* (``kvhelpers.install_test_hooks``): SGLang its second (its
  first 18-piece write, one KiB-piece in the engine), TensorRT-LLM its first (the room's
  one staged 128 KiB piece). The fault is injected, the decode is seen to report Failed
  (its warning ``room N quarantined``), its blocks are seen still kept from the engine and
  kept ``HOLD_SHOWN_S`` longer, and only then is the batch let go (a stopped prefill
  continued first): it lands, so each window is forced, not raced. The release rule
  asserted: the blocks go back only after the let-go, and not one byte of them changes
  once they did (SGLang: the request's pages watched ``SGL_WATCH_S`` from their release;
  TensorRT-LLM: ``check_clean``'s ``changed_since_freed``, a digest taken at the free, with
  the held batch carrying a poison pattern so that it shows wherever it lands, and a
  recompute's KV equal to transformers'). A TensorRT-LLM ``abort_prefill`` is no failure
  (the client's cancel reaches no connector, ``_ABORT_PREFILL_NOTE``): its source blocks
  are seen pinned while the batch is held, and the load succeeds byte-exact once it went.
  The source half of the rule (a prefill's pages go back to its engine only when no piece
  can still read them) is asserted on SGLang's ``abort_prefill``: its prefill polls Failed
  only once the held batch went;
- throttled (the kill rows, ``kill_prefill_mid_layer``, ``link_cut``): while the parent arms
  the peers' writes, the Mooncake transport sends 16 KiB pieces, one in flight per peer,
  each waiting 20 ms (SGLang) / 60 ms (TensorRT-LLM) before it goes to the real engine over
  TCP; the second piece marks the transfer under way and the parent injects the fault
  then, with a dozen or more pieces still to go;
- the transport's defaults (``*_defaults`` rows, and ``link_cut_defaults``): pieces and
  in-flight bound as shipped, no delay; the prefill and decode run on two hosts (network
  namespaces, test_cross_host.Hosts) whose link is rate-limited (``tc tbf``), so the
  transfer takes about a second on the wire; the first piece submitted marks it under
  way. The row's outcome shows the fault landed mid-transfer (a transfer that had
  finished would have succeeded).

Asserted in every case: each surviving side reports the state it ended in (SGLang: its
KVPoll; TensorRT-LLM: the worker's ``finished_loads`` / ``finished_saves`` entry, its
``ok`` and its record's ``result``) with a reason naming the fault, within its bound plus
one second (measured: fault -> terminal state, or let-go -> terminal state for a sender
whose batch was held; the bounds are the configured timeouts); kvbridge released every
block it leased exactly once (SGLang: lease gauges back to zero, no refused second release
in the peers' logs; TensorRT-LLM: the KV cache manager's blocks all free, none pinned, no
room left open, no byte outside the requests' blocks changed, no freed block changed since
its free); pages a failed decode request held do not change after they went back to SGLang;
the next request between the surviving (or restarted) peers is byte-exact. A TensorRT-LLM
decode whose load failed recomputes the prompt (``on_failure="recompute"``) with the model
itself: every prompt token computed on the decode, its KV (read through TensorRT-LLM's own
indexing) equal to transformers' forward, its tokens transformers' ``generate()``.

Known gaps are asserted as the desired behaviour and marked ``xfail(strict=True)`` with the
reason: they show as failures in the matrix, and the test turns red when a gap closes.

The rows are printed as a matrix at the end of the run (conftest.py) and written to
``faults.json`` in ``KVBRIDGE_RELIABILITY_DIR`` when set (``kvbridge report --only faults``
sets it and turns them into docs/reliability.md), else in a temporary folder.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import pytest

import mooncake  # noqa: F401  (pinned: a missing one fails the run, never skips)

from kvbridge.adapters.trtllm import Handle, announce  # noqa: E402
from tests.helpers.kvhelpers import FaultSwitch, wait_until  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

FAULTS = ["abort_decode", "abort_prefill", "sigstop_prefill", "never_peer", "bootstrap_down", "kill_decode",
          "kill_prefill"]
MID_TRANSFER = {"abort_decode", "abort_prefill", "sigstop_prefill", "kill_decode", "kill_prefill"}
MATRIX_FAULTS = FAULTS + ["kill_prefill_mid_layer", "link_cut", "kill_decode_defaults", "kill_prefill_defaults",
                          "link_cut_defaults", "gate_recompute"]
RESULTS: list[dict] = []  # one row per (plugin, fault): the matrix printed by conftest
PEER_TIMEOUT_S = 1.5
# the transport as shipped: no override, no delay; the first piece submitted marks the transfer under way
DEFAULTS = dict(piece_bytes=0, inflight=0, delay_s=0.0, started_at=1)
# the held rows: the transport as shipped (every piece its own batch), the sender's second batch held past
# its write guard (SGLang: its first piece is in the engine); a TensorRT-LLM room here is one staged piece
# (the tiny Llama's 256-token prompt, 128 KiB, under one 1 MiB chunk), so its first batch is held: all of it
SHIPPED_HELD = dict(piece_bytes=0, inflight=0, delay_s=0.0, started_at=2, hold_s=120.0)
TRT_SHIPPED_HELD = dict(SHIPPED_HELD, started_at=1)
HELD = ("abort_decode", "abort_prefill", "sigstop_prefill")  # mid-transfer faults whose window is held
HOLD_SHOWN_S = 0.4  # after the decode reported Failed, the batch stays held this long: the quarantine holds


def _out_dir() -> str:
    """Where rows are written: ``KVBRIDGE_RELIABILITY_DIR`` when set, else a temporary
    folder removed at exit."""
    asked = os.environ.get("KVBRIDGE_RELIABILITY_DIR")
    if asked:
        return asked
    d = tempfile.mkdtemp(prefix="kvbridge-reliability-")
    atexit.register(shutil.rmtree, d, True)
    return d


OUT = _out_dir()


class KnownGap(Exception):
    """A documented gap showed itself (the test is ``xfail(strict=True, raises=KnownGap)``)."""


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


def _transport(fault: str) -> str:
    """How a row's transfer ran: shipped settings with its window held, throttled, or not mid-transfer."""
    return "shipped, held" if fault in HELD else ("throttled" if fault in MID_TRANSFER else "")


def _raise_gap(row: dict) -> None:
    """After the row is recorded: a known gap that showed itself fails the test (xfail)."""
    if row.get("known_gap"):
        raise KnownGap(row["known_gap"])


def _state(res: dict) -> str:
    """An SGLang peer's result state (its KVPoll) as a name."""
    return {0: "FAILED", 1: "BOOTSTRAPPING", 2: "WAITING_FOR_INPUT", 3: "TRANSFERRING", 4: "SUCCESS"}.get(
        res["state"], str(res["state"]))


def _side(name: str, state: str, reason: str, elapsed: float, bound: float, must: tuple[str, ...],
          want: tuple[str, ...] = ("FAILED",)) -> dict:
    """One side's outcome, checked: the state it reports is one of ``want``, its reason
    names the fault (one of ``must``; nothing asked when empty), in time."""
    assert state in want, f"{name}: reports {state}, not {'/'.join(want)} ({reason})"
    assert not must or any(m.lower() in reason.lower() for m in must), f"{name}: reason {reason!r} names none of {must}"
    assert elapsed <= bound + 1.0, f"{name}: terminal {elapsed:.2f} s after the fault, bound {bound:.1f} s + 1 s"
    return {"side": name, "state": state, "reason": reason[:160], "seconds": round(elapsed, 3), "bound_s": bound}


def format_matrix() -> list[str]:
    """The fault matrix as text lines (printed at the end of the run)."""
    plugins = sorted({r["plugin"] for r in RESULTS})
    by = {(r["plugin"], r["fault"]): r for r in RESULTS}
    rows = []
    for fault in MATRIX_FAULTS:
        cells = []
        for p in plugins:
            r = by.get((p, fault))
            if r is None:
                cells.append("-")
            elif r.get("skipped"):
                cells.append("skipped: " + r["skipped"][:34])
            else:
                worst = max((s["seconds"] - s["bound_s"] for s in r["sides"]), default=0.0)
                sides = ", ".join(f"{s['side']} {s['state']} {s['seconds']:.1f}/{s['bound_s']:.1f}s" for s in r["sides"])
                head = "GAP " if r.get("known_gap") else ("ok " if r["ok"] else "FAIL ")
                cells.append(head + sides + ("" if worst <= 1 else " LATE"))
        rows.append((fault, cells))
    width = max([44] + [len(c) + 2 for _, cells in rows for c in cells])
    lines = [f"{'fault':<24}" + "".join(f"{p:<{width}}" for p in plugins)]
    lines += [f"{fault:<24}" + "".join(f"{c:<{width}}" for c in cells) for fault, cells in rows]
    lines.append("cells: side, state it reports, fault -> terminal s / bound s; every block released once; next request "
                 "byte-exact; GAP: a known gap showed itself (xfail strict)")
    return lines


# -- SGLang plugin ----------------------------------------------------------------------
SGL_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "3", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3",
           "KVBRIDGE_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S), "KVBRIDGE_LAYERWISE": "false"}
SGL_LAYER_GAP_S = 2.0  # layer-wise row: the prefill's "compute" between two layers (the kill lands in it)
SGL_DEADLINE_S = 6.0  # the kvbridge room deadline the plugin derives: bootstrap + waiting timeouts
SGL_HEARTBEAT_S = 1.0  # kvbridge's default (the SGLang plugin keeps it)
SGL_QUIESCE_S = 1.0
SGL_THROTTLED = dict(piece_bytes=16 << 10, inflight=1, delay_s=0.02, started_at=2)
# once its pages went back after a failure, the decode watches them this long (sglang_peers.pull settle_s)
SGL_WATCH_S = 2.0
SGL_RATE = "1mbit"  # the two hosts' link for the defaults rows: 400 tokens (150 KiB) take about 1.2 s
SGL_NET_TOKENS = 400


class SGLangFarm:
    """SGLang processes (each imports SGLang once, ~10 s): the prefill, the decode and
    spares started ahead, so a killed peer is replaced without waiting for an import."""

    def __init__(self):
        from tests.sglang.test_sglang_backend import Peer

        self._peer = Peer
        self.ctx = mp.get_context("spawn")
        self.switch = FaultSwitch()
        self.port = 19300 + random.randint(0, 300) * 3
        self.net: dict = {}  # case fields that put the peers on two hosts (see on_hosts)
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
        case = dict(mla=False, dtype="bfloat16", layers=3, heads=4, head_dim=8, lora=16, rope=8, slots=2048,
                    page_size=16, p_tp=1, d_tp=1, seed=7, port=self.port, env=SGL_ENV, hooks=self.switch.hooks)
        net = {k: v for k, v in self.net.items() if k != "env"}
        return dict(case, **net, env=dict(SGL_ENV, **self.net.get("env", {})))

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
        self.switch.off()
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

    @contextlib.contextmanager
    def on_hosts(self, net: "SGLangNet"):
        """Run the farm's cases on ``net``'s two hosts (its own peers, in their namespaces)."""
        saved = (self.pre, self.dec, self.case, self.net)
        self.net = net.fields
        try:
            if net.pre is None:
                net.pre, net.dec = self.take(), self.take()  # fresh processes: each enters its namespace
                self.pre, self.dec = net.pre, net.dec
                self.setup()
                net.case = self.case
            self.pre, self.dec, self.case = net.pre, net.dec, net.case
            yield
        finally:
            net.pre, net.dec, net.case = self.pre, self.dec, self.case  # a replaced peer stays with the hosts
            self.pre, self.dec, self.case, self.net = saved

    def close(self):
        for p in [self.pre, self.dec] + self.spares:
            p.stop()
        self.switch.close()


def _sgl_kill(farm: SGLangFarm, fault: str, t_fault: float, sides: list) -> None:
    """The decode or the prefill killed now; the survivor's outcome, a restarted peer."""
    if fault == "kill_decode":
        farm.kill(farm.dec)
        s = farm.pre.recv()[1]
        sides.append(_side("prefill", _state(s), s["reason"],
                           s["t_end"] - t_fault, PEER_TIMEOUT_S, ("write", "piece", "silent", "transfer", "peer")))
        farm.health_ok(farm.pre)
        farm.dec.stop()
        farm.dec = farm.take()  # a restarted decode instance
        farm.setup(prefill=False)
    else:
        farm.kill(farm.pre)
        d = farm.dec.recv()[1]
        sides.append(_side("decode", _state(d), d.get("reason", ""),
                           d["t_end"] - t_fault, PEER_TIMEOUT_S, ("unreachable", "failed the room")))
        assert d["stable_after_fail"], "a write landed in the decode's pages after it reported Failed"
        farm.health_ok(farm.dec)
        farm.pre.stop()
        farm.pre = farm.take()  # a restarted prefill instance, same bootstrap address
        farm.pre.call("setup", "prefill", farm.case, 0)


def _held_figures(sw: FaultSwitch, pid: int) -> dict:
    """What the sender had under way when its batch was held: the writes it had started
    (each cut into pieces as the transport ships them), and the held batch."""
    held, writes = sw.held(), sw.writes(pid)
    assert held.get("pid") == pid, f"the held batch is not the prefill's: {held}"
    return {"writes": len(writes), "segments": sum(w["segments"] for w in writes),
            "pieces": sum(w["pieces"] for w in writes), "bytes": sum(w["bytes"] for w in writes),
            "piece_bytes": writes[0]["piece_bytes"] if writes else None,
            "inflight_bound": writes[0]["inflight"] if writes else None,
            "held_batch": held["batch"], "held_pieces": held["pieces"], "held_bytes": held["bytes"]}


def _sgl_held(farm: SGLangFarm, fault: str, sides: list, extra: dict) -> None:
    """A mid-transfer fault at the transport's shipped settings, its window held: the
    prefill's batch ``started_at`` waits past its write guard (``sw.on(hold=True)``) while
    the fault is injected (the decode aborts / the prefill aborts / the prefill is
    stopped); the decode reports Failed and keeps the request's pages (SGLang's deferred
    release, held by ``is_abort_release_safe``) for ``HOLD_SHOWN_S`` more; only then is the
    batch let go (the stopped prefill continued first). It lands; the pages go back only
    after that, and not one byte of them changes for ``SGL_WATCH_S`` after they did."""
    sw = farm.switch
    sw.on(SHIPPED_HELD, hold=True)
    room = farm.next_room()
    released_path = os.path.join(sw.dir, f"released-{room}")  # created when the pages go back to SGLang
    farm.start(room, serve_opts=(sw.started_path,) if fault == "abort_prefill" else (),
               pull_opts=(sw.started_path if fault == "abort_decode" else None, SGL_WATCH_S, None, released_path))
    t_started = wait_until(sw.started, 30, "the transfer never got under way")
    extra["in_flight"] = _held_figures(sw, farm.pre.proc.pid)
    dec_pid = farm.dec.proc.pid
    t_fault = farm.kill(farm.pre, signal.SIGSTOP) if fault == "sigstop_prefill" else None
    t_cont = None
    problems: list[str] = []  # release-rule breaches, all reported together at the end
    try:
        # Failed: the decode's receiver ends the room while a sender is not proven quiet (its
        # batch is held): the room's pages are quarantined, logged once
        wait_until(lambda: sw.logged(t_started, dec_pid, f"room {room} quarantined:") is not None, 30,
                   "the decode never reported the room Failed")
        msg = next(e["msg"] for e in sw.events(t_started, dec_pid) if f"room {room} quarantined:" in e["msg"])
        extra["quarantined_blocks"] = int(msg.split("quarantined:", 1)[1].split()[0])
        for i in range(2):  # at once, and HOLD_SHOWN_S later: SGLang's deferred release still holds the pages
            time.sleep(HOLD_SHOWN_S if i else 0.0)
            if os.path.exists(released_path) and not problems:
                problems.append("the decode's pages went back to SGLang while the sender's batch was held past its "
                                "write guard")
    finally:
        if fault == "sigstop_prefill":
            t_cont = farm.kill(farm.pre, signal.SIGCONT)  # it runs again, its batch still held
        t_let_go = time.monotonic()
        sw.release()  # the held batch goes on to the engine and lands
    d = farm.dec.recv(timeout=30)[1]
    s = farm.pre.recv(timeout=30)[1]
    if fault == "abort_decode":
        sides.append(_side("decode", _state(d), d.get("reason", ""), d["t_end"] - d["t_abort"], SGL_QUIESCE_S,
                           ("aborted",)))
        # the prefill ends once its held batch is done: measured from the let-go
        sides.append(_side("prefill", _state(s), s["reason"], s["t_end"] - t_let_go, SGL_HEARTBEAT_S,
                           ("aborted by decode",)))
    elif fault == "abort_prefill":
        # Failed once its batch went (asserted below), measured from the let-go
        t0 = t_let_go if s["t_end"] >= t_let_go else s["t_abort"]
        sides.append(_side("prefill", _state(s), s["reason"], s["t_end"] - t0, SGL_QUIESCE_S, ("aborted",)))
        sides.append(_side("decode", _state(d), d.get("reason", ""), d["t_end"] - s["t_abort"],
                           SGL_HEARTBEAT_S + SGL_QUIESCE_S, ("aborted by prefill",)))
        # the source half of the rule: SGLang frees a request's pages once its sender polls
        # Failed (prefill.py, handle_inflight_transfer_failure), so Failed must wait until no
        # piece can still read them: here, until the held batch went
        extra["prefill_failed_before_let_go_s"] = round(t_let_go - s["t_end"], 3)
        assert s["t_end"] >= t_let_go, (f"the prefill polled Failed {t_let_go - s['t_end']:.2f} s before its batch "
                                        "held past the write guard went: SGLang would free source pages a piece "
                                        "may still read")
    else:
        # a silent peer fails the room at the peer timeout; Failed follows after quiesce_s
        sides.append(_side("decode", _state(d), d.get("reason", ""), d["t_end"] - t_fault,
                           PEER_TIMEOUT_S + SGL_QUIESCE_S, ("unreachable",)))
        sides.append(_side("prefill (continued)", _state(s), s["reason"], s["t_end"] - t_let_go, SGL_HEARTBEAT_S,
                           ("aborted by decode", "unreachable", "silent")))
        assert d["t_end"] < t_cont, "the decode reported Failed only after the prefill resumed"
    t_fault = t_fault if t_fault is not None else (d["t_abort"] if fault == "abort_decode" else s["t_abort"])
    assert d["t_end"] < t_let_go, "the decode reported Failed only once the held batch was let go"
    if d["t_released"] <= t_let_go:
        problems.append(f"the decode's pages went back {d['t_released'] - t_fault:.2f} s after the fault, "
                        f"{t_let_go - d['t_released']:.2f} s before the sender's held batch was let go")
    if not d["stable_after_fail"]:  # watched from the moment they went back, for SGL_WATCH_S
        problems.append("a write landed in the decode's pages after they went back to SGLang")
    assert not problems, "; ".join(problems)
    extra.update(failed_s=round(d["t_end"] - t_fault, 3), quarantined_s=round(d["t_released"] - d["t_end"], 3),
                 released_after_let_go_s=round(d["t_released"] - t_let_go, 3), watched_s=SGL_WATCH_S,
                 landed_before_fail=d.get("landed_before_fail"))


def _sgl_case(farm: SGLangFarm, fault: str) -> dict:
    sw = farm.switch
    t_case = time.monotonic()
    sides: list[dict] = []
    extra: dict = {}
    settle = 0.5
    if fault in HELD:
        _sgl_held(farm, fault, sides, extra)
    elif fault in ("kill_decode", "kill_prefill"):
        sw.on(SGL_THROTTLED)
        room = farm.next_room()
        farm.start(room, pull_opts=(None, settle))
        t_fault = wait_until(sw.started, 30, "the transfer never got under way")
        _sgl_kill(farm, fault, t_fault, sides)
    elif fault == "never_peer":
        # a prefill room no decode asks for, and a decode pulling a room no prefill serves
        sw.off()
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
        sw.off()
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
    dbl = sw.double_releases(t_case)
    assert not dbl, dbl
    next_ok = farm.request_ok()
    return {"plugin": "sglang", "fault": fault, "ok": True, "sides": sides, "double_releases": len(dbl),
            "blocks_ok": True, "next_ok": next_ok, "transport": _transport(fault),
            "case_s": round(time.monotonic() - t_case, 2), "check_s": round(time.monotonic() - t_check, 2), **extra}


@pytest.fixture(scope="module")
def sgl_farm():
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    farm = SGLangFarm()
    yield farm
    farm.close()


@pytest.mark.sglang
@pytest.mark.parametrize("fault", FAULTS)
def test_sglang_fault(sgl_farm, fault):
    row = _sgl_case(sgl_farm, fault)
    _record(row)
    _raise_gap(row)


def _sgl_mid_layer_case(farm: SGLangFarm) -> dict:
    """``kill_prefill_mid_layer``: a layer-wise prefill (``layerwise`` on: each layer goes to
    the sender from the hooked ``set_kv_buffer`` as the forward writes it) is killed after
    layer 0 went, while it computes layer 1 (throttled writes; ``SGL_LAYER_GAP_S`` between
    layers). The decode: Failed within the peer timeout, some of the room's bytes had
    landed (a partial room) and it was not admitted, nothing lands after Failed, its
    blocks released once. Then a layer-wise request between the decode and a restarted
    prefill, byte-exact, and the usual next request."""
    sw = farm.switch
    t_case = time.monotonic()
    sides: list[dict] = []
    # a fresh case (new bootstrap port: the decode has no record of an earlier prefill there)
    # whose prefill manager builds the streamer and hooks set_kv_buffer
    case = farm.new_case()
    farm.case = dict(case, env=dict(case["env"], KVBRIDGE_LAYERWISE="true"))
    farm.pre.call("setup", "prefill", farm.case, 0)
    farm.dec.call("setup", "decode", farm.case, 0)
    sw.on(SGL_THROTTLED)
    room, ntok = farm.next_room(), 200
    pages = [int(x) for x in np.random.default_rng(room).permutation(np.arange(1, 129))[: -(-ntok // 16)]]
    progress = os.path.join(OUT, f"layers-{room}")
    farm.pre.conn.send(("serve_layerwise", room, pages, ntok, room % 1000 + 7, 20.0, SGL_LAYER_GAP_S, progress))
    farm.dec.conn.send(("pull", room, ntok, 0, 20.0, None, 0.5))
    t_fault = wait_until(sw.started, 30, "the first layer never got under way")
    farm.kill(farm.pre)
    with open(progress) as f:
        written = int(f.read())
    os.unlink(progress)
    # the transfer was under way while later layers were still to be computed: mid-layer
    assert 1 <= written < farm.case["layers"], f"killed after {written} of {farm.case['layers']} layers were written"
    d = farm.dec.recv()[1]
    sides.append(_side("decode", _state(d), d.get("reason", ""), d["t_end"] - t_fault, PEER_TIMEOUT_S,
                       ("unreachable", "failed the room")))
    assert d["landed_before_fail"], "no byte of layer 0 had landed: the kill was not mid-layer"
    assert d["stable_after_fail"], "a write landed in the decode's pages after it reported Failed"
    farm.health_ok(farm.dec)
    farm.pre.stop()
    farm.pre = farm.take()  # a restarted prefill instance (layer-wise), same bootstrap address
    farm.pre.call("setup", "prefill", farm.case, 0)
    sw.off()
    room = farm.next_room()
    pages = [int(x) for x in np.random.default_rng(room).permutation(np.arange(1, 129))[: -(-ntok // 16)]]
    farm.pre.conn.send(("serve_layerwise", room, pages, ntok, room % 1000 + 7, 20.0, 0.0))
    farm.dec.conn.send(("pull", room, ntok, 0, 20.0))
    s, d = farm.pre.recv()[1], farm.dec.recv()[1]
    assert s["state"] == 4 and d["state"] == 4, (s, d)
    assert s["pieces_after_layer"] == [1, 2, 3] and s["ended_by"] == "finish", s
    want = farm.pre.call("rows", pages, 0, 0, ntok)
    assert d["output_id"] == room % 1000 + 7 and d["untouched"]
    for b, got in enumerate(d["content"]):
        assert np.array_equal(got, want[b]), f"layer-wise request after the restart: buffer {b} differs"
    farm.health_ok(farm.pre, farm.dec)
    dbl = sw.double_releases(t_case)
    assert not dbl, dbl
    farm.setup()  # a fresh case for the next rows (layer-wise off, new bootstrap port)
    next_ok = farm.request_ok()
    return {"plugin": "sglang", "fault": "kill_prefill_mid_layer", "ok": True, "sides": sides,
            "double_releases": len(dbl), "blocks_ok": True, "next_ok": next_ok, "transport": "throttled",
            "layers_written_at_kill": written, "layerwise_after_restart_ok": True, "case_s": round(time.monotonic() - t_case, 2)}


@pytest.mark.sglang
def test_sglang_fault_kill_prefill_mid_layer(sgl_farm):
    row = _sgl_mid_layer_case(sgl_farm)
    _record(row)


class SGLangNet:
    """Two hosts (network namespaces joined by a veth pair, test_cross_host.Hosts) and the
    SGLang peers that run on them, shared by the cases below."""

    def __init__(self, hosts):
        from tests.faults.test_cross_host import MC_TIMEOUT_S

        a, b = hosts.ip[hosts.a], hosts.ip[hosts.b]
        self.hosts = hosts
        self.fields = {"hosts": {"prefill": a, "decode": b}, "netns": {"prefill": hosts.a, "decode": hosts.b},
                       "env": {"MC_TRANSFER_TIMEOUT": str(MC_TIMEOUT_S), "MC_TCP_PROGRESS_TIMEOUT_SEC": str(MC_TIMEOUT_S),
                               "NO_PROXY": f"127.0.0.1,localhost,{a},{b}"}}
        self.pre = self.dec = self.case = None


@pytest.fixture(scope="module")
def sgl_net(sgl_farm):
    """Two hosts for the SGLang cases below, or why they cannot be made here (a str)."""
    from tests.faults.test_cross_host import Hosts, _netns_unusable

    why = _netns_unusable()
    if why:
        yield why
        return
    net = SGLangNet(Hosts(index=1))
    try:
        net.hosts.up()
        yield net
    finally:
        for p in (net.pre, net.dec):
            if p is not None:
                p.stop()
        net.hosts.down()


def _skip_row(fault: str, why: str) -> None:
    from tests.faults.test_cross_host import _skip

    _record({"plugin": "sglang", "fault": fault, "skipped": why, "ok": True, "sides": []})
    _skip(why)


@pytest.mark.sglang
@pytest.mark.parametrize("mode", ["throttled", "defaults"])
def test_sglang_link_cut(sgl_farm, sgl_net, mode):
    """The SGLang plugin across two hosts (network namespaces joined by a veth pair, made
    here; see test_cross_host.py): a handoff byte-exact, then the link cut mid-transfer
    (throttled writes, or the transport's defaults over a link rate-limited to
    ``SGL_RATE``): both sides fail within the peer timeout, kvbridge holds nothing, the
    decode's pages do not change after it failed; with the link back, the next request is
    byte-exact."""
    from tests.faults.test_cross_host import MC_TIMEOUT_S

    fault = "link_cut" if mode == "throttled" else "link_cut_defaults"
    if isinstance(sgl_net, str):
        _skip_row(fault, sgl_net)
    farm, sw, hosts = sgl_farm, sgl_farm.switch, sgl_net.hosts
    with farm.on_hosts(sgl_net):
        farm.request_ok()  # across the link, byte-exact
        for ns in (hosts.a, hosts.b):
            bound = hosts.listeners(ns)
            assert bound and not [x for x in bound if x.startswith("127.")], (ns, bound)
        t_case = time.monotonic()
        if mode == "defaults":
            hosts.limit(SGL_RATE)
        try:
            sw.on(SGL_THROTTLED if mode == "throttled" else DEFAULTS)
            farm.start(farm.next_room(), ntok=200 if mode == "throttled" else SGL_NET_TOKENS, pull_opts=(None, 0.5))
            wait_until(sw.started, 30, "the transfer never got under way")
            hosts.link(False)
            t_fault = time.monotonic()
            try:
                # the decode gives the silent prefill up and reports Failed, but nothing proves the
                # prefill quiet over a cut link: its pages stay quarantined until the link is back
                # (the prefill, settled once Mooncake gave its pieces up, then answers the abort)
                wait_until(lambda: sw.logged(t_fault, farm.dec.proc.pid, "quarantined") is not None, 30,
                           "the decode never gave the cut-off prefill up")
            finally:
                hosts.link(True)
            d = farm.dec.recv(timeout=30)[1]
            s = farm.pre.recv(timeout=30)[1]
        finally:
            sw.off()
            hosts.unlimit()
        # Failed: the peer timeout, then quiesce_s; the prefill's pages back once Mooncake gave
        # its pieces up (its own timeout) and the room settled
        sides = [_side("decode", _state(d), d.get("reason", ""),
                       d["t_end"] - t_fault, PEER_TIMEOUT_S + SGL_QUIESCE_S, ("unreachable",)),
                 _side("prefill", _state(s), s["reason"], s["t_end"] - t_fault,
                       PEER_TIMEOUT_S + MC_TIMEOUT_S, ("silent", "write", "timed out", "transfer", "aborted by decode"))]
        assert d["t_released"] > t_fault + PEER_TIMEOUT_S, "the decode's pages went back before the prefill proved quiet"
        assert d["stable_after_fail"], "a write landed in the decode's pages after they went back to SGLang"

        def released() -> bool:  # the prefill's stuck pieces are given up by Mooncake within its own timeout
            try:
                return farm.health_ok(farm.pre, farm.dec)
            except AssertionError:
                return False

        t_back = wait_until(released, PEER_TIMEOUT_S + MC_TIMEOUT_S + 2, "kvbridge still holds blocks after the cut")
        assert not sw.double_releases(t_case)
        farm.request_ok()  # the link is back: the same two peers, byte-exact
        _record({"plugin": "sglang", "fault": fault, "ok": True, "sides": sides, "double_releases": 0,
                 "blocks_ok": True, "next_ok": True, "transport": mode, "blocks_back_s": round(t_back - t_fault, 2),
                 "case_s": round(time.monotonic() - t_case, 2)})


@pytest.mark.sglang
@pytest.mark.parametrize("fault", ["kill_decode", "kill_prefill"])
def test_sglang_fault_transport_defaults(sgl_farm, sgl_net, fault):
    """The kill rows again with the transport's defaults (no throttle, no delay): the two
    peers on two hosts whose link is rate-limited to ``SGL_RATE``, the fault as soon as the
    first piece is submitted; the survivor fails within the peer timeout (had the transfer
    finished first, it would have succeeded), a restarted peer takes over, byte-exact."""
    if isinstance(sgl_net, str):
        _skip_row(fault + "_defaults", sgl_net)
    farm, sw, hosts = sgl_farm, sgl_farm.switch, sgl_net.hosts
    sides: list[dict] = []
    with farm.on_hosts(sgl_net):
        t_case = time.monotonic()
        hosts.limit(SGL_RATE)
        try:
            sw.on(DEFAULTS)
            farm.start(farm.next_room(), ntok=SGL_NET_TOKENS, pull_opts=(None, 0.5))
            t_fault = wait_until(sw.started, 30, "the transfer never got under way")
            _sgl_kill(farm, fault, t_fault, sides)
        finally:
            sw.off()
            hosts.unlimit()
        farm.health_ok(farm.pre, farm.dec)
        assert not sw.double_releases(t_case)
        farm.request_ok()
        _record({"plugin": "sglang", "fault": fault + "_defaults", "ok": True, "sides": sides, "double_releases": 0,
                 "blocks_ok": True, "next_ok": True, "transport": "defaults",
                 "case_s": round(time.monotonic() - t_case, 2)})


# -- TensorRT-LLM plugin ----------------------------------------------------------------
TRT_PLUGIN = dict(host="127.0.0.1", deadline_s=4.0, heartbeat_s=0.2, peer_timeout_s=PEER_TIMEOUT_S, quiesce_s=0.5,
                  chunk_bytes=1 << 20)
# the cost gate of the fault matrix's decode server (tcp preset, the tiny model's config,
# fixed throughputs): break-even about 52 tokens, so it moves every fault case's prompt
# and computes the gate row's 30-token prompt itself
TRT_GATE = dict(cost_gate_enabled=True, link="tcp", cost_prefill_tps=1e6, cost_decode_prefill_tps=1000, cost_queue_s=0.05)
PROMPT = 256  # 8 blocks of 32 tokens, 16 KiB each (the tiny Llama: 512 B per token)
MAX_NEW = 2
HD = 16  # the tiny Llama's head_dim
TOKEN_BYTES = 2 * 2 * 2 * HD * 4  # layers x K/V x KV heads x head_dim x float32
# 8 pieces of 16 KiB, one in flight, 60 ms each: about half a second on the wire
TRT_THROTTLED = dict(piece_bytes=16 << 10, inflight=1, delay_s=0.06, started_at=2)
# The prompt's last position after a load is computed on its own (one token over the moved
# KV): its float32 sums differ from transformers' one-pass forward by up to ~2.3e-5 here
# (measured over 12 prompts of 128-512 tokens), more than the 1e-5 a one-pass prefill meets
# (engine_kv.assert_kv_close); anything wrong (zeros, another prompt's KV, a shifted
# position) differs by orders of magnitude more. A recompute after a failed load is one
# pass (the plugin gives the rewound request its whole chunk back) and meets 1e-5.
RECOMPUTE_ATOL = 5e-5
SHORT = 96  # prompts of the cases that need no transfer under way
_SEEDS = itertools.count(10_000)  # prompt seeds: every case its own prompt (no device cache hit by chance)
_ROOMS = itertools.count(5001)


def _until(servers, cond, timeout: float = 30.0) -> float:
    """Step TensorRT-LLM ``servers`` until ``cond()``; returns when it held (monotonic)."""
    from tests.helpers.trtllm_servers import run_until

    run_until(servers, cond, timeout)
    return time.monotonic()


def _answered(server, rid: int) -> bool:
    """``server`` answered request ``rid`` and holds nothing any more."""
    return rid in server.responses and server.drained()


def _trt_state(entry: dict) -> str:
    """The state a TensorRT-LLM worker reports for one half of a handoff (its
    ``finished_loads`` / ``finished_saves`` entry): the record's result (SUCCESS, FAILED,
    ABORTED, DECLINED), checked against the entry's ``ok``."""
    rec = entry.get("record") or {}
    result = rec.get("result") or ("success" if entry["ok"] else "failed")
    assert (result == "success") == bool(entry["ok"]), f"ok and the record's result disagree: {entry}"
    return result.upper()


def _ended(entry: dict, seen: float) -> float:
    """When (monotonic, system-wide) the half ended: its record, else when the parent saw it."""
    rec = entry.get("record") or {}
    return rec.get("finished") or seen


class TRTServers:
    """A TensorRT-LLM prefill server and decode server of the stand-in (one rank each,
    each version on one side), every rank with the fault hooks; ``per_role``: plugin
    settings and hooks of one side (its host, its network namespace)."""

    versions = {"prefill": "main", "decode": "1.2"}

    def __init__(self, model, plugin: dict | None = None, per_role: dict | None = None):
        self.model = model
        self.switch = FaultSwitch()
        self.plugin = {**TRT_PLUGIN, **(plugin or {})}
        self.per_role = per_role or {}
        self.pre = self.dec = None
        try:
            self.pre = self.new("prefill")
            self.dec = self.new("decode")
        except BaseException:
            self.close()
            raise

    def new(self, role: str, **plugin):
        from kvbridge.demo.trtllm import StandInServer

        mine = self.per_role.get(role, {})
        return StandInServer(self.versions[role], self.model, num_blocks=48, tokens_per_block=32,
                             plugin={**self.plugin, **mine.get("plugin", {}), **plugin},
                             setup=("tests.helpers.kvhelpers:install_test_hooks", {**self.switch.hooks, **mine.get("hooks", {})}))

    def replace(self, role: str) -> None:
        """A restarted server in place of ``role``'s (killed) one."""
        name = "pre" if role == "prefill" else "dec"
        getattr(self, name).stop()
        setattr(self, name, self.new(role))

    def start(self, *, send=True, recv=True, handle=None, prompt=None, n: int = PROMPT) -> SimpleNamespace:
        """A handoff of a new ``n``-token prompt: its halves announced to each server's bus,
        then submitted."""
        from kvbridge.demo.models import random_prompt

        prompt = prompt or random_prompt(n, seed=next(_SEEDS))
        room = next(_ROOMS)
        if send:
            announce(self.pre.bus, prompt, Handle("send", room))
        if recv:
            announce(self.dec.bus, prompt, handle(room) if handle else
                     Handle("recv", room, endpoints=tuple(self.pre.sender_endpoints)))
        return SimpleNamespace(prompt=prompt, room=room, prid=self.pre.submit(prompt, 1) if send else None,
                               drid=self.dec.submit(prompt, MAX_NEW) if recv else None)

    def computed_right(self, h, server=None, what: str = "decode KV after the recompute") -> bool:
        """The decode computed the whole prompt with the model: every prompt token run,
        its tokens transformers' ``generate()``, its KV (read through TensorRT-LLM's
        indexing) equal to transformers' forward (``engine_kv.assert_kv_close``, one pass)."""
        from tests.helpers.engine_kv import assert_kv_close, transformers_kv
        from kvbridge.demo.models import reference_generate
        from tests.helpers.trtllm_servers import server_kv

        server = server or self.dec
        out = server.responses[h.drid]
        brief = {k: out[k] for k in ("finish_reason", "context_tokens_computed", "output_token_ids")}
        assert out["finish_reason"] == "length" and out["context_tokens_computed"] == len(h.prompt), brief
        got = server_kv(server, out["blocks"], HD, range(len(h.prompt)))
        assert_kv_close(got, transformers_kv(self.model, h.prompt), what)
        assert out["output_token_ids"] == reference_generate(self.model, h.prompt, MAX_NEW).token_ids, brief
        return True

    def loaded_right(self, h) -> dict:
        """The decode loaded the prompt's KV from the prefill: only its last token computed,
        every moved byte equal to the prefill's and that KV transformers' (the last
        position, computed by the decode on its own, within ``RECOMPUTE_ATOL``), its tokens
        generate()'s."""
        import torch

        from tests.helpers.engine_kv import assert_kv_close, transformers_kv
        from kvbridge.demo.models import reference_generate
        from tests.helpers.trtllm_servers import server_kv

        out = self.dec.responses[h.drid]
        ld = self.dec.state()["finished_loads"][h.drid]
        assert ld["verdict"] == "ok" and _trt_state(ld) == "SUCCESS", ld
        assert ld["record"]["bytes"] == len(h.prompt) * TOKEN_BYTES, ld
        assert out["context_tokens_computed"] == 1, out["context_tokens_computed"]
        assert out["output_token_ids"] == reference_generate(self.model, h.prompt, MAX_NEW).token_ids
        got = server_kv(self.dec, out["blocks"], HD, range(len(h.prompt)))
        moved = server_kv(self.pre, self.pre.responses[h.prid]["blocks"], HD, range(len(h.prompt) - 1))
        torch.testing.assert_close(got[:, :, :-1], moved, rtol=0, atol=0)
        want = transformers_kv(self.model, h.prompt)
        assert_kv_close(got[:, :, :-1], want[:, :, :-1], "decode KV after the handoff (moved positions)")
        torch.testing.assert_close(got[:, :, -1:], want[:, :, -1:], rtol=1e-4, atol=RECOMPUTE_ATOL,
                                   msg=lambda m: f"decode KV after the handoff (its last position): {m}")
        return ld

    def request_ok(self, **start) -> dict:
        """One handoff between the current servers, byte-exact, every block back."""
        from tests.helpers.trtllm_servers import check_clean

        self.switch.off()
        h = self.start(**start)
        _until([self.pre, self.dec], lambda: _answered(self.dec, h.drid) and self.pre.drained())
        ld = self.loaded_right(h)
        check_clean(self.pre)
        check_clean(self.dec)
        return ld

    def close(self) -> None:
        """Stop both servers (at once: a rank takes seconds to exit)."""
        import threading

        stops = [threading.Thread(target=s.stop) for s in (self.pre, self.dec) if s is not None]
        for t in stops:
            t.start()
        for t in stops:
            t.join()
        self.switch.close()


def trt_kill(farm: TRTServers, fault: str, h, sides: list) -> bool | None:
    """Kill the decode (``kill_decode``) or the prefill server now, mid-transfer; check the
    survivor and put a restarted server in place. Returns the recompute check, if any."""
    from tests.helpers.trtllm_servers import check_clean

    cfg = farm.plugin
    if fault == "kill_decode":
        os.kill(farm.dec.pid(), signal.SIGKILL)
        t_fault = time.monotonic()
        seen = _until([farm.pre], farm.pre.drained)
        sv = farm.pre.state()["finished_saves"][h.prid]
        sides.append(_side("prefill", _trt_state(sv), (sv["record"] or {}).get("reason", ""),
                           _ended(sv, seen) - t_fault, cfg["peer_timeout_s"], ("write", "piece", "silent", "transfer", "peer")))
        check_clean(farm.pre)
        farm.replace("decode")
        return None
    os.kill(farm.pre.pid(), signal.SIGKILL)
    t_fault = time.monotonic()
    seen = _until([farm.dec], lambda: _answered(farm.dec, h.drid))
    ld = farm.dec.state()["finished_loads"][h.drid]
    assert ld["verdict"] == "recompute", ld
    sides.append(_side("decode", _trt_state(ld), ld["reason"], _ended(ld, seen) - t_fault, cfg["peer_timeout_s"],
                       ("unreachable", "failed the room")))
    ok = farm.computed_right(h)
    check_clean(farm.dec)
    farm.replace("prefill")
    return ok


_ABORT_PREFILL_NOTE = (
    "the client's cancel reaches no connector: TensorRT-LLM 1.2 took the request out of active_requests when it "
    "responded (its blocks pinned by AsyncTransferManager until the connector reports the send) and ignores a cancel "
    "of a request it no longer holds (the stand-in keeps it, in DISAGG_CONTEXT_TRANS_IN_PROGRESS, and skips it); "
    "the send completes and the decode decodes from the moved KV")


def _steps(server, seconds: float) -> None:
    """Executor iterations of ``server`` for ``seconds`` (at least ten)."""
    end, n = time.monotonic() + seconds, 0
    while n < 10 or time.monotonic() < end:
        server.step()
        n += 1


def _trt_held(farm: TRTServers, fault: str, sides: list, extra: dict) -> bool | None:
    """A mid-transfer fault at the transport's shipped settings, its window held: the
    prefill rank's batch ``started_at`` waits past its write guard (``sw.on(hold=True)``)
    while the fault is injected (the client cancels the decode request / cancels the prefill
    request / the prefill is stopped); the decode's connector ends the room and keeps its
    blocks from TensorRT-LLM (quarantined) for ``HOLD_SHOWN_S`` more while the executor
    runs; only then is the batch let go (the stopped prefill continued first). It lands;
    the blocks go back after that, and ``check_clean`` finds not one byte of a freed block
    changed since it was freed (``changed_since_freed``, a digest taken at the free).
    Returns the recompute check, if any."""
    from tests.helpers.trtllm_servers import check_clean

    sw, cfg = farm.switch, farm.plugin
    # a failed load's blocks get the prompt recomputed into them: the same bytes the prefill sends, so the held
    # batch carries a poison pattern, visible wherever it lands (the cancelled prefill's load succeeds: not there)
    sw.on(dict(TRT_SHIPPED_HELD, poison_held=fault != "abort_prefill"), hold=True)
    h = farm.start()
    t_started = _until([farm.pre, farm.dec], sw.started)
    extra["in_flight"] = _held_figures(sw, farm.pre.pid())
    dec_pid = farm.dec.pid()
    quarantined = lambda: sw.logged(t_started, dec_pid, f"room {h.room} quarantined:")  # noqa: E731
    back = lambda: sw.logged(t_started, dec_pid, f"room {h.room} released from quarantine")  # noqa: E731
    if fault == "abort_prefill":
        # the client cancels the prefill request while its KV is sent: TensorRT-LLM 1.2 no
        # longer holds the request (it responded) and the send goes on; its source blocks
        # stay pinned while the held batch may still read them
        farm.pre.cancel(h.prid)
        t_fault = time.monotonic()
        try:
            _steps(farm.pre, HOLD_SHOWN_S)
            _steps(farm.dec, 0.0)
            assert farm.pre.blocks(h.prid) and farm.pre.state()["pinned"], \
                "the prefill request's source blocks went back while its batch was held"
            assert h.drid not in farm.dec.responses, "the decode answered before the held batch went"
        finally:
            t_let_go = time.monotonic()
            sw.release()
        seen = _until([farm.pre, farm.dec], lambda: _answered(farm.dec, h.drid) and farm.pre.drained())
        sv = farm.pre.state()["finished_saves"][h.prid]
        ld = farm.loaded_right(h)  # every moved byte the prefill's
        sides.append(_side("prefill", _trt_state(sv), "", _ended(sv, seen) - t_fault, cfg["deadline_s"], (),
                           want=("SUCCESS",)))
        sides.append(_side("decode", _trt_state(ld), "", _ended(ld, seen) - t_fault, cfg["deadline_s"], (),
                           want=("SUCCESS",)))
        assert _ended(sv, seen) > t_let_go, "the send ended before its held batch went"
        assert farm.pre.responses[h.prid]["finish_reason"] == "length"  # it had answered before the cancel
        extra["note"] = _ABORT_PREFILL_NOTE
        return None
    t_cont = None
    problems: list[str] = []  # release-rule breaches, all reported together at the end
    pid = farm.pre.pid()
    blocks = farm.dec.blocks(h.drid)  # allocated before the load was ordered
    assert blocks, "the decode request holds no blocks while loading"
    try:
        if fault == "abort_decode":
            farm.dec.cancel(h.drid)
            t_fault = time.monotonic()
            t_answered = _until([farm.dec], lambda: h.drid in farm.dec.responses)
            out = farm.dec.responses[h.drid]
            # TensorRT-LLM applies a cancel at its next iteration (bound 0 s: no timeout is involved)
            sides.append(_side("decode (request)", str(out["finish_reason"]).upper(), "cancelled by the client",
                               t_answered - t_fault, 0.0, (), want=("CANCELLED",)))
        else:
            os.kill(pid, signal.SIGSTOP)  # holding a batch it has let past its write guard
            t_fault = time.monotonic()
        # the decode's connector ends the room (a cancelled request is found dropped; a silent
        # prefill is given up after the peer timeout); its sender is not proven quiet, so the
        # request's blocks are quarantined: not given back to TensorRT-LLM (no recompute into
        # them, no other request), counted
        _until([farm.dec], lambda: quarantined() is not None)
        t_failed = quarantined()
        _steps(farm.dec, HOLD_SHOWN_S)  # executor iterations meanwhile: nothing may hand the blocks back
        held = [q for q in farm.dec.state()["quarantine"] if q["room"] == h.room]
        extra["quarantined_blocks"] = held[0]["blocks"] if held else 0
        if back() is not None or farm.dec.blocks(h.drid) != blocks or not held or held[0]["blocks"] < len(blocks):
            problems.append("the decode request's blocks went back to TensorRT-LLM while the prefill's batch was held "
                            f"past its guard (still the request's: {farm.dec.blocks(h.drid) == blocks}, quarantined: "
                            f"{held})")
        if h.drid in farm.dec.state()["finished_loads"]:
            problems.append("the load ended while the prefill's batch was held")
    finally:
        if fault == "sigstop_prefill":
            t_cont = time.monotonic()
            os.kill(pid, signal.SIGCONT)  # it runs again, its batch still held
        t_let_go = time.monotonic()
        sw.release()  # the held batch goes on to the engine and lands
    # the batch lands in the quarantined blocks, the prefill hears the abort, settles, says it
    # is quiet; then the blocks go back (cancelled: freed; stopped: the load fails and the
    # prompt is recomputed in them, after the last byte of the prefill landed)
    if fault == "abort_decode":
        seen = _until([farm.pre, farm.dec], lambda: farm.pre.drained() and farm.dec.drained()
                      and h.drid in farm.dec.state()["finished_loads"])
    else:
        seen = _until([farm.pre, farm.dec], lambda: _answered(farm.dec, h.drid) and farm.pre.drained())
    t_back = back()
    if not problems and not (t_back is not None and t_back > t_let_go):
        problems.append("the decode request's blocks went back while the prefill's batch was held past its guard")
    t_back = t_back or t_let_go

    def soft(check, *a):  # a byte check: its failure joins the others
        try:
            return check(*a)
        except AssertionError as e:
            problems.append(str(e).splitlines()[0][:300])

    ld = farm.dec.state()["finished_loads"][h.drid]
    sv = farm.pre.state()["finished_saves"][h.prid]
    recompute = None
    if fault == "abort_decode":
        # the connector learns of the cancel only by the request's absence: it aborts the room, both ends record it
        extra["observed"] = {"decode_load": {"verdict": ld["verdict"], "state": _trt_state(ld)},
                             "prefill_save": _trt_state(sv)}
        assert ld.get("cancelled_by_engine") and _trt_state(ld) == "ABORTED", ld
        assert _trt_state(sv) == "ABORTED" and "cancelled" in (sv["record"] or {}).get("reason", ""), sv
        # the load: the room failing at the executor iteration after the cancel, Failed (quarantined) quiesce_s later
        sides.append(_side("decode (load)", _trt_state(ld), ld.get("reason") or "", t_failed - t_fault,
                           cfg["quiesce_s"], (), want=("ABORTED",)))
        # the prefill ends once its held batch is done: measured from the let-go
        sides.append(_side("prefill", _trt_state(sv), (sv["record"] or {}).get("reason", ""),
                           max(0.0, _ended(sv, seen) - t_let_go), cfg["heartbeat_s"] + cfg["quiesce_s"], (),
                           want=("ABORTED",)))
        extra["note"] = ("the decode's connector found the request dropped, aborted the room (load recorded "
                         f"{_trt_state(ld).lower()}), and the prefill ended its send as {_trt_state(sv).lower()}")
    else:
        assert ld["verdict"] == "recompute", ld
        sides.append(_side("decode", _trt_state(ld), ld["reason"], t_failed - t_fault, cfg["peer_timeout_s"] + 1.0,
                           ("unreachable",)))
        recompute = soft(farm.computed_right, h)  # KV equal to transformers': no late byte overwrote it
        sides.append(_side("prefill (continued)", _trt_state(sv), (sv["record"] or {}).get("reason", ""),
                           max(0.0, _ended(sv, seen) - t_let_go), cfg["heartbeat_s"] + cfg["quiesce_s"],
                           ("aborted by decode", "silent", "write", "transfer"), want=("FAILED", "ABORTED")))
    soft(check_clean, farm.dec)  # not one byte of a freed block changed since it was freed
    assert not problems, "; ".join(problems)
    assert not farm.dec.state()["quarantine"]
    extra.update(failed_s=round(t_failed - t_fault, 3), quarantined_s=round(t_back - t_failed, 3),
                 released_after_let_go_s=round(t_back - t_let_go, 3))
    return recompute


def _trt_case(farm: TRTServers, fault: str) -> dict:
    from kvbridge.demo.models import random_prompt
    from tests.helpers.trtllm_servers import check_clean

    sw = farm.switch
    t_case = time.monotonic()
    sides: list[dict] = []
    extra: dict = {}
    recompute = None
    cfg = farm.plugin
    if fault in HELD:
        recompute = _trt_held(farm, fault, sides, extra)
    elif fault in ("kill_decode", "kill_prefill"):
        sw.on(TRT_THROTTLED)
        h = farm.start()
        _until([farm.pre, farm.dec], sw.started)
        recompute = trt_kill(farm, fault, h, sides)
    elif fault == "never_peer":
        sw.off()
        t0 = time.monotonic()
        lone = farm.start(recv=False, n=SHORT)  # a prefill room no decode asks for
        h = farm.start(send=False, n=SHORT)  # a decode pulling a room no prefill serves
        marks: dict = {}

        def done() -> bool:
            if "pre" not in marks and farm.pre.drained():
                marks["pre"] = time.monotonic()
            if "dec" not in marks and _answered(farm.dec, h.drid):
                marks["dec"] = time.monotonic()
            return len(marks) == 2

        _until([farm.pre, farm.dec], done)
        sv = farm.pre.state()["finished_saves"][lone.prid]
        sides.append(_side("prefill", _trt_state(sv), (sv["record"] or {}).get("reason", ""),
                           _ended(sv, marks["pre"]) - t0, cfg["deadline_s"], ("deadline",)))
        ld = farm.dec.state()["finished_loads"][h.drid]
        assert ld["verdict"] == "recompute", ld
        sides.append(_side("decode", _trt_state(ld), ld["reason"], _ended(ld, marks["dec"]) - t0, cfg["deadline_s"],
                           ("unknown room", "deadline")))
        recompute = farm.computed_right(h)
    elif fault == "bootstrap_down":
        # the prefill server's discovery bus is down (its scheduler gone): the decode cannot
        # find the prefill ranks, fails the load and recomputes
        sw.off()
        with socket.socket() as sk:  # a port nothing listens on any more: the bus of a server that is gone
            sk.bind(("127.0.0.1", 0))
            bus = f"tcp://127.0.0.1:{sk.getsockname()[1]}"
        t0 = time.monotonic()
        h = farm.start(send=False, handle=lambda room: Handle("recv", room, prefill=bus), n=SHORT)
        _until([farm.dec], lambda: _answered(farm.dec, h.drid))
        ld = farm.dec.state()["finished_loads"][h.drid]
        assert ld["verdict"] == "recompute" and ld.get("record") is None, ld  # no load was ever ordered
        # no receiver record: the load failed when rank 0 gave the discovery up (its warning's time)
        t_end = sw.logged(t0, farm.dec.pid(), f"request {h.drid}: cannot reach prefill")
        assert t_end is not None, "the decode's scheduler never gave the prefill's discovery up"
        sides.append(_side("decode", _trt_state(ld), ld["reason"], t_end - t0, cfg["peer_timeout_s"], ("no answer",)))
        recompute = farm.computed_right(h)
    check_clean(farm.pre)
    check_clean(farm.dec)
    dbl = sw.double_releases(t_case)
    assert not dbl, dbl
    farm.request_ok()
    return {"plugin": "trtllm", "fault": fault, "ok": True, "sides": sides, "double_releases": len(dbl),
            "blocks_ok": True, "next_ok": True, "recompute_ok": recompute,
            "transport": _transport(fault),
            "case_s": round(time.monotonic() - t_case, 2), **extra}


@pytest.fixture(scope="module")
def trt_farm(tiny_llama_dir):
    farm = TRTServers(tiny_llama_dir, per_role={"decode": {"plugin": dict(TRT_GATE, cost_model=str(tiny_llama_dir))}})
    yield farm
    farm.close()


@pytest.mark.parametrize("fault", [
    "abort_decode",
    "abort_prefill",
    "sigstop_prefill",
    "never_peer", "bootstrap_down", "kill_decode", "kill_prefill"])
def test_trtllm_fault(trt_farm, fault):
    row = _trt_case(trt_farm, fault)
    _record(row)
    _raise_gap(row)


def test_trtllm_cost_gate_recompute_with_prefill_gone(trt_farm):
    """Decode-side recompute fallback where configured: the matrix's decode server has the
    cost gate on (tcp preset, the model's config, break-even about 52 tokens). A 30-token
    prompt is computed on the decode (its prefill room declined and released); a prompt
    above break-even whose prefill is gone (nothing listens at its endpoint any more) fails
    its load within the peer timeout and falls back to recompute (``on_failure``). Both are
    computed with the model (KV equal to transformers', tokens generate()'s), every block
    is back."""
    from kvbridge.demo.models import random_prompt
    from tests.helpers.trtllm_servers import check_clean

    farm = trt_farm
    t_case = time.monotonic()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        gone = f"tcp://127.0.0.1:{sk.getsockname()[1]}"
    short = farm.start(prompt=random_prompt(30, seed=next(_SEEDS)))
    t0 = time.monotonic()
    far = farm.start(send=False, handle=lambda room: Handle("recv", room, endpoints=(gone,)), n=SHORT)
    # each checked as soon as it is answered: a finished request's blocks go to the next one
    _until([farm.pre, farm.dec], lambda: short.drid in farm.dec.responses)
    farm.computed_right(short, what="decode KV of the prompt below break-even")
    seen = _until([farm.pre, farm.dec], lambda: _answered(farm.dec, far.drid) and farm.pre.drained())
    farm.computed_right(far, what="decode KV after the failed load")
    d = check_clean(farm.dec)[0]
    assert d["fallbacks"][short.drid]["reason"].startswith("recompute: below break-even"), d["fallbacks"]
    assert far.drid not in d["fallbacks"]  # above break-even: the gate moved it
    assert d["declined"][short.drid]["room"] == short.room
    ld = d["finished_loads"][far.drid]
    assert ld["verdict"] == "recompute", ld
    side = _side("decode (prefill gone)", _trt_state(ld), ld["reason"], _ended(ld, seen) - t0,
                 farm.plugin["peer_timeout_s"], ("unreachable", "no answer", "failed the room"))
    sv = check_clean(farm.pre)[0]["finished_saves"][short.prid]  # the declined room's blocks came back
    assert _trt_state(sv) == "DECLINED", sv
    assert not farm.switch.double_releases(t_case)
    _record({"plugin": "trtllm", "fault": "gate_recompute", "ok": True, "sides": [side], "double_releases": 0,
             "blocks_ok": True, "next_ok": True, "recompute_ok": True,
             "note": f"30-token prompt below break-even computed on the decode (room declined); {SHORT}-token prompt "
                     "with its prefill gone recomputed after the failed load", "case_s": round(time.monotonic() - t_case, 2)})
