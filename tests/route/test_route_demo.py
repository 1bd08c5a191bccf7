"""``kvbridge demo --router --json`` as a user runs it: an SGLang prefill and decode, the
TensorRT-LLM decode stand-in behind trtllm-serve's HTTP shape, ``kvbridge route`` in
front, the ``openai`` client; every answer checked here against transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbridge.demo.models import random_prompt, reference_generate

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]


def test_demo_router_command_json(tiny_llama_dir):
    if os.environ.get("KVBRIDGE_SKIP_SGLANG_SERVER"):
        pytest.skip("KVBRIDGE_SKIP_SGLANG_SERVER is set")
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    from tests.helpers import sglang_servers

    sglang_servers.stop_shared()  # room for the demo's three servers
    cmd = [sys.executable, "-m", "kvbridge.cli", "demo", "--router", "--json", "--model-dir", str(tiny_llama_dir),
           "--prompt-len", "40", "--max-new", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=800)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, f"rc {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    r = json.loads(lines[0])
    assert out.returncode == 0 and r["match"] is True, json.dumps(r)[:3000]
    seen = set()
    for q in r["requests"]:
        n = q["prompt_len"]
        ref = reference_generate(tiny_llama_dir, random_prompt(n, seed=600 + n), 8).token_ids
        assert q["generated_ids"] == ref, q
        seen.add((q["route"], q["mode"]))
    # both decodes took a handoff from SGLang, and the short prompt was computed by the TensorRT-LLM decode
    assert {("sglang->sglang", "disaggregated"), ("sglang->trtllm", "disaggregated"), ("trtllm", "recomputed")} <= seen, seen
    assert r["metrics"]["kvbridge_route_recomputed_total"] == {"route=trtllm,why=below_break_even": 1.0}
