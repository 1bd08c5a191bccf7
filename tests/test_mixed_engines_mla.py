"""Decode continues from MLA KV moved between engines of different kinds (issue 6, the MLA model).

The tiny DeepSeek-V3-style model (multi-head latent attention: one latent row per token
and layer, ``kv_lora_rank + qk_rope_head_dim`` = 48 wide, kv_factor 1), both ways:

- SGLang prefill -> TensorRT-LLM decode: SGLang's REAL prefill server on the kvbridge
  backend computes the prompt into its ``MLATokenToKVPool``; the "TensorRT-LLM" decode
  rank in this process (``kvbridge.demo.trt_engine.TRTEngine``: the kvbridge TensorRT-LLM
  connector driven in the executor's order, with ``kvbridge.demo.mla_runner.TinyMLARunner``
  over a pool of TensorRT-LLM's MLA geometry ``[blocks, layers, 1, tokens_per_block * 48]``)
  gets only the prefill's SGLang bootstrap address in its handle, finds the prefill rank,
  pulls the prompt's latent rows into its pool, and the paged decode loop continues from
  the pool alone.
- TensorRT-LLM prefill -> SGLang decode: the runner's prefill writes the TensorRT-LLM MLA
  pool; the connector (with ``sglang_bootstrap_port``) runs the SGLang-compatible
  bootstrap server and serves the rows with the first token as aux ``output_ids``;
  SGLang's REAL decode server pulls them and decodes.

Greedy tokens (float32) must equal transformers' ``generate()`` for 32 new tokens, the
first token must be the one the prefill side sent, the first-step logits must match
transformers', and exactly the prompt's latent rows must have moved. One server start
per direction.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest_sglang import tiny_mla_dir  # noqa: F401
from kvbridge.demo.mla_runner import TinyMLARunner
from kvbridge.demo.models import random_prompt, reference_generate
from kvbridge.demo.sglang_server import HOST, generate_body, generate_output, new_room, post_json, sglang_server
from kvbridge.demo.trt_engine import TRTEngine

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 32
TPB = 32
PROMPTS = [9, 45]  # one block / two blocks of 32 tokens on the TensorRT-LLM side
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def runner(tiny_mla_dir):
    return TinyMLARunner(tiny_mla_dir)


def _row_bytes(runner, tokens: int) -> int:
    return runner.layers * runner.row * 4 * tokens  # layers x (kv_lora_rank + qk_rope_head_dim) x float32


def _assert_rows_match(runner, pool, blocks, prompt):
    """The pool's rows [ckv | k_pe] of every prompt position (written by SGLang's prefill
    through kvbridge) equal the runner's own prefill of the prompt, layer by layer."""
    own = runner.allocate_pool(tokens_per_block=TPB, num_blocks=len(blocks)).tensors[0]
    runner.prefill(prompt, own, TPB, list(range(len(blocks))))
    for layer in range(runner.layers):
        moved = torch.cat(runner.read_kv(pool, TPB, blocks, layer, len(prompt)), dim=-1)
        mine = torch.cat(runner.read_kv(own, TPB, list(range(len(blocks))), layer, len(prompt)), dim=-1)
        torch.testing.assert_close(moved, mine, rtol=1e-4, atol=1e-4, msg=lambda m: f"layer {layer}: {m}")


def test_sglang_prefill_to_trtllm_decode_mla(runner, tiny_mla_dir):
    pytest.importorskip("sglang")
    from kvbridge.adapters.trtllm.handle import Handle

    prompts = [random_prompt(n, seed=800 + n) for n in PROMPTS]
    refs = [reference_generate(tiny_mla_dir, p, MAX_NEW) for p in prompts]
    t0 = time.monotonic()
    with sglang_server(tiny_mla_dir, "prefill") as (srv, boot):
        t_up = time.monotonic() - t0
        eng = TRTEngine(runner, tiny_mla_dir, tokens_per_block=TPB, num_blocks=16, peer_timeout_s=3.0)
        try:
            assert eng.worker.layout.engine == "trtllm-mla" and eng.worker.layout.kv_factor == 1
            assert tuple(eng.pool.shape) == (16, runner.layers, 1, TPB * runner.row)
            for prompt, ref in zip(prompts, refs):
                room, rid = new_room(), next(_ids)
                t1 = time.monotonic()
                with ThreadPoolExecutor(1) as ex:
                    fut = ex.submit(post_json, srv.url + "/generate", generate_body(prompt, MAX_NEW, boot, room), 120)
                    handle = Handle("recv", room, bootstrap=f"{HOST}:{boot}", on_failure="fail").to_json()
                    req, done = eng.load(rid, prompt, MAX_NEW, handle, timeout_s=90)
                    res = fut.result()
                t_load = time.monotonic() - t1
                out = generate_output(res, srv, "SGLang prefill")
                assert done["verdict"] == "ok" and done["ok"], done
                rec = done.get("record") or {}
                assert rec.get("bytes") == _row_bytes(runner, len(prompt)), rec
                # the moved latent rows are what this runner computes for the prompt
                _assert_rows_match(runner, eng.pool, eng.kv_cache_manager.get_cache_indices(req), prompt)
                prefill_first = out["output_ids"][0]
                aux_first = done["aux"]["output_ids"][0]
                t2 = time.monotonic()
                toks, first_logits = eng.decode_loaded(req, MAX_NEW)
                t_dec = time.monotonic() - t2
                assert prefill_first == aux_first == ref.token_ids[0], (prefill_first, aux_first, ref.token_ids[0])
                assert toks == ref.token_ids, f"{len(prompt)}-token prompt: TRT decode {toks} != transformers {ref.token_ids}"
                torch.testing.assert_close(first_logits, ref.first_logits, rtol=1e-4, atol=1e-4)
                print(f"[sglang->trtllm mla] {len(prompt)}-token prompt: load {t_load:.2f}s "
                      f"({rec.get('bytes')} B), {MAX_NEW} tokens decoded from the pool in {t_dec:.2f}s")
        finally:
            eng.close()
    print(f"[sglang->trtllm mla] prefill server up in {t_up:.1f}s, test {time.monotonic() - t0:.1f}s")


def test_trtllm_prefill_to_sglang_decode_mla(runner, tiny_mla_dir):
    """The runner's prefill writes the TensorRT-LLM MLA pool; the connector serves it
    (first token as aux ``output_ids``); SGLang's REAL decode server on the kvbridge
    backend pulls the latent rows into its ``MLATokenToKVPool`` and decodes."""
    pytest.importorskip("sglang")
    from kvbridge.adapters.trtllm.handle import Handle
    from kvbridge.common.bootstrap import parse_address

    prompts = [random_prompt(n, seed=900 + n) for n in PROMPTS]
    refs = [reference_generate(tiny_mla_dir, p, MAX_NEW) for p in prompts]
    t0 = time.monotonic()
    with sglang_server(tiny_mla_dir, "decode") as (srv, _):
        t_up = time.monotonic() - t0
        # the connector's SGLang-compatible bootstrap server reports the decode's page size (1)
        eng = TRTEngine(runner, tiny_mla_dir, tokens_per_block=TPB, num_blocks=16, sglang_bootstrap_port=0,
                        sglang_page_size=1)
        try:
            _, boot = parse_address(eng.scheduler.bootstrap_address)
            for prompt, ref in zip(prompts, refs):
                room, rid = new_room(), next(_ids)
                t1 = time.monotonic()
                with ThreadPoolExecutor(1) as ex:
                    fut = ex.submit(post_json, srv.url + "/generate", generate_body(prompt, MAX_NEW, boot, room), 120)
                    first, logits, _ = eng.serve_prefill(rid, prompt, Handle("send", room).to_json(), timeout_s=90)
                    res = fut.result()
                dt = time.monotonic() - t1
                out = generate_output(res, srv, "SGLang decode")
                assert first == ref.token_ids[0]
                torch.testing.assert_close(logits, ref.first_logits, rtol=1e-4, atol=1e-4)
                got = out["output_ids"]
                assert got == ref.token_ids, f"{len(prompt)}-token prompt: SGLang decode {got} != transformers {ref.token_ids}"
                saved = eng.worker.finished_saves.get(rid) or {}
                rec = saved.get("record") or {}
                assert saved.get("ok") and rec.get("result") == "success", saved
                assert rec.get("bytes") == _row_bytes(runner, len(prompt)), rec
                print(f"[trtllm->sglang mla] {len(prompt)}-token prompt: prefill+handoff+{MAX_NEW} tokens in {dt:.2f}s "
                      f"({rec.get('bytes')} B, plan {rec.get('plan')}, {rec.get('segments')} segments)")
        finally:
            eng.close()
    print(f"[trtllm->sglang mla] decode server up in {t_up:.1f}s, test {time.monotonic() - t0:.1f}s")
