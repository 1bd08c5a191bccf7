"""The release rule: a decode's blocks go back to its engine only when no sender can still
write into them, and a prefill's source blocks only when no piece can still read them.

Prefill and decode run in separate OS processes (tests/helpers/release_peers.py) over
Mooncake TCP with the transport as shipped (4 MiB pieces, up to 1024 in flight per peer):
a direct plan of about a thousand segments, and a staged send of 16 MiB parts through the
sender's ring. Each window is forced, not raced: the parent's ``FaultSwitch(hold=True)``
holds the second piece of the sender's write *past kvbridge's write guard* (the first is
already in the transfer engine), the fault is injected, the decode is seen to report
Failed, and only then is the held piece let go. It lands; the question is where. The
decode fills every block the moment its "engine" gets it back with a poison pattern, and
after the sender has settled (or died) not one poisoned byte may have changed.

Faults: decode abort, prefill abort (with a write timeout shorter than the hold, so a
sender that gave up waiting for its own pieces would show), the decode's deadline, a
prefill stopped (SIGSTOP) past the peer timeout then resumed (what a partition that heals
before Mooncake's own timeout looks like to both sides), a replayed request that came
first and is being served when the genuine one is refused (``conflict``), and a prefill
killed (its process gone: the only proof that needs no answer from it).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time

import pytest

from tests.helpers import release_peers
from tests.helpers.kvhelpers import FaultSwitch, PipePeer, wait_until

pytestmark = [pytest.mark.timeout(240)]

PEER_TIMEOUT_S = 1.5
CFG = dict(deadline_s=30.0, heartbeat_s=0.2, peer_timeout_s=PEER_TIMEOUT_S, quiesce_s=0.5, write_timeout_s=1.0)
# the transport as shipped: pieces and in-flight bound untouched, no delay; the second piece is held
SHIPPED = dict(piece_bytes=0, inflight=0, delay_s=0.0, started_at=2, hold_s=120.0)
NTOK = 2048  # 32 MiB of KV: 4 layers x K, V x 8 heads x 128 dims, bfloat16
PLANS = {"direct": "sglang", "staged_send": "trtllm"}  # plan -> the decode's engine (the sender may use only that plan)


def spec(engine: str, seed: int) -> dict:
    return dict(engine=engine, layers=4, total_heads=8, tp=1, rank=0, head_dim=128, dtype="bf16", tpb=16, blocks=384,
                seed=seed, mla=False)


class Pair:
    """A prefill and a decode process for one plan, restarted when a fault took one down."""

    def __init__(self, plan: str, switch: FaultSwitch):
        self.plan, self.switch = plan, switch
        self.pre = self.dec = None
        self.start()

    def _peer(self, main, engine, seed):
        return PipePeer(main, spec(engine, seed), dict(CFG, hooks=self.switch.hooks, kinds=[self.plan]))

    def start(self) -> None:
        if self.pre is None:
            self.pre = self._peer(release_peers.prefill_main, "sglang", 1)
        if self.dec is None:
            self.dec = self._peer(release_peers.decode_main, PLANS[self.plan], 2)

    def state(self, room: int) -> dict:
        return self.dec.call("state", room)[1]

    def close(self) -> None:
        for p in (self.pre, self.dec):
            if p is not None:
                p.stop()


@pytest.fixture(scope="module")
def switch():
    sw = FaultSwitch()
    yield sw
    sw.close()


@pytest.fixture(scope="module", params=list(PLANS))
def pair(request, switch):
    p = Pair(request.param, switch)
    yield p
    p.close()


_rooms = itertools.count(9000)


def _record(pair: Pair, fault: str, **row) -> None:
    """Keep the row for docs/reliability.md (``kvbridge report --only faults`` sets
    ``KVBRIDGE_RELIABILITY_DIR``): ``release.json`` there, one row per (plan, fault)."""
    out = os.environ.get("KVBRIDGE_RELIABILITY_DIR")
    if not out:
        return
    path = os.path.join(out, "release.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    rows = [r for r in rows if (r["plan"], r["fault"]) != (pair.plan, fault)] + [dict(row, plan=pair.plan, fault=fault)]
    with open(path, "w") as f:
        json.dump({"peer_timeout_s": PEER_TIMEOUT_S, "ntok": NTOK, "rows": rows}, f, indent=1)


def _failed(pair: Pair, room: int, timeout: float = 20.0) -> dict:
    wait_until(lambda: pair.state(room)["state"] in ("FAILED", "SUCCESS"), timeout,
               f"room {room}: the decode never reported Failed")
    st = pair.state(room)
    assert st["state"] == "FAILED", f"room {room}: the decode reports {st['state']}, not Failed"
    return st


def _window(pair: Pair, room: int, fault: str, inject, *, pull_opts: dict | None = None,
            must: tuple[str, ...] = ()) -> dict:
    """Serve and pull ``room`` with the sender's second piece held past its write guard,
    inject the fault, and check the release rule around it. Returns what was seen."""
    sw = pair.switch
    sw.on(SHIPPED, hold=True)
    pair.pre.call("serve", room, NTOK)
    pair.dec.call("pull", room, pair.pre.ready[1], NTOK, dict(pull_opts or {}))
    wait_until(sw.started, 30, "the transfer never got under way")
    pieces, nbytes, held = pair.pre.call("inflight")[1:]
    t_fault = time.monotonic()
    resume = inject()
    st = _failed(pair, room)
    t_failed = time.monotonic()
    assert not must or any(m in st["reason"] for m in must), st["reason"]
    # a piece is held past the sender's write guard: the decode's blocks must not be back
    assert st["released_at"] is None, f"room {room}: blocks released {st['released_at'] - t_fault:.2f} s after the " \
                                      "fault while a piece of the sender was still on its way"
    assert st["quarantined"] and st["gauge"] > 0, st
    assert any(q["room"] == room for q in st["quarantine"]), st["quarantine"]
    if resume is not None:
        resume()
    t_let_go = time.monotonic()
    sw.release()  # the held piece goes on to the engine and lands
    wait_until(lambda: pair.state(room)["released_at"] is not None, 30,
               f"room {room}: the quarantine never ended once the sender could answer")
    wait_until(lambda: pair.pre.call("poll", room)[1] == "FAILED" or pair.pre.call("poll", room)[1] == "SUCCESS", 30,
               f"room {room}: the prefill never settled")
    ok, bad = pair.dec.call("poisoned", room)[1:]
    assert ok, (f"room {room}: bytes landed in blocks {bad} after the decode's engine had them back; "
                f"events: {[(round(e['t'] - t_fault, 3), e['pid'], e['msg'][:150]) for e in sw.events(t_fault)]}")
    end = pair.state(room)
    _record(pair, fault, engine_pieces=pieces, engine_bytes=nbytes, held_bytes=held, reason=st["reason"][:120],
            failed_s=round(t_failed - t_fault, 3), quarantined_blocks=next(q["blocks"] for q in st["quarantine"]
                                                                           if q["room"] == room),
            quarantined_s=round(end["released_at"] - t_failed, 3), let_go_s=round(end["released_at"] - t_let_go, 3),
            poison_ok=ok)
    return end


def test_decode_abort_releases_only_when_the_sender_is_quiet(pair):
    room = next(_rooms)
    st = _window(pair, room, "abort_decode", lambda: pair.dec.call("abort", room) and None, must=("aborted",))
    assert not st["quarantined"] and st["gauge"] == 0, st


def test_prefill_abort_keeps_source_blocks_until_settled(pair):
    """The prefill aborts while a piece is held; its write timeout (1 s) passes twice over
    before the piece goes: the prefill's engine must not see Failed (it would free the
    pages the piece reads), nor the decode's get its blocks back."""
    room = next(_rooms)

    def inject():
        pair.pre.call("abort", room)
        time.sleep(2 * CFG["write_timeout_s"] + 0.5)  # past the point where a timer would have given up
        seen, released = pair.pre.call("poll", room)[1:]
        assert seen != "FAILED" and released is None, (seen, released)

    _window(pair, room, "abort_prefill", inject, must=("aborted",))
    seen, released = pair.pre.call("poll", room)[1:]
    assert seen == "FAILED" and released is not None


def test_deadline_releases_only_when_the_sender_is_quiet(pair):
    room = next(_rooms)
    _window(pair, room, "deadline", lambda: None, pull_opts={"deadline_s": 1.0}, must=("deadline",))


def test_stopped_prefill_resumes_into_quarantined_blocks(pair):
    """The prefill is stopped (SIGSTOP) holding a piece past its guard; the decode gives it
    up after the peer timeout, reports Failed and keeps the blocks; the prefill resumes,
    its piece lands in those quarantined blocks, it hears the abort, settles and says so."""
    room = next(_rooms)
    pid = pair.pre.ready[2]

    def inject():
        os.kill(pid, signal.SIGSTOP)
        return lambda: os.kill(pid, signal.SIGCONT)

    _window(pair, room, "sigstop_prefill", inject, must=("unreachable",))


def test_replayed_request_served_first_keeps_the_genuine_blocks(pair):
    """A copy of the decode's request (same session, same blocks) from another endpoint
    comes first and is being written; the genuine request is refused (``conflict``). The
    refusal is not proof: the decode keeps its blocks until the sender settled the room."""
    room = next(_rooms)
    sw = pair.switch
    sw.on(SHIPPED, hold=True)
    pair.pre.call("serve", room, NTOK)
    pair.dec.call("pull", room, pair.pre.ready[1], NTOK, {"replay_first": sw.started_path})
    pieces, nbytes, held = pair.pre.call("inflight")[1:]
    st = _failed(pair, room)
    t_failed = time.monotonic()
    assert "already pulled" in st["reason"], st["reason"]
    assert st["released_at"] is None and st["quarantined"], st
    t_let_go = time.monotonic()
    sw.release()
    wait_until(lambda: pair.state(room)["released_at"] is not None, 30, f"room {room}: never released")
    ok, bad = pair.dec.call("poisoned", room)[1:]
    assert ok, f"room {room}: the replay's bytes landed in blocks {bad} after the decode's engine had them back"
    _record(pair, "conflict", engine_pieces=pieces, engine_bytes=nbytes, held_bytes=held, reason=st["reason"][:120],
            quarantined_blocks=next(q["blocks"] for q in st["quarantine"] if q["room"] == room),
            quarantined_s=round(pair.state(room)["released_at"] - t_failed, 3),
            let_go_s=round(pair.state(room)["released_at"] - t_let_go, 3), poison_ok=ok)


def test_killed_prefill_is_proof_its_process_is_gone(pair):
    """The prefill is killed holding a piece: its control connection closes, nobody answers
    a probe, and the decode's blocks go back without waiting for the peer timeout."""
    room = next(_rooms)
    sw = pair.switch
    sw.on(SHIPPED, hold=True)
    pair.pre.call("serve", room, NTOK)
    pair.dec.call("pull", room, pair.pre.ready[1], NTOK, {})
    wait_until(sw.started, 30, "the transfer never got under way")
    pieces, nbytes, held = pair.pre.call("inflight")[1:]
    t_kill = time.monotonic()
    os.kill(pair.pre.ready[2], signal.SIGKILL)
    wait_until(lambda: pair.state(room)["released_at"] is not None, 20, f"room {room}: never released")
    st = pair.state(room)
    assert "process gone" in st["reason"], st["reason"]
    assert st["released_at"] - t_kill < PEER_TIMEOUT_S + CFG["heartbeat_s"] + 1.0, st
    sw.release()
    ok, bad = pair.dec.call("poisoned", room)[1:]
    assert ok, bad
    _record(pair, "kill_prefill", engine_pieces=pieces, engine_bytes=nbytes, held_bytes=held, reason=st["reason"][:120],
            released_s=round(st["released_at"] - t_kill, 3), poison_ok=ok)
    pair.pre.stop()
    pair.pre = None
    pair.start()  # a restarted prefill: the next request is served
    room = next(_rooms)
    sw.off()
    pair.pre.call("serve", room, NTOK)
    pair.dec.call("pull", room, pair.pre.ready[1], NTOK, {})
    wait_until(lambda: pair.state(room)["state"] == "SUCCESS", 30, "the next request was not served")


def test_write_guard_refuses_a_plan_outside_the_room(pair):
    """The write guard at its call site: a planner that (wrongly) aims a direct plan one
    block further is caught before any piece goes: the room fails naming the guard, and
    not one byte outside the room's blocks changes in the decode's pool."""
    if pair.plan != "direct":
        pytest.skip("the skewed planner shifts a direct plan's wire (a staged send writes from its chunks)")
    pair.switch.off()
    pair.pre.call("skew_plans")
    room = next(_rooms)
    try:
        pair.pre.call("serve", room, NTOK)
        pair.dec.call("pull", room, pair.pre.ready[1], NTOK, {"watch_outside": True})
        st = _failed(pair, room)
        assert "outside" in st["reason"], st["reason"]
        wait_until(lambda: pair.state(room)["released_at"] is not None, 30, f"room {room}: never released")
        assert pair.dec.call("outside", room)[1] == [], "bytes landed outside the room's blocks"
    finally:
        pair.pre.stop()  # its planner stays skewed: a fresh prefill for what follows
        pair.pre = None
        pair.start()
