"""Layer-wise handoffs: the prefill hands each chunk's KV over one layer (range) at a time,
as its forward writes them, and each goes on the wire while the next is computed.

Separate OS processes over Mooncake TCP on 127.0.0.1 (tests/helpers/handoff_peers.py): the decode
process verifies every moved byte against the prefill pool rebuilt from its seed, and that
nothing else in its pool changed; block free-counts are checked on both sides.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from kvbridge.common import protocol as P
from tests.core.test_handoff import CFG, Peer, check_ok, peers, spec  # noqa: F401 (peers: the fixture)


def _start_pull(decode, room, prefills, start, stop, sources, receivers=1, **opts):
    """The decode side asks first (its request waits on the prefill until the room exists)."""
    decode.conn.send(("pull", room, [p.endpoint_or_session for p in prefills], start, stop, receivers, sources, opts))


@pytest.mark.parametrize("src_engine, src_tpb, dst_engine, dst_tpb, finish", [
    ("sglang", 16, "trtllm", 32, False),  # the final range's pieces carry `last`
    ("trtllm", 32, "sglang", 16, True),  # the first token comes after the forward: finish()
])
def test_layerwise_cross_format_chunked_with_prefix(peers, src_engine, src_tpb, dst_engine, dst_tpb, finish):
    """Chunked prefill, 4 layers, each layer of each chunk handed over on its own and on the
    wire before the next one is given; the decode holds a prefix; both directions between
    SGLang's and TensorRT-LLM's pools. Byte-exact, the first token rides with the last Done."""
    ps = spec(src_engine, layers=4, tpb=src_tpb, blocks=400 // src_tpb + 4, seed=3)
    ds = spec(dst_engine, layers=4, tpb=dst_tpb, blocks=400 // dst_tpb + 8, seed=4)
    pre, dec = peers("prefill", ps), peers("decode", ds)
    room, n = 21, 300
    _start_pull(dec, room, [pre], 40, n, [], verify=False)  # compared below, by the engines' indexing
    _, blocks, pieces, landed = pre.call_raw("serve_layers", room, n, 96, {"await_each": True, "finish": finish},
                                             timeout=120)
    res = dec.call_raw(timeout=90)[1]
    w = pre.call_raw("wait", room, 30)
    assert res["state"] == "SUCCESS", res["reason"]
    assert w[1] == "SUCCESS", w[2]
    assert pieces == 4 * 4  # 4 chunks x 4 layers
    assert all(b > a for a, b in zip(landed, landed[1:]))  # every piece was on the wire before the next was given
    assert w[3]["chunks"] >= pieces
    assert res["aux"] == {"output_ids": [room], "cached_tokens": 0}
    # every byte: read both pools by the engines' own indexing rules
    positions = np.arange(40, n)
    got = dec.call_raw("engine_read", res["blocks"], positions)[1]
    want = pre.call_raw("engine_read", blocks, positions)[1]
    assert got.shape == want.shape and np.array_equal(got, want), "decode pool does not hold the prefill's K/V"
    assert res["record"]["bytes"] == 4 * 2 * (n - 40) * 4 * 32 * 2
    assert w[4] == pre.free0 and w[5] == 0
    assert res["free"] == dec.free0


def test_layerwise_tp2_to_1_through_receiver_staging_and_direct(peers):
    """Prefill TP 2 -> decode TP 1 (GQA, 4 KV heads split over the prefill ranks), two layers
    per piece: into an SGLang decode that scatters from its staging (staged_recv per layer
    range), and into a TensorRT-LLM decode written directly. Byte-exact, untouched elsewhere."""
    total = 4
    pres = [peers("prefill", spec("sglang", layers=4, total_heads=total, tp=2, rank=r, tpb=16, blocks=80, seed=60 + r))
            for r in range(2)]
    for room, ds, cfg, plan in [
        (31, spec("sglang", layers=4, total_heads=total, tpb=16, blocks=40, seed=62), {"recv_staging_bytes": 8 << 20},
         "staged_recv"),
        (32, spec("trtllm", layers=4, total_heads=total, tpb=32, blocks=40, seed=63), {}, None),
    ]:
        dec = peers("decode", ds, cfg)
        _start_pull(dec, room, pres, 0, 512, [], verify=False)
        served = [p.call_raw("serve_layers", room, 512, 256, {"layer_step": 2}, timeout=120)[1] for p in pres]
        res = dec.call_raw(timeout=90)[1]
        waits = [p.call_raw("wait", room, 30) for p in pres]
        assert res["state"] == "SUCCESS", res["reason"]
        assert all(w[1] == "SUCCESS" for w in waits), waits
        if plan:
            assert res["record"]["plan"] == plan
        positions = np.arange(512)
        got = dec.call_raw("engine_read", res["blocks"], positions)[1]  # [layers, kv, T, heads, bytes]
        want = np.concatenate([p.call_raw("engine_read", b, positions)[1] for p, b in zip(pres, served)], axis=3)
        assert np.array_equal(got, want), f"room {room}: decode pool does not hold both prefill ranks' heads"
        assert res["record"]["bytes"] == 4 * 2 * 512 * total * 32 * 2
        assert all(w[4] == p.free0 and w[5] == 0 for p, w in zip(pres, waits))
        assert res["free"] == dec.free0


def test_layerwise_mla_fp8(peers):
    """An MLA latent (kv_factor 1, fp8), one SGLang page per token -> TensorRT-LLM blocks of 32,
    chunked, layer by layer, every piece handed over before the decode asks: the pieces of
    one token range that queued up go as one layer range (one plan, one write here);
    checked through the decode's byte verification."""
    ps = spec("sglang", layers=3, total_heads=1, head_dim=96, dtype="fp8", tpb=1, blocks=130, seed=8, mla=True)
    ds = spec("trtllm", layers=3, total_heads=1, head_dim=96, dtype="fp8", tpb=32, blocks=8, seed=9, mla=True)
    pre, dec = peers("prefill", ps), peers("decode", ds)
    _, blocks, pieces, _ = pre.call_raw("serve_layers", 1, 100, 50, {})
    res = dec.call_raw("pull", 1, [pre.endpoint_or_session], 0, 100, 1, [(ps, blocks)], {}, timeout=90)[1]
    w = pre.call_raw("wait", 1, 30)
    check_ok(res, [w])
    assert pieces == 2 * 3 and res["written_bytes"] == 3 * 100 * 96
    assert w[3]["chunks"] == 2, w[3]  # one write per token range, not one per piece


def test_layerwise_prefill_killed_after_some_layers(peers):
    """The prefill process dies after handing over 3 of the 4 layers of its only chunk (the
    decode asked first, so those layers were being written): the decode room ends Failed
    within its peer timeout, is never admitted, and its blocks come back exactly once."""
    pre = peers("prefill", spec("sglang", layers=4, seed=70))
    dec = peers("decode", spec("trtllm", layers=4, tpb=32, seed=71))
    dec.call_raw("start_pull", 41, [pre.endpoint_or_session], 0, 256)
    pre.conn.send(("serve_layers", 41, 256, 256, {"await_each": True, "die_after": 3}))
    pre.proc.join(60)
    assert pre.proc.exitcode == 0, "the prefill did not die where it was told to"
    t0 = time.monotonic()
    _, state, reason, _, free, double = dec.call_raw("wait", 41, 30)
    assert state == "FAILED" and ("unreachable" in reason or "deadline" in reason), reason
    assert time.monotonic() - t0 < CFG["peer_timeout_s"] + 2.0
    assert free == dec.free0 and double == 0


def test_a_done_missing_a_layer_is_not_admitted(peers):
    """A prefill that reports the room's full byte count but nothing for one layer (what a
    layer-wise sender that skipped a layer would claim): the decode ends the room Failed,
    naming the layer, and its blocks come back once."""
    dec = peers("decode", spec("trtllm", layers=4, tpb=32, seed=72))
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        dec.call_raw("start_pull", 51, [f"tcp://127.0.0.1:{port}"], 0, 64)
        end = time.monotonic() + 20
        while True:
            assert router.poll(int(max(0.0, end - time.monotonic()) * 1000)), "no request from the decode rank"
            ident, payload = router.recv_multipart()
            msg = P.decode(payload)
            if isinstance(msg, P.TransferRequest):
                break
        per_layer = 64 * 2 * 4 * 32 * 2
        done = P.TransferDone(room=51, bytes=4 * per_layer, segments=4, plan="direct", seconds=0.0,
                              layer_bytes=[2 * per_layer, per_layer, per_layer, 0], attempt=msg.attempt)
        router.send_multipart([ident, P.encode(done)])
        _, state, reason, _, free, double = dec.call_raw("wait", 51, 10)
        assert state == "FAILED" and "into layer 3" in reason, reason
        assert free == dec.free0 and double == 0
    finally:
        router.close(0)


def test_done_layer_bytes_must_sum_to_its_bytes():
    with pytest.raises(P.ProtocolError, match="layer_bytes sum to 3"):
        P.decode(msgspec.msgpack.encode({"type": "transfer_done", "version": P.PROTOCOL_VERSION, "room": 1, "bytes": 4,
                                         "segments": 1, "plan": "direct", "seconds": 0.0, "layer_bytes": [1, 2]}))


def test_layer_pieces_out_of_order_are_refused():
    """A layer-wise room's pieces come per token range from layer 0 up, ranges one after
    the other; anything else is refused by name before it could reach a decode peer."""
    from tests.helpers.handoff_peers import _config, build_pool

    from kvbridge.common.handoff import KVSender
    from kvbridge.common.transport import MooncakeTransport

    lay, _ = build_pool(spec("sglang", layers=4, seed=80))
    transport = MooncakeTransport("127.0.0.1")
    sender = KVSender(lay, transport, config=_config(CFG))
    released = []
    try:
        sender.add_room(1, [3, 4, 5, 6], release=lambda b, ok: released.append(ok))
        blocks = [3, 4, 5, 6]
        with pytest.raises(ValueError, match="start at layer 1, not 0"):
            sender.send_chunk(1, blocks, 0, 32, last=False, layers=(1, 2))
        with pytest.raises(ValueError, match=r"layer range \[0, 5\) outside this pool's 4 layers"):
            sender.send_chunk(1, blocks, 0, 32, last=False, layers=(0, 5))
        sender.send_chunk(1, blocks, 0, 32, last=False, layers=(0, 2))
        with pytest.raises(ValueError, match=r"tokens \[32, 64\) layers \[0, 4\) while tokens \[0, 32\) wait for layer 2"):
            sender.send_chunk(1, blocks, 32, 64, last=False)
        with pytest.raises(ValueError, match=r"layers 2\.\. to come"):
            sender.finish(1)
        sender.send_chunk(1, blocks, 0, 32, last=False, layers=(2, 4))
        sender.send_chunk(1, blocks, 32, 64, last=True, layers=(0, 4))  # the whole range at once ends the room
        with pytest.raises(ValueError, match="after the last"):
            sender.finish(1)
    finally:
        sender.close()
        transport.close()
    assert released == [False]  # closed before any decode asked: given up, once
