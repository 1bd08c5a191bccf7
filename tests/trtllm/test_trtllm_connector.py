"""The kvbridge TensorRT-LLM connector under the TensorRT-LLM stand-in, TensorRT-LLM ->
TensorRT-LLM: one OS process per rank (``kvbridge.demo.trtllm``), Mooncake TCP on
127.0.0.1, the tiny models' real forward on every rank. Each version of the stand-in
(1.2.x and main) plays each side.

Checked independently of the code under test: generated tokens against transformers'
``generate()``; the decode pool's KV, read through TensorRT-LLM's own indexing rule,
byte for byte against the prefill pool's and closely against transformers' forward
(which a recompute must also match); block counts, pins, open rooms; and that no byte
outside the blocks requests used changed.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.engine_kv import assert_kv_close, transformers_kv
from kvbridge.adapters.trtllm import Handle, announce
from kvbridge.demo.models import random_prompt, reference_generate
from tests.helpers.trtllm_servers import VERSION_PAIRS, assert_matches_transformers, check_clean, server_kv
from tests.helpers.trtllm_servers import run_until, wait_done

DEAD = "tcp://127.0.0.1:9"  # nothing listens there
MAX_NEW = 6
HD = 16  # the tiny Llama's head_dim (2 layers, 2 KV heads): 2 x 2 x 2 x 16 x 4 = 512 bytes per token
TOKEN_BYTES = 2 * 2 * 2 * HD * 4


@pytest.mark.parametrize("pv,dv", VERSION_PAIRS)
def test_gqa_tp2_to_tp1_with_prefix_hit_recompute_and_fail(trt_servers, tiny_llama_dir, pv, dv):
    """Prefill TP 2 / 16-token blocks -> decode TP 1 / 32-token blocks. (1) a handoff the
    decode finds through the prefill's bus; (2) a prompt whose first 64 tokens the decode
    holds already (device block reuse): only the rest moves; (3) a prefill that is gone:
    the decode computes the prompt itself; (4) the same with ``on_failure=fail``: cancelled."""
    pre = trt_servers(pv, tiny_llama_dir, tp=2, tokens_per_block=16, num_blocks=64)
    dec = trt_servers(dv, tiny_llama_dir, tp=1, tokens_per_block=32, num_blocks=48)
    p1 = random_prompt(150, seed=11)
    p2 = p1[:64] + random_prompt(60, seed=12)
    p3, p4 = random_prompt(90, seed=13), random_prompt(40, seed=14)
    refs = {i: reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids for i, p in ((1, p1), (2, p2), (3, p3), (4, p4))}

    announce(pre.bus, p1, Handle("send", 101))
    announce(dec.bus, p1, Handle("recv", 101, prefill=pre.bus))
    a, d1 = pre.submit(p1, 1), dec.submit(p1, MAX_NEW)
    wait_done([pre, dec], dec, [d1])
    pre_blocks = pre.responses[a]["blocks"]
    assert pre.responses[a]["output_token_ids"] == refs[1][:1]
    r1 = dec.responses[d1]
    assert r1["output_token_ids"] == refs[1], (r1, refs[1])
    assert r1["context_tokens_computed"] == 1, "only the last prompt token is computed on the decode"
    ld = dec.state()["finished_loads"][d1]
    assert ld["verdict"] == "ok" and ld["record"]["bytes"] == len(p1) * TOKEN_BYTES, ld
    assert ld["aux"] == {"output_ids": refs[1][:1]}  # the prefill's first token rides with TransferDone
    moved = server_kv(dec, r1["blocks"], HD, range(len(p1) - 1))
    torch.testing.assert_close(moved, server_kv(pre, pre_blocks, HD, range(len(p1) - 1)), rtol=0, atol=0)
    assert_matches_transformers(dec, tiny_llama_dir, p1, r1["blocks"], HD, "decode KV after the handoff")

    # (2) the decode's device cache holds p1's first two 32-token blocks
    announce(pre.bus, p2, Handle("send", 102))
    announce(dec.bus, p2, Handle("recv", 102, endpoints=tuple(pre.sender_endpoints)))
    _, d2 = pre.submit(p2, 1), dec.submit(p2, MAX_NEW)
    wait_done([pre, dec], dec, [d2])
    assert dec.responses[d2]["output_token_ids"] == refs[2]
    assert dec.responses[d2]["context_tokens_computed"] == 1
    assert dec.state()["finished_loads"][d2]["record"]["bytes"] == (len(p2) - 64) * TOKEN_BYTES
    assert_matches_transformers(dec, tiny_llama_dir, p2, dec.responses[d2]["blocks"], HD, "decode KV with a prefix hit")

    # (3), (4): the prefill is gone
    announce(dec.bus, p3, Handle("recv", 103, endpoints=(DEAD, DEAD)))
    announce(dec.bus, p4, Handle("recv", 104, endpoints=(DEAD, DEAD), on_failure="fail"))
    d3, d4 = dec.submit(p3, MAX_NEW), dec.submit(p4, MAX_NEW)
    wait_done([pre, dec], dec, [d3, d4])
    loads = dec.state()["finished_loads"]
    assert loads[d3]["verdict"] == "recompute" and not loads[d3]["ok"] and loads[d3]["reason"], loads[d3]
    r3 = dec.responses[d3]
    assert r3["output_token_ids"] == refs[3] and r3["context_tokens_computed"] == len(p3), r3
    assert_matches_transformers(dec, tiny_llama_dir, p3, r3["blocks"], HD, "decode KV after a recompute")
    assert loads[d4]["verdict"] == "fail" and dec.responses[d4]["finish_reason"] == "cancelled", dec.responses[d4]
    check_clean(dec)
    check_clean(pre)


def test_mla_fp8_flashmla_tp1_to_tp2_early_decode_and_unclaimed_room(trt_servers, tiny_mla_dir):
    """MLA latent rows in fp8. The prefill runs FlashMLA, so the executor forces 64 tokens
    per block while its kv_cache_config says 32 (the connector must read the pool, not the
    config); decode TP 2 with 32-token blocks (the latent is replicated: each rank pulls all
    of it). The decode request comes before the prefill's; a prefill room nobody pulls ends
    at its deadline and its blocks come back."""
    pre = trt_servers("main", tiny_mla_dir, tp=1, tokens_per_block=32, enable_flash_mla=True, kv_dtype="fp8",
                      num_blocks=16, plugin={"deadline_s": 3.0})
    dec = trt_servers("1.2", tiny_mla_dir, tp=2, tokens_per_block=32, kv_dtype="fp8", num_blocks=24)
    assert pre.tokens_per_block == 64 and dec.tokens_per_block == 32
    row = json.loads((tiny_mla_dir / "config.json").read_text())
    row = row["kv_lora_rank"] + row["qk_rope_head_dim"]
    prompt, lone = random_prompt(130, seed=21), random_prompt(40, seed=22)
    announce(dec.bus, prompt, Handle("recv", 201, prefill=pre.bus))
    d = dec.submit(prompt, 4)
    for _ in range(3):
        pre.step()
        dec.step()
    announce(pre.bus, prompt, Handle("send", 201))
    announce(pre.bus, lone, Handle("send", 202))
    a, _ = pre.submit(prompt, 1), pre.submit(lone, 1)
    wait_done([pre, dec], dec, [d], timeout_s=90)
    out = dec.responses[d]
    assert out["context_tokens_computed"] == 1 and len(out["output_token_ids"]) == 4, out
    for st in check_clean(dec):  # both decode ranks pulled the whole latent
        ld = st["finished_loads"][d]
        assert ld["verdict"] == "ok", ld
    rows = server_kv(dec, out["blocks"], row, range(len(prompt) - 1), fp8=True)
    pre_rows = server_kv(pre, pre.responses[a]["blocks"], row, range(len(prompt) - 1), fp8=True)
    torch.testing.assert_close(rows, pre_rows, rtol=0, atol=0)
    # layer 0's rows depend on the prompt alone: fp8-rounded transformers rows (deeper layers
    # read fp8 KV below them, which transformers' float32 forward does not)
    ref = transformers_kv(tiny_mla_dir, prompt)[:1, :, :len(prompt) - 1]
    assert_kv_close(rows[:1], ref, "decode latent rows, layer 0", fp8=True)
    # the same prompt computed on the decode server itself (another cache salt: no device reuse)
    local = dec.submit(prompt, 4, cache_salt="computed-here")
    wait_done([pre, dec], dec, [local])
    assert dec.responses[local]["context_tokens_computed"] == len(prompt)
    assert dec.responses[local]["output_token_ids"] == out["output_token_ids"]
    mine = server_kv(dec, dec.responses[local]["blocks"], row, range(len(prompt) - 1), fp8=True)
    torch.testing.assert_close(rows, mine, rtol=0, atol=0)
    check_clean(pre)
    assert pre.state()["finished_saves"][2]["ok"] is False  # the unclaimed room ended at its deadline


def test_cost_gate_computes_short_prompts_on_decode_and_moves_long_ones(trt_servers, tiny_llama_dir, tmp_path):
    """Decode with the cost gate on (tcp preset, the tiny model's config, fixed throughputs:
    break-even about 52 tokens). A 30-token prompt and a 150-token one of which the decode
    holds 128 are computed on the decode (0 external tokens) and their prefill rooms declined
    and released; a 150-token prompt moves."""
    gate = dict(cost_gate_enabled=True, link="tcp", cost_model=str(tiny_llama_dir), cost_prefill_tps=1e6,
                cost_decode_prefill_tps=1000, cost_queue_s=0.05)
    pre = trt_servers("1.2", tiny_llama_dir, tokens_per_block=32, num_blocks=48)
    dec = trt_servers("main", tiny_llama_dir, tokens_per_block=16, num_blocks=64, plugin=gate)
    short, long_, base = random_prompt(30, seed=31), random_prompt(150, seed=32), random_prompt(129, seed=34)
    held = base[:128] + random_prompt(22, seed=33)
    warm = dec.submit(base, 1)  # the decode computes the first 128 tokens of `held` itself, once
    wait_done([dec], dec, [warm])
    ids = {}
    for room, p, via in ((301, short, {"prefill": pre.bus}), (302, long_, {"endpoints": tuple(pre.sender_endpoints)}),
                         (303, held, {"endpoints": tuple(pre.sender_endpoints)})):
        announce(pre.bus, p, Handle("send", room))
        announce(dec.bus, p, Handle("recv", room, **via))
        pre.submit(p, 1)
        ids[room] = dec.submit(p, 2)
    wait_done([pre, dec], dec, list(ids.values()))
    res = {room: dec.responses[rid] for room, rid in ids.items()}
    assert res[301]["context_tokens_computed"] == 30 and res[303]["context_tokens_computed"] == 150 - 128
    assert res[302]["context_tokens_computed"] == 1
    for room, p in ((301, short), (302, long_), (303, held)):
        assert res[room]["output_token_ids"] == reference_generate(tiny_llama_dir, p, 2).token_ids, room
    d = check_clean(dec)[0]
    assert sorted(d["fallbacks"]) == [ids[301], ids[303]], d["fallbacks"]
    assert d["fallbacks"][ids[301]]["reason"].startswith("recompute: below break-even")
    assert d["fallbacks"][ids[303]]["held"] == 128
    assert d["declined"][ids[301]]["result"] == "declined" and d["declined"][ids[303]]["room"] == 303
    assert d["metrics"]["fallbacks_below_break_even"] == 2.0
    assert d["finished_loads"][ids[302]]["record"]["bytes"] == 150 * TOKEN_BYTES
    p = check_clean(pre)[0]  # the declined rooms' blocks came back
    assert p["metrics"]["sender_declined"] == 2.0


def test_vanilla_backend_nhd_blocks_of_max_num_tokens(trt_servers, tiny_llama_dir):
    """A decode on the VANILLA attention backend: the executor forces ``max_num_tokens``
    tokens per block and the backend writes NHD inside a block (``KVCacheManager.get_buffers``);
    the connector must read both from the engine, not from ``kv_cache_config``."""
    pre = trt_servers("main", tiny_llama_dir, tokens_per_block=32, num_blocks=32)
    dec = trt_servers("1.2", tiny_llama_dir, tokens_per_block=32, attn_backend="VANILLA", max_num_tokens=128,
                      num_blocks=8)
    assert dec.tokens_per_block == 128
    prompt = random_prompt(100, seed=41)
    announce(pre.bus, prompt, Handle("send", 401))
    announce(dec.bus, prompt, Handle("recv", 401, prefill=pre.bus))
    pre.submit(prompt, 1)
    d = dec.submit(prompt, MAX_NEW)
    wait_done([pre, dec], dec, [d])
    out = dec.responses[d]
    assert out["context_tokens_computed"] == 1
    assert out["output_token_ids"] == reference_generate(tiny_llama_dir, prompt, MAX_NEW).token_ids
    assert_matches_transformers(dec, tiny_llama_dir, prompt, out["blocks"], HD, "NHD decode KV", block_order="NHD")
    check_clean(dec)
    check_clean(pre)


def test_fp8_scales_that_differ_are_recomputed_not_moved(trt_servers, tiny_llama_dir):
    """fp8 caches whose models hold other KV scales (the decode's layer 1: 0.5, as from a
    checkpoint with calibrated scales; the prefill's 1.0, TensorRT-LLM's own): the prefill's
    bytes would read as other numbers on the decode, so the load fails naming the layer and
    both scales, and the decode computes the prompt itself (on_failure=recompute): the
    same tokens and the same pool bytes as the prompt computed there from the start."""
    pre = trt_servers("main", tiny_llama_dir, tp=1, tokens_per_block=16, kv_dtype="fp8", num_blocks=32)
    dec = trt_servers("1.2", tiny_llama_dir, tp=1, tokens_per_block=32, kv_dtype="fp8", num_blocks=32,
                      kv_scales=[1.0, 0.5])
    prompt = random_prompt(70, seed=31)
    announce(pre.bus, prompt, Handle("send", 301))
    announce(dec.bus, prompt, Handle("recv", 301, prefill=pre.bus))
    pre.submit(prompt, 1)
    d = dec.submit(prompt, 4)
    wait_done([pre, dec], dec, [d])
    ld = dec.state()["finished_loads"][d]
    assert ld["verdict"] == "recompute" and not ld["ok"], ld
    assert "layer 1 K head 0: source 1 != destination 0.5" in ld["reason"], ld["reason"]
    out = dec.responses[d]
    assert out["context_tokens_computed"] == len(prompt), out
    got = server_kv(dec, out["blocks"], HD, range(len(prompt) - 1), fp8=True)  # before its blocks are used again
    local = dec.submit(prompt, 4, cache_salt="computed-here")
    wait_done([pre, dec], dec, [local])
    assert out["output_token_ids"] == dec.responses[local]["output_token_ids"]
    mine = server_kv(dec, dec.responses[local]["blocks"], HD, range(len(prompt) - 1), fp8=True)
    torch.testing.assert_close(got, mine, rtol=0, atol=0)
    check_clean(dec)
    check_clean(pre)
