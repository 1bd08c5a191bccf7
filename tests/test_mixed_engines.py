"""Decode continues from KV moved between engines of different kinds (issue 6), through
the plugins: ``kvbridge demo --json`` and ``kvbridge demo --reverse --json``, run as the
user runs them (a subprocess), each with one more prompt through the same servers.

SGLang prefill -> TensorRT-LLM decode: SGLang's REAL prefill server on the kvbridge
backend computes the prompt; the "TensorRT-LLM" decode rank (``kvbridge.demo.trt_engine``:
the kvbridge TensorRT-LLM connector driven in the executor's order over a pool of
TensorRT-LLM's geometry) gets only the prefill's SGLang bootstrap address in its handle,
finds the prefill rank itself (GET /kvbridge/ranks), pulls the prompt's KV into its
pool, and the paged decode loop continues from the pool alone.

TensorRT-LLM prefill -> SGLang decode: the runner's prefill writes the TensorRT-LLM pool;
the connector serves it and, configured with ``sglang_bootstrap_port``, runs the
SGLang-compatible bootstrap server through which SGLang's REAL decode server on the
kvbridge backend finds it; SGLang decodes.

Either way greedy tokens must equal transformers' generate() on the same weights, the
first token must agree on both sides, the first-step logits must match transformers',
and exactly the prompt's KV bytes must have moved, staged into few segments.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest_sglang import tiny_llama_dir  # noqa: F401

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPT, ALSO, MAX_NEW = 70, 7, 32  # three blocks / one block of 32 tokens on the TensorRT-LLM side


def _kv_bytes(tokens: int) -> int:
    return 2 * 2 * 2 * 16 * 4 * tokens  # layers x K/V x KV heads x head_dim x float32


def _demo(model_dir, *extra) -> dict:
    pytest.importorskip("sglang")
    cmd = [sys.executable, "-m", "kvbridge.cli", "demo", "--json", "--model-dir", str(model_dir), "--prompt-len",
           str(PROMPT), "--max-new", str(MAX_NEW), "--also", str(ALSO), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert out.stdout.strip(), f"no JSON on stdout (rc {out.returncode}):\n{out.stderr[-4000:]}"
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON object, got {len(lines)} lines:\n{out.stdout[:2000]}"
    report = json.loads(lines[0])
    assert out.returncode == (0 if report.get("match") else 1), (out.returncode, out.stderr[-4000:])
    assert "error" not in report, report["error"]
    print(f"[{report['direction']}] {report['bytes']} B, {report['segments']} segments ({report['plan']}), "
          f"handoff {report['handoff_s'] * 1e3:.1f} ms, server up in {report['server']['ready_s']:.1f}s, "
          f"demo {report['seconds']:.1f}s")
    return report


def _check_common(r: dict) -> None:
    assert r["match"] is True, f"{r['generated_ids']} != transformers {r['reference_ids']}"
    assert r["generated_ids"] == r["reference_ids"] and len(r["generated_ids"]) == MAX_NEW
    ft = r["first_token"]
    assert ft["prefill"] == ft["decode_received"] == ft["reference"] == r["reference_ids"][0], ft
    assert r["first_logits_max_abs_diff"] < 1e-4
    # exactly the prompt's KV, staged into a few segments instead of one per head and token
    assert r["bytes"] == r["bytes_expected"] == _kv_bytes(PROMPT)
    assert r["plan"] == "staged_send" and 1 <= r["segments"] <= 16, (r["plan"], r["segments"])
    assert "staged_send" in r["plan_reason"] and "direct" in r["plan_reason"]
    assert r["gbps"] > 0 and 0 < r["handoff_s"] < 60
    assert r["record"]["result"] == "success"
    cm = r["cost_model"]
    assert cm["kv_bytes"] == r["bytes"] and cm["predicted_handoff_s"] > 0 and isinstance(cm["move"], bool)
    assert cm["verdict"].startswith(("MOVE", "RECOMPUTE"))
    (also,) = r["checks"]
    assert also["prompt_len"] == ALSO and also["match"] is True and also["bytes"] == _kv_bytes(ALSO)
    assert also["first_logits_max_abs_diff"] < 1e-4


def test_sglang_prefill_to_trtllm_decode(tiny_llama_dir):
    r = _demo(tiny_llama_dir)
    assert (r["prefill_engine"], r["decode_engine"], r["direction"]) == ("sglang", "trtllm", "sglang->trtllm")
    _check_common(r)
    assert r["record"]["role"] == "receiver"
    assert "same kind and segments" in r["plan_reason_source"], r["plan_reason_source"]


def test_trtllm_prefill_to_sglang_decode(tiny_llama_dir):
    r = _demo(tiny_llama_dir, "--reverse")
    assert (r["prefill_engine"], r["decode_engine"], r["direction"]) == ("trtllm", "sglang", "trtllm->sglang")
    _check_common(r)
    assert r["record"]["role"] == "sender" and r["record"]["plan_reason"] == r["plan_reason"]
    assert r["wire_gbps"] and r["wire_gbps"] > 0
