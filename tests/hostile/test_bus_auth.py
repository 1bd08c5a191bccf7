"""The TensorRT-LLM bus (rank 0's scheduler socket) against strangers and floods.

- raw sockets: a forged LoadResult(ok=True) for a load in flight, unsealed or sealed with
  another key, changes nothing; the honest (sealed) result beside it decides the load;
  a replayed sealed frame is refused; a key being rotated in (``accepted_secrets``) is
  taken;
- peer-keyed maps stay at their caps (``Who`` waiters, evictions counted), an Endpoints
  nobody asked for is ignored, a Hello naming a rank the server does not have is ignored;
- an Expect flood (4096 on one prompt + 4096 on distinct prompts) is capped per prompt
  (the rest refused by name) and all of it expires; a day's TTL is clamped to an hour.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import zmq

from kvbridge.adapters.trtllm import BridgeConfig, Handle, announce
from kvbridge.adapters.trtllm import bus as B
from kvbridge.adapters.trtllm import scheduler as S
from kvbridge.common.auth import Keyring
from kvbridge.common.rooms import default_metrics
from tests.helpers.kvhelpers import wait_until

pytestmark = [pytest.mark.timeout(120)]

SECRET = os.environ["KVBRIDGE_SECRET"]  # the session's (tests/conftest.py)
OTHER = "another-deployment-" + "z" * 24
OLD = "the-old-key-being-rotated-out-0123"


def _refused(code: str) -> float:
    m = default_metrics()
    return m.child(m.auth_refused, "bus", code)._value.get()


def _evicted(name: str) -> float:
    m = default_metrics()
    return m.child(m.evictions, name)._value.get()



@pytest.fixture
def sched():
    s = S.KVBridgeConnectorScheduler(SimpleNamespace(model=None),
                                     config=BridgeConfig(secret=SECRET, accepted_secrets=OLD))
    yield s
    s.close()


@pytest.fixture
def dealer(sched):
    """A raw socket on the bus, taken as rank 0's worker (as its Hello would make it)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"rank-0-worker")
    sock.connect(sched.endpoint)
    with sched._lock:
        sched._workers[0] = b"rank-0-worker".hex()
    yield sock
    sock.close(0)


def test_forged_load_result_is_refused_and_the_honest_one_decides(sched, dealer):
    """A load in flight on 1 rank: LoadResult(ok=True) unsealed, sealed with another key,
    or sealed for another channel does not decide it; the honest sealed failure does,
    and replaying it is refused."""
    load = S._Load(B.Load(req=7, room=70, blocks=[1], start=0, stop=4, endpoints=["tcp://127.0.0.1:1"],
                          on_failure="fail"))
    with sched._lock:
        sched._loads[7] = load
    before = {c: _refused(c) for c in ("unsigned", "unknown_key", "bad_tag", "replay")}
    forged = B.LoadResult(req=7, rank=0, ok=True)
    dealer.send(B.encode(forged))
    dealer.send(B.pack(forged, Keyring(OTHER)))
    dealer.send(Keyring(SECRET).seal(B.encode(forged), b"control"))  # right key, wrong channel
    wait_until(lambda: _refused("bad_tag") >= before["bad_tag"] + 1, 10.0, "bad_tag refusal counted")
    assert _refused("unsigned") == before["unsigned"] + 1 and _refused("unknown_key") == before["unknown_key"] + 1
    assert load.verdict == "" and not load.results
    # sealed with the secret, yet not from rank 0's worker (another connection; a rank the server does not have)
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(sched.endpoint)
    try:
        stranger.send(B.pack(forged, Keyring(SECRET)))
        dealer.send(B.pack(B.LoadResult(req=7, rank=1, ok=True), Keyring(SECRET)))
        wait_until(lambda: "loadresult" in sched._bad_bus._last, 10.0, "a LoadResult from no rank's worker refused")
        assert load.verdict == "" and not load.results  # the rank 1 one: ordered before the honest one below
    finally:
        stranger.close(0)
    honest = B.pack(B.LoadResult(req=7, rank=0, ok=False, reason="pull failed"), Keyring(SECRET))
    dealer.send(honest)
    wait_until(lambda: load.verdict == "fail", 10.0, 'load.verdict == "fail"')
    dealer.send(honest)  # replayed
    wait_until(lambda: _refused("replay") >= before["replay"] + 1, 10.0, "replay refusal counted")
    assert load.results == {0: (False, "pull failed")}


def test_a_rotated_key_is_accepted_an_unknown_one_refused(sched):
    """The server signs with its secret and accepts ``accepted_secrets`` too: a router
    still on the old key announces; one on a key nobody configured is refused by name."""
    # mid-rotation: the router still signs with the old key and accepts the new one
    announce(sched.endpoint, [9, 9, 9], Handle("send", 99), keyring=Keyring(OLD, [SECRET]))
    assert sched._take_expected(S.prompt_key([9, 9, 9]), "send") == Handle("send", 99)
    before = _refused("unknown_key")
    with pytest.raises(Exception, match="did not answer"):
        announce(sched.endpoint, [8, 8], Handle("send", 98), keyring=Keyring(OTHER), timeout_s=0.5)
    assert _refused("unknown_key") == before + 1


def test_peer_keyed_maps_stay_at_their_caps(sched, monkeypatch):
    """Who waiters are capped (evictions counted); an Endpoints nobody asked for, and a
    Hello for a rank this one-rank server does not have, change nothing."""
    ring = Keyring(SECRET)
    cap = S._MAX_PEERS
    before = _evicted("trtllm_who_waiting")
    for i in range(cap + 200):
        sched._on_bus(f"peer-{i}", B.pack(B.Who(), ring))  # no rank joined: nobody is answered yet
    assert len(sched._who_waiting) == cap
    assert _evicted("trtllm_who_waiting") == before + 200
    sched._on_bus("tcp://10.9.9.9:1", B.pack(B.Endpoints(endpoints=["tcp://attacker:1"]), ring))
    assert "tcp://10.9.9.9:1" not in sched._discovered
    sched._on_bus("peer-x", B.pack(B.Hello(rank=5, endpoint="tcp://attacker:2"), ring))
    assert not sched._endpoints and not sched._workers
    # discovery: at most _MAX_PEERS prefills at once; an order past the cap fails at once
    monkeypatch.setattr(S, "_MAX_PEERS", 3)
    sent = []
    monkeypatch.setattr(sched.bus, "send", lambda peer, payload: sent.append(peer))
    for i in range(5):
        req = 100 + i
        order = B.Load(req=req, room=req, blocks=[1], start=0, stop=4, endpoints=[], on_failure="fail")
        with sched._lock:
            sched._loads[req] = S._Load(order)
        sched._route(order, Handle("recv", req, prefill=f"tcp://10.0.0.{i}:1"))
    assert len(sched._discovering) == 3 and len(sched._parked) == 3
    assert [sched._loads[100 + i].verdict for i in range(5)] == ["", "", "", "fail", "fail"]


def test_expect_flood_is_capped_and_expires(sched, dealer):
    """4096 sealed Expects for one prompt + 4096 for distinct prompts, 3 s TTL: the one
    prompt holds at most its cap (the rest refused by name) and all of them expire (the
    heap's own cost: tests/trtllm/test_trtllm_unit.py)."""
    ring = Keyring(SECRET)
    one = "a" * 32
    h = Handle("send", 1)
    for i in range(4096):
        dealer.send(B.pack(B.Expect(key=one, handle=h, ttl_s=3.0, nonce=i), ring))
        dealer.send(B.pack(B.Expect(key=f"{i:032x}", handle=h, ttl_s=3.0, nonce=10_000 + i), ring))
    answers = {"ok": 0, "refused": 0}
    reasons = set()
    while answers["ok"] + answers["refused"] < 8192 and dealer.poll(5000):
        msg = B.unpack(dealer.recv(), ring)
        answers["ok" if msg.ok else "refused"] += 1
        if not msg.ok:
            reasons.add(msg.reason)
    assert answers["ok"] + answers["refused"] == 8192
    assert answers["refused"] > 0, answers
    assert any("with this prompt" in r for r in reasons), reasons
    # every distinct prompt held; the one prompt never more than its cap (more than the cap
    # in all only where some expired during the flood on a slow machine)
    assert answers["ok"] >= S._MAX_EXPECTED_PER_KEY + 4096 and answers["refused"] <= 4096 - S._MAX_EXPECTED_PER_KEY
    assert sum(e.alive for e in sched._expected.get(one, ())) == S._MAX_EXPECTED_PER_KEY
    wait_until(lambda: sched._n_expected == 0 and not sched._expected, 20.0, "_n_expected == 0 and not _expected")


def test_announce_ttl_is_clamped(sched):
    """A router asking a day's TTL gets at most _MAX_EXPECT_TTL_S."""
    announce(sched.endpoint, [3, 1, 4], Handle("send", 5), ttl_s=86400.0)
    with sched._lock:
        (e,) = sched._expected[S.prompt_key([3, 1, 4])]
        expires = e.expires
    assert expires - time.monotonic() <= S._MAX_EXPECT_TTL_S + 1
