"""Integrity: what lands in a decode's blocks is what the prefill moved, or the room fails.

A real sender and receiver in separate processes over Mooncake TCP with the transport as
shipped (tests/helpers/release_peers.py, SGLang page 16 -> TensorRT-LLM block 16: a
staged send; SGLang -> SGLang: a direct plan; and the staged send with the decode asking
for the torch reduction, the digest a GPU's pool is taken by), the decode's ``integrity``
on. Each corruption is made deterministically, not raced:

- a byte flipped in flight: the sender's first write batch sends its first piece from a
  copy with one byte flipped (``FaultSwitch`` mode ``flip``), so the pool the sender
  digests is right and what lands is not;
- a sender writing the right byte count into the wrong blocks: its planner sees the
  first two destination blocks swapped (every byte stays inside the room's blocks, so
  the write guard cannot see it);
- a stale write landing in a reused block: the poison pattern written into the room's
  second block after its own bytes landed and before it is admitted, as a late write of
  an earlier room would.

Each fails the room with ``code="integrity"`` and a reason naming where the content first
differs, is counted, and the next room through the same pair succeeds. With integrity off,
the first two corruptions go unseen: the room succeeds with wrong KV (which is why the
digest exists).
"""

from __future__ import annotations

import itertools
import re

import pytest

from kvbridge.layout import DIGEST_ALGORITHM, TORCH_DIGEST_ALGORITHM
from tests.helpers import release_peers
from tests.helpers.kvhelpers import FaultSwitch, PipePeer, wait_until

pytestmark = [pytest.mark.timeout(240)]

CFG = dict(deadline_s=30.0, heartbeat_s=0.2, peer_timeout_s=3.0, quiesce_s=0.5)
NTOK = 1024
FLIP = dict(piece_bytes=0, inflight=0, delay_s=0.0, started_at=1, flip=True)
_rooms = itertools.count(7000)


def spec(engine: str, seed: int) -> dict:
    return dict(engine=engine, layers=4, total_heads=8, tp=1, rank=0, head_dim=128, dtype="bf16", tpb=16, blocks=256,
                seed=seed, mla=False)


@pytest.fixture(scope="module")
def switch():
    sw = FaultSwitch()
    yield sw
    sw.close()


def _pair(switch, plan: str, integrity: str, digest: str = "auto"):
    pre = PipePeer(release_peers.prefill_main, spec("sglang", 1), dict(CFG, hooks=switch.hooks, kinds=[plan]))
    dec = PipePeer(release_peers.decode_main, spec("trtllm" if plan == "staged_send" else "sglang", 2),
                   dict(CFG, hooks=switch.hooks, kinds=[plan], integrity=integrity, integrity_hash=digest))
    return pre, dec


# (plan, the decode's integrity_hash, the algorithm both sides then use): host pools digest with
# XXH3-64 by default; "torch" asks for the reduction a GPU's pool is digested by, here on the host
PAIRS = {"staged_send": ("staged_send", "auto", DIGEST_ALGORITHM), "direct": ("direct", "auto", DIGEST_ALGORITHM),
         "staged_send, torch": ("staged_send", "torch", TORCH_DIGEST_ALGORITHM)}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, switch):
    plan, digest, algorithm = PAIRS[request.param]
    pre, dec = _pair(switch, plan, "on", digest)
    yield request.param, pre, dec, algorithm
    pre.stop()
    dec.stop()


def _end(pre, dec, room: int, opts: dict | None = None) -> dict:
    pre.call("serve", room, NTOK)
    dec.call("pull", room, pre.ready[1], NTOK, dict(opts or {}))
    wait_until(lambda: dec.call("state", room)[1]["state"] in ("FAILED", "SUCCESS"), 30, f"room {room} never ended")
    return dec.call("state", room)[1]


def _verified(pre, dec, algorithm: str) -> None:
    """The next room through the pair succeeds, compared by the algorithm its receiver asked for."""
    st = _end(pre, dec, next(_rooms))
    assert st["state"] == "SUCCESS" and st["digest"] == algorithm, st


def _integrity_failure(st: dict) -> str:
    assert st["state"] == "FAILED", st
    assert "content digest mismatch" in st["reason"], st["reason"]
    return st["reason"]


def test_a_byte_flipped_in_flight_fails_the_room(pair, switch):
    plan, pre, dec, algorithm = pair
    before = dec.call("integrity")[1]
    switch.on(FLIP)
    try:
        why = _integrity_failure(_end(pre, dec, next(_rooms)))
    finally:
        switch.off()
    after = dec.call("integrity")[1]
    assert after.get("mismatch", 0) == before.get("mismatch", 0) + 1, (before, after)
    assert re.search(r"first at layer \d+ [KV] head \d+ tokens \[\d+, \d+\) \(1 of \d+ units", why), why
    _verified(pre, dec, algorithm)
    print(f"[{plan}] flipped byte: {why}")


def test_the_right_bytes_in_the_wrong_blocks_fail_the_room(pair):
    plan, pre, dec, algorithm = pair
    pre.call("swap_blocks")
    try:
        why = _integrity_failure(_end(pre, dec, next(_rooms)))
    finally:
        pre.call("unswap")
    assert "tokens [0, " in why, why  # the first block's tokens are the first to differ
    _verified(pre, dec, algorithm)
    print(f"[{plan}] swapped blocks: {why}")


def test_a_stale_write_into_a_reused_block_fails_the_room(pair):
    plan, pre, dec, algorithm = pair
    dec.call("stale_before_check")
    why = _integrity_failure(_end(pre, dec, next(_rooms)))
    assert "first at layer 0 K head 0 tokens [" in why, why
    _verified(pre, dec, algorithm)
    print(f"[{plan}] stale write: {why}")


def test_without_integrity_the_corruption_goes_unseen(switch):
    """The same corruptions with the decode's integrity off: each room succeeds, wrong."""
    pre, dec = _pair(switch, "staged_send", "off")
    try:
        switch.on(FLIP)
        try:
            assert _end(pre, dec, next(_rooms))["state"] == "SUCCESS"
        finally:
            switch.off()
        pre.call("swap_blocks")
        try:
            assert _end(pre, dec, next(_rooms))["state"] == "SUCCESS"
        finally:
            pre.call("unswap")
        assert dec.call("integrity")[1].get("verified", 0) == 0
    finally:
        pre.stop()
        dec.stop()


def test_a_trtllm_decode_recomputes_a_room_whose_content_differs(tiny_llama_dir):
    """The plugin's failure policy on a mismatch, with TensorRT-LLM stand-in servers
    (prefill ``main``, decode ``1.2``, the session's ``KVBRIDGE_INTEGRITY=on``,
    ``on_failure`` recompute): one byte of the prefill's staged write flipped in flight.
    The decode's load fails naming the mismatch, the decode recomputes the prompt (its
    tokens and KV equal to transformers'), both servers get every block back, and the
    next handoff loads byte-exact."""
    from tests.faults.test_faults import TRTServers, _answered, _until
    from tests.helpers.trtllm_servers import check_clean

    farm = TRTServers(tiny_llama_dir)
    try:
        farm.switch.on(FLIP)
        h = farm.start()
        _until([farm.pre, farm.dec], lambda: _answered(farm.dec, h.drid) and farm.pre.drained())
        farm.switch.off()
        ld = farm.dec.state()["finished_loads"][h.drid]
        assert ld["verdict"] == "recompute" and "content digest mismatch" in ld["reason"], (ld, ld.get("record"))
        assert farm.computed_right(h)
        check_clean(farm.pre)
        check_clean(farm.dec)
        farm.request_ok()
        print(f"[trtllm] recomputed after: {ld['reason']}")
    finally:
        farm.close()
