"""The kvbridge TensorRT-LLM connector, driven in TensorRT-LLM's executor order
(tests/trtllm_driver.py), TensorRT-LLM -> TensorRT-LLM, one OS process per rank, over
Mooncake TCP on 127.0.0.1, with pools of TensorRT-LLM's exact geometry. Every moved
byte is checked against the prefill pools, bytes outside the requests against a
snapshot, and block free counts on both sides."""

from __future__ import annotations

import time

import pytest

from kvbridge.adapters.trtllm import Handle
from trtllm_driver import FakeKVCacheManager, FakeRequest, Server, pool_spec, run_until

CFG = dict(host="127.0.0.1", deadline_s=8.0, heartbeat_s=0.2, peer_timeout_s=1.0, quiesce_s=0.5, chunk_bytes=1 << 20)
DEAD = "tcp://127.0.0.1:9"  # nothing listens there


@pytest.fixture
def servers():
    started = []

    def make(specs, cfg=None, decode=False):
        s = Server(specs, {**CFG, **(cfg or {})}, decode)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def _req(rid, prompt_len, max_new, handle: Handle | None, prefix=0, source=None):
    return dict(id=rid, prompt_len=prompt_len, max_new_tokens=max_new, handle=handle.to_json() if handle else None,
                prefix=prefix, source=source)


def _done(server, ids):
    return server.last is not None and all(i in server.last[0]["results"] for i in ids)


def _drained(server):
    """Nothing active and every block back on every rank."""
    return server.last is not None and all(r["active"] == 0 and r["free"] == server.free0 for r in server.last)


def _check_clean(server):
    for c in server.check():
        assert c["free"] == c["total"] and c["double_frees"] == 0 and c["pinned"] == 0, c
        assert c["untouched_ok"], "bytes outside every request's blocks changed"
        assert c["sender_rooms"] == 0 and c["receiver_rooms"] == 0, c
    return server.check()


def test_tp2_to_tp1_different_block_size_with_prefix_and_failures(servers):
    """Prefill TP 2 / 16-token blocks -> decode TP 1 / 32-token blocks, bf16: a plain
    handoff (decode finds the prefill through its bus), one where decode already holds a
    prefix, a dead prefill peer that falls back to recompute, and one that fails."""
    t0 = time.monotonic()
    pspecs = [pool_spec(tpb=16, blocks=64, tp=2, rank=r, seed=10 + r) for r in range(2)]
    pre = servers(pspecs)
    dec = servers([pool_spec(tpb=32, blocks=40, seed=20)], decode=True)
    t_start = time.monotonic() - t0

    pre.step([_req(1, 150, 1, Handle("send", 101)), _req(2, 77, 1, Handle("send", 102))])
    blocks = {r: pre.ask("blocks", r) for r in (1, 2)}
    assert blocks[1] == pre.ask("blocks", 1, rank=1), "TP ranks must hold a request in the same blocks"
    src = {r: {"specs": pspecs, "blocks": blocks[r]} for r in (1, 2)}
    dec.step([
        _req(11, 150, 2, Handle("recv", 101, prefill=pre.bus), source=src[1]),
        _req(12, 77, 2, Handle("recv", 102, endpoints=tuple(pre.sender_endpoints)), prefix=32, source=src[2]),
        _req(13, 150, 2, Handle("recv", 103, endpoints=(DEAD, DEAD)), source=src[1]),
        _req(14, 150, 2, Handle("recv", 104, endpoints=(DEAD, DEAD), on_failure="fail"), source=src[1]),
    ])
    iters = run_until([pre, dec], lambda: _done(dec, [11, 12, 13, 14]) and _drained(dec) and _drained(pre), 30)
    elapsed = time.monotonic() - t0
    res = dec.last[0]["results"]
    loads = dec.check()[0]["finished_loads"]

    # 11: every byte moved (2 prefill ranks -> 1 decode rank, 16 -> 32-token blocks); only the last token computed
    assert res[11] == {"tokens": 2, "cancelled": False, "computed": 1, "kv_ok": True}, res[11]
    assert loads[11]["verdict"] == "ok" and loads[11]["record"]["bytes"] == 2 * 2 * 150 * 4 * 32 * 2
    assert loads[11]["aux"] == {"output_ids": [50001]}  # the prefill's first token rides with TransferDone
    # 12: decode already held tokens 0..32; only 32..77 moved
    assert res[12] == {"tokens": 2, "cancelled": False, "computed": 1, "kv_ok": True}, res[12]
    assert loads[12]["record"]["bytes"] == 2 * 2 * (77 - 32) * 4 * 32 * 2
    # 13: the prefill peer is dead: the decode recomputed the whole prompt itself
    assert loads[13]["verdict"] == "recompute" and not loads[13]["ok"], loads[13]
    assert res[13] == {"tokens": 2, "cancelled": False, "computed": 150, "kv_ok": True}, res[13]
    # 14: same, with on_failure=fail: cancelled through the executor
    assert loads[14]["verdict"] == "fail" and res[14]["cancelled"], (loads[14], res[14])

    _check_clean(dec)
    _check_clean(pre)
    print(f"\n[trtllm tp2->tp1] start {t_start:.1f} s, {iters} iterations, total {elapsed:.1f} s")


def test_mla_fp8_tp1_to_tp2_early_decode_and_unclaimed_room(servers):
    """MLA latent (kv_factor 1) in fp8, prefill TP 1 / 64-token blocks -> decode TP 2 /
    32-token blocks; the decode asks before the prefill has the request; a prefill room no
    decode claims ends at its deadline and its blocks come back."""
    t0 = time.monotonic()
    pspec = pool_spec(mla=True, head_dim=96, dtype="fp8", tpb=64, blocks=16, seed=30)
    pre = servers([pspec], {"deadline_s": 3.0})
    dec = servers([pool_spec(mla=True, head_dim=96, dtype="fp8", tpb=32, blocks=24, tp=2, rank=r, seed=40 + r)
                   for r in range(2)], decode=True)

    # the prefill's block ids are deterministic: mirror its KV cache manager to know them in advance
    mirror = FakeKVCacheManager(pspec["blocks"], pspec["tpb"], seed=12345)
    mirror.add_sequence(FakeRequest(5, 130, 1, None))
    src = {"specs": [pspec], "blocks": mirror.blocks[5]}
    dec.step([_req(21, 130, 3, Handle("recv", 201, prefill=pre.bus), source=src)])
    for _ in range(3):
        pre.step()
        dec.step()
    pre.step([_req(5, 130, 1, Handle("send", 201)), _req(6, 40, 1, Handle("send", 202))])
    iters = run_until([pre, dec], lambda: _done(dec, [21]) and _drained(dec) and _drained(pre), 30)
    for r in (0, 1):
        res = dec.last[r]["results"][21]
        assert res == {"tokens": 3, "cancelled": False, "computed": 1, "kv_ok": True}, (r, res)
    loads = [c["finished_loads"][21] for c in _check_clean(dec)]
    assert all(ld["verdict"] == "ok" for ld in loads), loads
    # each decode rank got the whole latent (2 layers x 130 tokens x 96 B); the sender's
    # TransferDone counts bytes over all the room's targets so far, hence the smaller one
    assert min(ld["record"]["bytes"] for ld in loads) == 2 * 130 * 96
    _check_clean(pre)
    print(f"\n[trtllm mla fp8 tp1->tp2] {iters} iterations, total {time.monotonic() - t0:.1f} s")


def test_cost_gate_computes_short_prompts_on_decode_and_moves_long_ones(servers, tmp_path):
    """Decode with the cost gate on (tcp preset, the model's HF config, fixed throughputs:
    break-even 52 tokens): a 30-token prompt and a 150-token one of which the decode holds
    128 are computed by the decode itself (0 external tokens), their prefill rooms declined
    and released (one found through the prefill's bus, one by explicit endpoints); a
    150-token prompt moves."""
    import json

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    gate = dict(cost_link="tcp", cost_model=str(tmp_path), cost_prefill_tps=1e6, cost_decode_prefill_tps=1000,
                cost_queue_s=0.05)
    pspec = pool_spec(blocks=40, seed=50)
    pre = servers([pspec])
    dec = servers([pool_spec(tpb=16, blocks=48, seed=51)], gate, decode=True)
    pre.step([_req(1, 30, 1, Handle("send", 301)), _req(2, 150, 1, Handle("send", 302)),
              _req(3, 150, 1, Handle("send", 303))])
    src = {r: {"specs": [pspec], "blocks": pre.ask("blocks", r)} for r in (1, 2, 3)}
    eps = tuple(pre.sender_endpoints)
    dec.step([_req(31, 30, 2, Handle("recv", 301, prefill=pre.bus), source=src[1]),
              _req(32, 150, 2, Handle("recv", 302, endpoints=eps), source=src[2]),
              _req(33, 150, 2, Handle("recv", 303, endpoints=eps), prefix=128, source=src[3])])
    run_until([pre, dec], lambda: _done(dec, [31, 32, 33]) and _drained(dec) and _drained(pre), 30)
    res = dec.last[0]["results"]
    # below break-even: the decode computed every token past what it held; the KV is right either way
    assert res[31] == {"tokens": 2, "cancelled": False, "computed": 30, "kv_ok": True}, res[31]
    assert res[33] == {"tokens": 2, "cancelled": False, "computed": 22, "kv_ok": True}, res[33]
    # above: moved, only the last prompt token computed
    assert res[32] == {"tokens": 2, "cancelled": False, "computed": 1, "kv_ok": True}, res[32]
    d = _check_clean(dec)[0]
    assert sorted(d["fallbacks"]) == [31, 33] and 32 in d["finished_loads"] and 31 not in d["finished_loads"]
    assert d["fallbacks"][31]["reason"].startswith("recompute: below break-even") and d["fallbacks"][33]["held"] == 128
    assert d["declined"][31]["result"] == "declined" and d["declined"][33]["room"] == 303
    assert d["metrics"]["fallbacks_below_break_even"] == 2.0
    assert d["finished_loads"][32]["record"]["bytes"] == 2 * 2 * 150 * 4 * 32 * 2
    p = _check_clean(pre)[0]  # the declined rooms' blocks came back, nothing leaked
    assert p["metrics"]["sender_declined"] == 2.0
