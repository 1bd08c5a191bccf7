"""Decode continues from MLA KV moved between engines of different kinds: the tiny
DeepSeek-V3-style model (multi-head latent attention: one latent row per token and layer,
``kv_lora_rank + qk_rope_head_dim`` = 48 wide, kv_factor 1) through the demo's flow, both
ways, with SGLang's REAL server on one side and the TensorRT-LLM stand-in on the other
(version 1.2 one way, main the other); the TensorRT-LLM -> SGLang runs share one SGLang
decode (``sglang_decode`` of tests/mixed/conftest.py).

Checked here: greedy tokens (float32) against transformers' ``generate()``, the first
token on both sides, the first-step logits, and that exactly the prompt's latent rows
moved.
"""

from __future__ import annotations

import json

import pytest

from kvbridge.demo.models import random_prompt, reference_generate

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPT, ALSO, MAX_NEW, SEED = 45, 9, 32, 600


def _row_bytes(model_dir, tokens: int) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4 * tokens


@pytest.mark.parametrize("reverse,version", [(False, "1.2"), (True, "main")], ids=["sglang->trtllm", "trtllm->sglang"])
def test_mla_between_sglang_and_trtllm(tiny_mla_dir, sglang_decode, reverse, version):
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    from kvbridge.demo.run import run_demo

    r = run_demo(model_dir=tiny_mla_dir, prompt_len=PROMPT, max_new=MAX_NEW, seed=SEED, extra_prompt_lens=(ALSO,),
                 reverse=reverse, trtllm_version=version,
                 sglang_decode=sglang_decode(tiny_mla_dir) if reverse else None)
    assert r["model"]["attention"] == "MLA" and r["trtllm_version"] == version
    prompt = random_prompt(PROMPT, seed=SEED + PROMPT, vocab_size=r["model"]["vocab"])
    ref = reference_generate(tiny_mla_dir, prompt, MAX_NEW)
    assert r["prompt_ids"] == prompt and r["generated_ids"] == ref.token_ids, (r["generated_ids"], ref.token_ids)
    ft = r["first_token"]
    assert ft["prefill"] == ft["decode_received"] == ref.token_ids[0], ft
    assert r["first_logits_max_abs_diff"] < 1e-4
    assert r["bytes"] == _row_bytes(tiny_mla_dir, PROMPT) and r["record"]["result"] == "success"
    (also,) = r["checks"]
    also_ref = reference_generate(tiny_mla_dir, random_prompt(ALSO, seed=SEED + ALSO, vocab_size=r["model"]["vocab"]),
                                  MAX_NEW)
    assert also["generated_ids"] == also_ref.token_ids and also["bytes"] == _row_bytes(tiny_mla_dir, ALSO)
    assert r["context_tokens_computed"] == (PROMPT if reverse else 1)


@pytest.mark.parametrize("reverse", [False, True], ids=["sglang->trtllm", "trtllm->sglang"])
def test_mla_layerwise_between_sglang_and_trtllm(tiny_mla_dir, sglang_decode, reverse):
    """Layer-wise sends of MLA latent rows across engines: the prefill (SGLang's
    real server, or the TensorRT-LLM stand-in) hands each layer over as its forward writes
    it, the first token follows with ``finish``; the other engine decodes. Greedy tokens
    against transformers' ``generate()``, exactly the prompt's latent rows moved, one piece
    per layer of the one forward."""
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    from kvbridge.demo.run import run_demo

    side = {"trtllm_settings" if reverse else "sglang_settings": {"layerwise": True}}
    r = run_demo(model_dir=tiny_mla_dir, prompt_len=PROMPT, max_new=MAX_NEW, seed=SEED, reverse=reverse,
                 trtllm_version="main", sglang_decode=sglang_decode(tiny_mla_dir) if reverse else None, **side)
    assert r["model"]["attention"] == "MLA"
    assert (r["prefill_engine"], r["decode_engine"]) == (("trtllm", "sglang") if reverse else ("sglang", "trtllm"))
    prompt = random_prompt(PROMPT, seed=SEED + PROMPT, vocab_size=r["model"]["vocab"])
    ref = reference_generate(tiny_mla_dir, prompt, MAX_NEW)
    assert r["generated_ids"] == ref.token_ids, (r["generated_ids"], ref.token_ids)
    assert r["bytes"] == _row_bytes(tiny_mla_dir, PROMPT) and r["record"]["result"] == "success"
    layers = json.loads((tiny_mla_dir / "config.json").read_text())["num_hidden_layers"]
    assert r["sender_layer_pieces"] == layers and r["sender_ended_by"] == "finish", r["record"]
