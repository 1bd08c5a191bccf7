"""Handoffs between prefill and decode in SEPARATE OS processes over Mooncake TCP on 127.0.0.1.

Pools are in SGLang's and TensorRT-LLM's exact formats; the decode process verifies
every moved byte against the prefill pool (rebuilt from its seed) and that nothing
else in its pool changed; block free-counts are checked on both sides.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.helpers import handoff_peers
from tests.helpers.kvhelpers import FaultSwitch
from tests.helpers.kvhelpers import PipePeer

CFG = dict(deadline_s=20.0, heartbeat_s=0.2, peer_timeout_s=2.0, quiesce_s=1.0, chunk_bytes=1 << 20)
SECRET = "handoff-test-secret-0123456789abcdef"


class Peer(PipePeer):
    """A handoff peer process (tests/helpers/handoff_peers.py) driven over a Pipe."""

    def __init__(self, role: str, spec: dict, cfg: dict | None = None):
        target = handoff_peers.prefill_main if role == "prefill" else handoff_peers.decode_main
        super().__init__(target, spec, {**CFG, **(cfg or {})})
        assert self.ready[0] == "ready", self.ready
        self.endpoint_or_session, self.free0 = self.ready[1], self.ready[2]


def spec(engine, *, layers=2, total_heads=4, tp=1, rank=0, head_dim=32, dtype="bf16", tpb=16, blocks=64, seed=1, mla=False,
         isa="vec"):
    return dict(engine=engine, layers=layers, total_heads=total_heads, tp=tp, rank=rank, head_dim=head_dim,
                dtype=dtype, tpb=tpb, blocks=blocks, seed=seed, mla=mla, isa=isa)


@pytest.fixture
def peers():
    started = []

    def make(role, s, cfg=None):
        p = Peer(role, s, cfg)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def pull(decode, room, prefills, start, stop, sources, receivers=1, **opts):
    return decode.call_raw("pull", room, [p.endpoint_or_session for p in prefills], start, stop, receivers, sources, opts,
                           timeout=90)[1]


def check_ok(res, prefill_waits):
    assert res["state"] == "SUCCESS", res["reason"]
    assert res["bytes_ok"], "decode pool does not hold the prefill's K/V"
    assert res["untouched_ok"], "bytes outside the request changed in the decode pool"
    for w in prefill_waits:
        assert w[1] == "SUCCESS", w[2]


@pytest.mark.parametrize(
    "src_engine, src_tpb, dst_engine, dst_tpb",
    [("sglang", 16, "trtllm", 32), ("trtllm", 32, "sglang", 16), ("sglang", 1, "trtllm", 64), ("trtllm", 64, "sglang", 64)],
)
def test_cross_format_handoff_chunked_with_prefix(peers, src_engine, src_tpb, dst_engine, dst_tpb):
    """Chunked prefill sends, a prefix the receiver already holds, both directions."""
    ps = spec(src_engine, tpb=src_tpb, blocks=400 // src_tpb + 4, seed=3)
    ds = spec(dst_engine, tpb=dst_tpb, blocks=400 // dst_tpb + 8, seed=4)
    pre, dec = peers("prefill", ps), peers("decode", ds)
    room, n = 11, 300
    blocks = pre.call_raw("serve", room, n, 96)[1]  # 4 prefill chunks
    res = pull(dec, room, [pre], 40, n, [(ps, blocks)])  # decode holds tokens 0..40 already
    w = pre.call_raw("wait", room, 30)
    check_ok(res, [w])
    assert res["written_bytes"] == 2 * 2 * (n - 40) * 4 * 32 * 2
    assert res["record"]["bytes"] == res["written_bytes"]
    assert res["aux"] == {"output_ids": [room], "cached_tokens": 0}  # the first token rides with Done
    # blocks: prefill got its blocks back, decode kept none after "finishing" the request
    assert w[4] == pre.free0 and w[5] == 0
    assert res["free"] == dec.free0


def test_staged_plan_overlapped_and_scattered_destination(peers):
    """NHD -> HND at a size where staging wins; decode blocks scattered over its pool."""
    ps = spec("sglang", layers=4, total_heads=8, head_dim=64, tpb=64, blocks=20, seed=5)
    ds = spec("trtllm", layers=4, total_heads=8, head_dim=64, tpb=32, blocks=80, seed=6)
    pre, dec = peers("prefill", ps, {"chunk_bytes": 2 << 20}), peers("decode", ds)
    blocks = pre.call_raw("serve", 5, 1024, 1024)[1]
    res = pull(dec, 5, [pre], 0, 1024, [(ps, blocks)], scattered=True)
    w = pre.call_raw("wait", 5, 30)
    check_ok(res, [w])
    assert res["record"]["plan"] == "staged_send"
    assert w[3]["chunks"] > 1 and w[3]["repack_s"] > 0  # gathered in chunks through the ring


def test_staged_send_parts_capped_at_a_quarter_of_the_plan(peers):
    """An 8 MiB staged send with parts from 1 MiB up to 8 MiB goes as 1, 2, 2, 2, 1 MiB: no
    part over a quarter of the plan, so the last gather overlaps earlier writes (doubling
    alone would give 1, 2, 4, 1 MiB). Every byte verified."""
    ps = spec("sglang", layers=4, total_heads=8, head_dim=64, tpb=64, blocks=20, seed=5)
    ds = spec("trtllm", layers=4, total_heads=8, head_dim=64, tpb=32, blocks=80, seed=6)
    cfg = {"chunk_bytes": 16 << 20, "first_part_bytes": 1 << 20, "part_bytes": 8 << 20, "prestage_slots": 0}
    pre, dec = peers("prefill", ps, cfg), peers("decode", ds)
    blocks = pre.call_raw("serve", 5, 1024, 1024)[1]  # 4 layers x K,V x 1024 tokens x 8 heads x 128 B = 8 MiB
    res = pull(dec, 5, [pre], 0, 1024, [(ps, blocks)], scattered=True)
    w = pre.call_raw("wait", 5, 30)
    check_ok(res, [w])
    assert res["record"]["plan"] == "staged_send"
    assert w[3]["bytes"] == 8 << 20 and w[3]["chunks"] == 5, w[3]


def test_first_part_gathered_before_the_request(peers):
    """TensorRT-LLM's order (the prefill is done before the decode side asks): the sender
    gathers a room's first part for the decode layout it served last. A request of the
    usual shape (all tokens, ascending blocks) sends it first, also to another decode
    process whose pool has the same geometry; any other is served the usual way. Every
    byte verified; every prestage slot comes back, also from a room aborted before its
    request."""
    ps = spec("sglang", layers=4, total_heads=8, head_dim=64, tpb=64, blocks=40, seed=5)
    ds = spec("trtllm", layers=4, total_heads=8, head_dim=64, tpb=32, blocks=200, seed=6)
    cfg = {"chunk_bytes": 2 << 20, "first_part_bytes": 64 << 10, "prestage_bytes": 256 << 10, "prestage_slots": 2}
    pre, dec = peers("prefill", ps, cfg), peers("decode", ds, cfg)
    n = 1024  # 8 MiB, 16 prefill pages, 32 decode blocks

    def prestage_taken():  # the sender took a slot for the room just served
        end = time.monotonic() + 10
        while pre.call_raw("prestage")[1] == 2:
            assert time.monotonic() < end, "no room was prestaged"
            time.sleep(0.005)

    def handoff(room, start=0, descending=False, prestaged=True, to=dec):
        blocks = pre.call_raw("serve", room, n, n)[1]
        if prestaged:
            prestage_taken()
        res = pull(to, room, [pre], start, n, [(ps, blocks)], scattered=True, descending=descending)
        w = pre.call_raw("wait", room, 30)
        check_ok(res, [w])
        assert res["record"]["plan"] == "staged_send"
        assert w[4] == pre.free0 and res["free"] == to.free0
        return pre.call_raw("prestage")[1:]

    assert handoff(1, prestaged=False) == (2, 0, 0)  # nothing served yet: no layout to prestage for
    assert handoff(2) == (2, 1, 0)  # ascending (every other) blocks: used
    assert handoff(3, descending=True) == (2, 1, 1)  # blocks in descending order: given up
    assert handoff(4, start=64) == (2, 1, 2)  # the decode side holds a prefix: given up
    assert handoff(5, prestaged=False) == (2, 1, 2)  # the last request had a prefix: not prestaged
    other = peers("decode", {**ds, "seed": 9}, cfg)  # another decode process, its pool elsewhere in memory
    assert handoff(7, to=other) == (2, 2, 2)  # prestaged for `dec`'s layout, used by `other`'s request
    pre.call_raw("serve", 6, n, n)
    prestage_taken()
    pre.call_raw("abort", 6)
    w = pre.call_raw("wait", 6, 30)
    assert w[1] == "FAILED" and w[4] == pre.free0 and w[5] == 0
    end = time.monotonic() + 10
    while pre.call_raw("prestage")[1:] != (2, 2, 3):
        assert time.monotonic() < end, f"the aborted room kept its prestage slot: {pre.call_raw('prestage')}"
        time.sleep(0.005)


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (2, 4)])
def test_tensor_parallel_head_maps(peers, src_tp, dst_tp):
    """Prefill TP != decode TP: each decode rank pulls exactly its heads from the right prefill ranks."""
    from kvbridge.layout import tp_head_slice

    total = 4
    pres = [peers("prefill", spec("sglang", total_heads=total, tp=src_tp, rank=r, tpb=16, blocks=24, seed=20 + r))
            for r in range(src_tp)]
    decs = [peers("decode", spec("trtllm", total_heads=total, tp=dst_tp, rank=r, tpb=32, blocks=24, seed=40 + r))
            for r in range(dst_tp)]
    room, n = 99, 200
    served = [p.call_raw("serve", room, n, 64)[1] for p in pres]
    receivers = max(1, dst_tp // src_tp)
    for d in decs:
        d0, dn = tp_head_slice(total, dst_tp, d.spec["rank"])
        mine = [i for i, p in enumerate(pres)
                if set(range(*(lambda a, b: (a, a + b))(*tp_head_slice(total, src_tp, p.spec["rank"])))) & set(range(d0, d0 + dn))]
        d.conn.send(("pull", room, [pres[i].endpoint_or_session for i in mine], 0, n, receivers,
                     [(pres[i].spec, served[i]) for i in mine], {}))
    results = [d.call_raw(timeout=90)[1] for d in decs]
    waits = [p.call_raw("wait", room, 30) for p in pres]
    for res in results:
        check_ok(res, waits)
        assert res["written_bytes"] == 2 * 2 * n * (total // dst_tp) * 32 * 2


def test_mla_and_fp8_pools(peers):
    ps = spec("sglang", total_heads=1, head_dim=96, dtype="fp8", tpb=1, blocks=130, seed=8, mla=True)
    ds = spec("trtllm", total_heads=1, head_dim=96, dtype="fp8", tpb=32, blocks=8, seed=9, mla=True)
    pre, dec = peers("prefill", ps), peers("decode", ds)
    blocks = pre.call_raw("serve", 1, 100, 50)[1]
    res = pull(dec, 1, [pre], 0, 100, [(ps, blocks)])
    check_ok(res, [pre.call_raw("wait", 1, 30)])


def test_fp8_scales_that_differ_fail_the_room_naming_both(peers):
    """Two fp8 pools whose scales differ for one (layer, V) hold bytes that decode to other
    numbers: the room fails on both sides naming the layer, the head and both scales, no
    byte lands, and every block goes back once. Equal scales (kept as float32 by one side)
    move byte-exact."""
    scales = np.ones((2, 2))
    other = scales.copy()
    other[1, 1] = 0.5  # layer 1, V
    ps = spec("sglang", dtype="fp8", seed=30) | {"kv_scales": scales * 0.25}
    pre = peers("prefill", ps, {"deadline_s": 3.0})
    bad = peers("decode", spec("trtllm", dtype="fp8", tpb=32, seed=31) | {"kv_scales": other * 0.25},
                {"deadline_s": 3.0})
    pre.call_raw("serve", 1, 64, 64)
    res = pull(bad, 1, [pre], 0, 64, [], verify=False)
    assert res["state"] == "FAILED" and "layer 1 V head 0: source 0.25 != destination 0.125" in res["reason"], res
    assert res["free"] == bad.free0, res
    w = pre.call_raw("wait", 1, 5)
    assert w[1] == "FAILED" and "scale" in w[2] and w[4] == pre.free0 and w[5] == 0, w

    same = np.float32(0.1) * scales  # float32's nearest to 0.1, against Python's 0.1
    pre2 = peers("prefill", spec("sglang", dtype="fp8", seed=32) | {"kv_scales": scales * 0.1})
    good = peers("decode", spec("trtllm", dtype="fp8", tpb=32, seed=33) | {"kv_scales": same.astype(np.float64)})
    blocks = pre2.call_raw("serve", 2, 64, 64)[1]
    res = pull(good, 2, [pre2], 0, 64, [(pre2.spec, blocks)])
    check_ok(res, [pre2.call_raw("wait", 2, 5)])


def test_failures_end_on_both_sides_with_reasons_and_free_blocks(peers):
    """Unknown room, incompatible layouts, another key, a peer that is gone."""
    ps = spec("sglang", seed=12)
    pre = peers("prefill", ps, {"secret": SECRET, "deadline_s": 2.0})
    good = peers("decode", spec("trtllm", tpb=32, seed=13), {"secret": SECRET, "deadline_s": 3.0})
    bad_auth = peers("decode", spec("trtllm", tpb=32, seed=14), {"secret": "wrong-" + SECRET, "deadline_s": 3.0})
    bad_geom = peers("decode", spec("trtllm", tpb=32, head_dim=64, seed=15), {"secret": SECRET, "deadline_s": 3.0})
    # a rotation rolled out in the wrong order: it signs with a key the prefill does not know yet, and accepts the old
    rotated = peers("decode", spec("trtllm", tpb=32, seed=16), {"secret": "rotated-" + SECRET, "deadline_s": 3.0,
                                                                "accepted_secrets": (SECRET,)})
    no_secret = peers("decode", spec("trtllm", tpb=32, seed=17), {"deadline_s": 3.0})

    # unknown room: no prefill registers it; both ends fail within the deadline, blocks freed
    t0 = time.monotonic()
    res = pull(good, 1001, [pre], 0, 64, [], verify=False)
    assert res["state"] == "FAILED" and "unknown room" in res["reason"], res["reason"]
    assert time.monotonic() - t0 < 3.0 + 1.5 and res["free"] == good.free0

    # another key: refused unread; the decode's room fails naming the key ids, before the prefill has the room.
    # Its blocks stay quarantined: a prefill that signs with a key this decode does not accept may
    # still accept this decode's (a rotation rolled out in the wrong order), so nothing proves it quiet
    # until its process is gone (below)
    res = pull(bad_auth, 1002, [pre], 0, 64, [], verify=False)
    assert res["state"] == "FAILED" and "unknown_key" in res["reason"] and "key id" in res["reason"], res["reason"]
    assert res["free"] < bad_auth.free0
    # the other half-way: the prefill's sealed refusal reaches it, so its room fails at once (not at the peer
    # timeout: the refusals would otherwise look like a live peer until the deadline), naming why
    t0 = time.monotonic()
    res = pull(rotated, 1005, [pre], 0, 64, [], verify=False)
    assert res["state"] == "FAILED" and "refuses our frames" in res["reason"] and "unknown_key" in res["reason"], res
    assert time.monotonic() - t0 < 1.5, time.monotonic() - t0
    # no secret on the decode at all: it cannot read the prefill's sealed refusal, but sees it is sealed, and says so
    res = pull(no_secret, 1006, [pre], 0, 64, [], verify=False)
    assert res["state"] == "FAILED" and "this side has none" in res["reason"], res["reason"]

    # incompatible layouts (head_dim 64 vs 32): both sides fail, naming the mismatch
    pre.call_raw("register", 1003, 64)
    res = pull(bad_geom, 1003, [pre], 0, 64, [], verify=False)
    assert res["state"] == "FAILED" and "head_dim" in res["reason"] and res["free"] == bad_geom.free0
    w = pre.call_raw("wait", 1003, 5)
    assert w[1] == "FAILED" and "head_dim" in w[2]
    assert w[4] == pre.free0 and w[5] == 0  # its blocks went back, once

    # the room a decode with another key asked for is served to the right decode peer, byte-exact
    blocks = pre.call_raw("serve", 1002, 64, 64)[1]
    res = pull(good, 1002, [pre], 0, 64, [(ps, blocks)])
    check_ok(res, [pre.call_raw("wait", 1002, 5)])
    assert pre.call_raw("free")[1:] == (pre.free0, 0)

    # the prefill peer is gone: the decode room fails within its timeout and frees its blocks
    pre.proc.kill()
    pre.proc.join(5)
    t0 = time.monotonic()
    res = pull(good, 1004, [pre], 0, 64, [], verify=False)
    assert res["state"] == "FAILED" and ("unreachable" in res["reason"] or "deadline" in res["reason"]), res["reason"]
    assert time.monotonic() - t0 < 3.0 + 1.5
    assert res["free"] == good.free0
    _until(lambda: bad_auth.call_raw("free")[1] == bad_auth.free0, "the other key's room left quarantine once the "
                                                                     "prefill was gone")


def _until(cond, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"not the case within {timeout_s} s: {what}"
        time.sleep(0.005)


def test_decode_gone_fails_the_prefill_room_and_frees_its_blocks(peers):
    """The decode process dies after asking for a room: the prefill side fails the room
    within its peer timeout (plus one second) and its blocks go back exactly once."""
    pre = peers("prefill", spec("sglang", seed=30))
    dec = peers("decode", spec("trtllm", tpb=32, seed=31))
    pre.call_raw("register", 7, 64)  # KV not ready yet: the room waits for the decode side
    dec.call_raw("start_pull", 7, [pre.endpoint_or_session], 0, 64)
    _until(lambda: pre.call_raw("asked", 7)[1] == 1, "the prefill accepted the decode's request")
    dec.proc.kill()
    dec.proc.join(5)
    t0 = time.monotonic()
    w = pre.call_raw("wait", 7, 10)
    assert w[1] == "FAILED" and "silent" in w[2], w[2]
    assert time.monotonic() - t0 < CFG["peer_timeout_s"] + 1.0
    assert w[4] == pre.free0 and w[5] == 0


def test_abort_from_decode_reaches_prefill(peers):
    pre = peers("prefill", spec("sglang", seed=32))
    dec = peers("decode", spec("trtllm", tpb=32, seed=33))
    pre.call_raw("register", 8, 64)
    dec.call_raw("start_pull", 8, [pre.endpoint_or_session], 0, 64)
    _until(lambda: pre.call_raw("asked", 8)[1] == 1, "the prefill accepted the decode's request")
    dec.call_raw("abort", 8)
    d = dec.call_raw("wait", 8, 5)
    w = pre.call_raw("wait", 8, 5)
    assert d[1] == "FAILED" and "aborted" in d[2]
    assert w[1] == "FAILED" and "aborted by decode" in w[2]
    assert d[4] == dec.free0 and w[4] == pre.free0 and d[5] == w[5] == 0


def test_decline_ends_the_prefill_room_before_and_after_it_exists(peers):
    """A decode rank that computes the prompt itself declines the room (a signed Abort
    without ever asking): a room the prefill already holds ends at once, and one it adds
    later ends as it is added; the prefill's blocks come back, the decode allocates none."""
    cfg = {"secret": SECRET}
    pre = peers("prefill", spec("sglang", seed=34), cfg)
    dec = peers("decode", spec("trtllm", tpb=32, seed=35), cfg)
    pre.call_raw("register", 9, 64)
    _, rec, free, count = dec.call_raw("decline", 9, [pre.endpoint_or_session], "recompute: below break-even (test)")
    assert rec["result"] == "declined" and free == dec.free0 and count == 1.0
    w = pre.call_raw("wait", 9, 5)
    assert w[1] == "FAILED" and "declined by decode: recompute: below break-even" in w[2], w[2]
    assert w[3]["result"] == "declined" and w[4] == pre.free0 and w[5] == 0
    # declined before the prefill engine adds the room
    _, _, _, count = dec.call_raw("decline", 10, [pre.endpoint_or_session], "recompute: below break-even (early)")
    assert count == 2.0
    _until(lambda: pre.call_raw("declined", 10)[1], "the decline reached the prefill")
    pre.call_raw("register", 10, 64)
    w = pre.call_raw("wait", 10, 2)
    assert w[1] == "FAILED" and "(early)" in w[2] and w[4] == pre.free0 and w[5] == 0, w


def test_receiver_staging_cuts_segments_for_split_rows(peers):
    """Prefill TP 2 -> SGLang decode TP 1: each prefill rank holds half of every NHD row the
    decode writes, so direct writes are one segment per token and layer; with receiver
    staging each rank sends its own contiguous runs and the decode scatters them."""
    total = 4
    pres = [peers("prefill", spec("sglang", total_heads=total, tp=2, rank=r, tpb=16, blocks=40, seed=60 + r))
            for r in range(2)]
    dec = peers("decode", spec("sglang", total_heads=total, tpb=16, blocks=40, seed=62), {"recv_staging_bytes": 8 << 20})
    served = [p.call_raw("serve", 3, 512, 256)[1] for p in pres]
    res = pull(dec, 3, pres, 0, 512, [(p.spec, b) for p, b in zip(pres, served)])
    waits = [p.call_raw("wait", 3, 30) for p in pres]
    check_ok(res, waits)
    assert res["record"]["plan"] == "staged_recv"
    direct_segments = 2 * 2 * 512  # per token, layer and K/V, from each of the two ranks
    assert res["record"]["segments"] * 10 <= 2 * direct_segments


def test_gather_and_scatter_over_two_threads_move_the_same_bytes(peers):
    """``gather_threads=2`` (the choice beside RDMA / NVLink) on TCP: a staged send whose
    2 MiB parts are each gathered on two threads, and a staged_recv room whose decode
    scatters each 8 MiB chunk on two: every byte verified, both records say two threads.
    Both decodes check content digests, which each side takes on the same two threads."""
    ps = spec("sglang", layers=4, total_heads=8, head_dim=64, tpb=64, blocks=20, seed=5)
    ds = spec("trtllm", layers=4, total_heads=8, head_dim=64, tpb=32, blocks=80, seed=6)
    cfg = {"chunk_bytes": 16 << 20, "first_part_bytes": 2 << 20, "part_bytes": 8 << 20, "prestage_slots": 0,
           "gather_threads": 2}
    pre, dec = peers("prefill", ps, cfg), peers("decode", ds, {"integrity": "on", "gather_threads": 2})
    blocks = pre.call_raw("serve", 5, 1024, 1024)[1]
    res = pull(dec, 5, [pre], 0, 1024, [(ps, blocks)], scattered=True)
    w = pre.call_raw("wait", 5, 30)
    check_ok(res, [w])
    assert res["record"]["plan"] == "staged_send" and w[3]["copy_threads"] == 2 and w[3]["chunks"] == 4, w[3]
    assert w[3]["digest_s"] > 0 and res["record"]["digest_s"] > 0, (w[3], res["record"])

    total = 4
    pres = [peers("prefill", spec("sglang", layers=4, total_heads=total, head_dim=128, tp=2, rank=r, tpb=16, blocks=140,
                                  seed=60 + r), {"chunk_bytes": 8 << 20}) for r in range(2)]
    dec = peers("decode", spec("sglang", layers=4, total_heads=total, head_dim=128, tpb=16, blocks=140, seed=62),
                {"recv_staging_bytes": 32 << 20, "gather_threads": 2, "integrity": "on"})
    served = [p.call_raw("serve", 3, 2048, 2048)[1] for p in pres]
    res = pull(dec, 3, pres, 0, 2048, [(p.spec, b) for p, b in zip(pres, served)])
    waits = [p.call_raw("wait", 3, 30) for p in pres]
    check_ok(res, waits)
    assert res["record"]["plan"] == "staged_recv" and res["record"]["copy_threads"] == 2, res["record"]
    assert res["record"]["digest_s"] > 0, res["record"]


@pytest.mark.parametrize("src, dst, kind", [
    (("vllm", 32, "vec"), ("vllm", 64, "vec"), "staged_both"),  # element-strided both sides, differently
    (("vllm", 32, "amx"), ("vllm", 32, "vec"), "staged_both"),
    (("vllm", 64, "amx"), ("vllm", 64, "amx"), "direct"),
    (("sglang", 16, "vec"), ("vllm", 32, "amx"), "staged_recv"),
])
def test_vllm_cpu_isas_and_block_sizes_meet(peers, src, dst, kind):
    """vLLM CPU caches of other block sizes or ISAs ('vec', 'amx': both element-strided)
    meet through staging on both sides, chunked; 'amx' to 'amx' moves directly, another
    engine's rows are scattered into 'amx' tiles. Every byte checked by vLLM's indexing."""
    (se, sp, si), (de, dp, di) = src, dst
    ps = spec(se, tpb=sp, isa=si, blocks=448 // sp + 4, seed=21)
    ds = spec(de, tpb=dp, isa=di, blocks=2 * (448 // dp) + 8, seed=22)
    pre = peers("prefill", ps, {"chunk_bytes": 64 << 10})
    dec = peers("decode", ds, {"recv_staging_bytes": 8 << 20})
    blocks = pre.call_raw("serve", 9, 400, 160)[1]  # three prefill chunks
    res = pull(dec, 9, [pre], 0, 400, [(ps, blocks)], scattered=True)
    w = pre.call_raw("wait", 9, 30)
    check_ok(res, [w])
    assert res["record"]["plan"] == kind
    assert res["written_bytes"] == 2 * 2 * 400 * 4 * 32 * 2


@pytest.mark.parametrize("link, kind", [("tcp", "direct"), ("nvlink", "staged_send")])
def test_the_plan_kind_follows_the_link_setting(peers, link, kind):
    """The same request (same pools, same blocks: the peers' allocators are seeded) between
    TensorRT-LLM pools of 1 MiB blocks, scattered on both sides: direct takes 16 writes,
    staging 8. On TCP (30 us a write, repack at 5 GB/s) 8 writes cost less than the
    gather that would save them; on NVLink or RDMA (a few us a write on a link 20-200x
    faster, a GPU gather) they cost more. The link comes only from the ``link`` setting,
    read by the shared settings reader into HandoffConfig.costs, as in the plugins."""
    ps = spec("trtllm", layers=4, total_heads=8, head_dim=128, tpb=64, blocks=24, seed=3)
    ds = spec("trtllm", layers=4, total_heads=8, head_dim=128, tpb=64, blocks=32, seed=3)
    sw = FaultSwitch()
    try:
        cfg = {"link": link, "chunk_bytes": 32 << 20, "hooks": sw.hooks}
        pre, dec = peers("prefill", ps, cfg), peers("decode", ds, cfg)
        blocks = pre.call_raw("serve", 7, 1024, 1024)[1]
        sw.on({"wire": True})
        res = pull(dec, 7, [pre], 0, 1024, [(ps, blocks)])
        w = pre.call_raw("wait", 7, 30)
        check_ok(res, [w])
        # what reached Mooncake, not what kvbridge recorded: the pieces, where they read and wrote
        wire = sw.wire(pre.call_raw("pid")[1])
        (src_pool,), (dst_pool,) = pre.call_raw("pool")[1], dec.call_raw("pool")[1]
    finally:
        sw.close()
    (slo, ssize), (dlo, dsize) = src_pool, dst_pool
    inside = [(slo <= s and s + n <= slo + ssize, dlo <= d and d + n <= dlo + dsize) for s, d, n in wire]
    assert sum(n for _, _, n in wire) == res["written_bytes"] == 16 << 20
    assert all(into for _, into in inside), "a piece written outside the decode's pool"
    spans = sorted((d, d + n) for _, d, n in wire)
    runs = 1 + sum(a != b for (_, b), (a, _) in zip(spans, spans[1:]))  # contiguous destination runs written
    assert runs == 8, spans  # the decode's blocks: 8 runs of two adjacent 1 MiB blocks
    if kind == "direct":  # one piece per 1 MiB block (the prefill's are scattered), read where its pool holds it
        assert len(wire) == 16 and all(frm for frm, _ in inside), wire
    else:  # gathered first, none read from the pool itself: one write per destination run (pieces cut at staging parts)
        assert not any(frm for frm, _ in inside), wire
    assert res["record"]["plan"] == kind and res["record"]["segments"] == (16 if kind == "direct" else runs)
