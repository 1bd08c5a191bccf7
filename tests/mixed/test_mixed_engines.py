"""Decode continues from KV moved between engines of different kinds, through the plugins:
the demo's flow (``kvbridge.demo.run.run_demo``) with SGLang's REAL server on one side and
the TensorRT-LLM executor stand-in (``kvbridge.demo.trtllm``, versions 1.2 and main) on
the other, each with one more prompt through the same servers (the TensorRT-LLM -> SGLang
runs share one SGLang decode, ``sglang_decode`` of tests/mixed/conftest.py); plus the demo
as a user runs it (``kvbridge demo --json``, a subprocess) once.

SGLang prefill -> TensorRT-LLM decode: SGLang computes the prompt; the router's part
(``announce``) tells the TensorRT-LLM decode's connector which handoff the prompt
belongs to (only the prefill's SGLang bootstrap address), the connector finds the
prefill rank itself and pulls the KV; the engine computes only the last prompt token.
TensorRT-LLM prefill -> SGLang decode: the stand-in computes the prompt and serves it
through the connector's SGLang-compatible bootstrap server to SGLang's real decode.

Checked here, not taken from the report: the generated tokens against transformers'
``generate()`` run in this process, the first token, the first-step logits, and the
bytes moved against the model's KV size.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvbridge.demo.models import random_prompt, reference_generate

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPT, ALSO, MAX_NEW, SEED = 70, 7, 32, 600


def _kv_bytes(tokens: int) -> int:
    return 2 * 2 * 2 * 16 * 4 * tokens  # layers x K/V x KV heads x head_dim x float32


def _check(r: dict, model_dir) -> None:
    """The report's claims, recomputed here."""
    for n, got, c in ((PROMPT, r["generated_ids"], None),) + tuple((c["prompt_len"], None, c) for c in r["checks"]):
        prompt = random_prompt(n, seed=SEED + n, vocab_size=r["model"]["vocab"])
        ref = reference_generate(model_dir, prompt, MAX_NEW)
        if c is None:
            assert r["prompt_ids"] == prompt
            assert got == ref.token_ids, f"{got} != transformers {ref.token_ids}"
            ft = r["first_token"]
            assert ft["prefill"] == ft["decode_received"] == ref.token_ids[0], ft
            # the engine's own first-step logits against transformers', differenced here
            diff = float((torch.tensor(r["first_logits"]) - ref.first_logits).abs().max())
            assert diff < 1e-4 and r["first_logits_max_abs_diff"] == pytest.approx(diff, abs=1e-6), (diff, r)
        else:
            assert c["generated_ids"] == ref.token_ids and c["bytes"] == _kv_bytes(n), c
    # exactly the prompt's KV, staged into a few segments instead of one per head and token
    assert r["bytes"] == _kv_bytes(PROMPT)
    assert r["plan"] == "staged_send" and 1 <= r["segments"] <= 16, (r["plan"], r["segments"])
    assert "staged_send" in r["plan_reason"] and "direct" in r["plan_reason"]
    assert r["record"]["result"] == "success" and 0 < r["handoff_s"] < 60
    cm = r["cost_model"]
    assert cm["kv_bytes"] == r["bytes"] and cm["predicted_handoff_s"] > 0 and isinstance(cm["move"], bool)


def _run(model_dir, **kw) -> dict:
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    from kvbridge.demo.run import run_demo

    return run_demo(model_dir=model_dir, prompt_len=PROMPT, max_new=MAX_NEW, seed=SEED, extra_prompt_lens=(ALSO,), **kw)


@pytest.mark.parametrize("version", ["1.2", "main"])
def test_sglang_prefill_to_trtllm_decode(tiny_llama_dir, version):
    r = _run(tiny_llama_dir, trtllm_version=version)
    assert (r["prefill_engine"], r["decode_engine"], r["trtllm_version"]) == ("sglang", "trtllm", version)
    _check(r, tiny_llama_dir)
    assert r["context_tokens_computed"] == 1, "the decode computes only the last prompt token"
    assert r["record"]["role"] == "receiver"
    assert "same kind and segments" in r["plan_reason_source"], r["plan_reason_source"]


@pytest.mark.parametrize("version", ["1.2", "main"])
def test_trtllm_prefill_to_sglang_decode(tiny_llama_dir, sglang_decode, version):
    r = _run(tiny_llama_dir, reverse=True, trtllm_version=version, sglang_decode=sglang_decode(tiny_llama_dir))
    assert (r["prefill_engine"], r["decode_engine"], r["trtllm_version"]) == ("trtllm", "sglang", version)
    _check(r, tiny_llama_dir)
    assert r["context_tokens_computed"] == PROMPT
    assert r["record"]["role"] == "sender" and r["record"]["plan_reason"] == r["plan_reason"]


def test_trtllm_layerwise_prefill_to_sglang_decode(tiny_llama_dir, sglang_decode):
    """The TensorRT-LLM prefill with layer-wise sends on: each layer of the prompt
    goes from ``save_kv_layer`` while the next computes, the sampled first token follows with
    the sender's ``finish``; SGLang's real decode continues from it."""
    r = _run(tiny_llama_dir, reverse=True, trtllm_version="main", trtllm_settings={"layerwise": True},
             sglang_decode=sglang_decode(tiny_llama_dir))
    assert (r["prefill_engine"], r["decode_engine"]) == ("trtllm", "sglang")
    _check(r, tiny_llama_dir)
    assert r["context_tokens_computed"] == PROMPT
    assert r["sender_layer_pieces"] == 2 and r["sender_ended_by"] == "finish", r["record"]


def test_sglang_layerwise_prefill_to_trtllm_decode(tiny_llama_dir):
    """SGLang's real prefill with layer-wise sends on: each layer of the prompt goes
    from the hooked ``set_kv_buffer`` while the next computes, the first token follows with
    the sender's ``finish``; the TensorRT-LLM stand-in's decode continues from it."""
    r = _run(tiny_llama_dir, trtllm_version="main", sglang_settings={"layerwise": True})
    assert (r["prefill_engine"], r["decode_engine"]) == ("sglang", "trtllm")
    _check(r, tiny_llama_dir)
    assert r["context_tokens_computed"] == 1, "the decode computes only the last prompt token"
    assert r["sender_layer_pieces"] == 2 and r["sender_ended_by"] == "finish", r["record"]


def test_demo_command_json(tiny_llama_dir):
    """``kvbridge demo --json`` as a user runs it: one JSON object on stdout, exit code 0
    when it matched; its tokens checked here against transformers."""
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    cmd = [sys.executable, "-m", "kvbridge.cli", "demo", "--json", "--model-dir", str(tiny_llama_dir), "--prompt-len",
           str(PROMPT), "--max-new", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON object (rc {out.returncode}):\n{out.stdout[:2000]}\n{out.stderr[-3000:]}"
    r = json.loads(lines[0])
    ref = reference_generate(tiny_llama_dir, r["prompt_ids"], 8).token_ids
    assert r["generated_ids"] == ref and out.returncode == 0 and r["match"] is True, (r["generated_ids"], ref)
    assert r["trtllm_version"] == "1.2" and r["real_servers"] == ["sglang"]
    assert torch.tensor(r["reference_ids"]).tolist() == ref
