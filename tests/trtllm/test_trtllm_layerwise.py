"""Layer-wise sends in the kvbridge TensorRT-LLM connector, under the TensorRT-LLM stand-in:
with ``layerwise`` on, the prefill's workers send each layer of the tokens a forward
computes from ``save_kv_layer`` (the stand-in calls the hooks in the real executor's order:
``start_load_kv``, per decoder layer ``wait_for_layer_load`` / ``save_kv_layer``,
``wait_for_save`` at the end of ``_forward_step`` before sampling), and the sampled first
token follows with the sender's ``finish``. One OS process per rank, Mooncake TCP on
127.0.0.1, the tiny Llama's real forward.

Checked independently of the code under test: the decode's greedy tokens against
transformers' ``generate()``, its KV (TensorRT-LLM's own indexing) against transformers'
forward and byte for byte against the prefill pool; blocks, pins and rooms all back.
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.adapters.trtllm import Handle, announce
from kvbridge.demo.models import random_prompt, reference_generate
from tests.helpers.trtllm_servers import assert_matches_transformers, check_clean, server_kv
from tests.helpers.trtllm_servers import wait_done

MAX_NEW = 6
HD = 16  # the tiny Llama: 2 layers, 2 KV heads of 16, float32
LAYERS = 2
TOKEN_BYTES = LAYERS * 2 * 2 * HD * 4


@pytest.mark.parametrize("pv, dv, overlap", [("1.2", "main", True), ("main", "1.2", False)])
def test_layerwise_prefill_tp2_chunked_to_decode(trt_servers, tiny_llama_dir, pv, dv, overlap):
    """Prefill TP 2, 16-token blocks, chunked prefill of 64 tokens (a 150-token prompt in 3
    forwards), layer-wise on -> decode TP 1 with 32-token blocks; with and without the
    overlap scheduler (which calls ``request_finished`` one iteration late). A second
    prompt of which the prefill's device cache holds 64 tokens: its first forward also
    sends those (and the decode, whose device cache holds them too, pulls only the rest).
    Every layer of every chunk went from ``save_kv_layer``, the room ended by
    ``finish`` with the first token. Rank 1 starts each such forward late (as on a loaded
    host): rank 0 orders the ``Send`` before rank 1 streamed the last chunk's layers, which
    must still go layer by layer (CI once saw rank 1 send such a room whole)."""
    plugin = {"layerwise": True}
    pre = trt_servers(pv, tiny_llama_dir, tp=2, tokens_per_block=16, num_blocks=64, enable_chunked_prefill=True,
                      max_num_tokens=64, disable_overlap_scheduler=not overlap, plugin=plugin,
                      setup=("tests.helpers.trtllm_servers:lag_layerwise_ranks", 0.3))
    dec = trt_servers(dv, tiny_llama_dir, tp=1, tokens_per_block=32, num_blocks=48)
    p1 = random_prompt(150, seed=61)
    p2 = p1[:64] + random_prompt(40, seed=62)
    for room, p, chunks, held in ((601, p1, 3, 0), (602, p2, 1, 64)):  # held: what both device caches hold
        announce(pre.bus, p, Handle("send", room))
        announce(dec.bus, p, Handle("recv", room, prefill=pre.bus))
        a, d = pre.submit(p, 1), dec.submit(p, MAX_NEW)
        wait_done([pre, dec], dec, [d], timeout_s=120)
        out = dec.responses[d]
        assert out["output_token_ids"] == reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids, room
        assert out["context_tokens_computed"] == 1, "only the last prompt token is computed on the decode"
        ld = dec.state()["finished_loads"][d]
        assert ld["verdict"] == "ok" and ld["record"]["bytes"] == (len(p) - held) * TOKEN_BYTES, ld
        assert ld["aux"] == {"output_ids": out["output_token_ids"][:1]}  # the first token rode with finish()
        assert pre.responses[a]["context_tokens_computed"] == len(p) - held
        for r in range(2):
            sv = pre.state(r)["finished_saves"][a]
            assert sv["ok"] and sv["ended_by"] == "finish", sv
            assert sv["layer_pieces"] == LAYERS * chunks, sv
        moved = server_kv(dec, out["blocks"], HD, range(len(p) - 1))
        torch.testing.assert_close(moved, server_kv(pre, pre.responses[a]["blocks"], HD, range(len(p) - 1)),
                                   rtol=0, atol=0)
        assert_matches_transformers(dec, tiny_llama_dir, p, out["blocks"], HD, f"room {room}: decode KV, layer-wise")
    check_clean(dec)
    check_clean(pre)
