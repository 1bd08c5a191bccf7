"""vLLM's REAL server with multi-head latent attention (CPU_MLA) on both sides of a handoff.

vLLM's CPU backend serves MLA (``CPU_MLA``) for one latent width only, kv_lora_rank 512 +
rope 64, in blocks of 16: a tiny DeepSeek-V3-style model of that shape is served by a
prefill and a decode server (started for this module only), and the decode's tokens
must equal transformers' ``generate()``; the decode loads every prompt token (vLLM's
``external_kv_transfer`` count) and the bytes moved are the prompt's latent rows. The
latent cache moves across engines in the compatibility matrix (byte-exact).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.demo.models import build_tiny_mla_576, random_prompt, reference_generate
from vllm_env import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory) -> Path:
    return build_tiny_mla_576(tmp_path_factory.mktemp("vllm-mla") / "tiny-mla-576")


def test_vllm_mla_prefill_to_vllm_mla_decode(mla_dir, tmp_path):
    from kvbridge.demo.sglang_server import wait_healthy
    from kvbridge.demo.vllm_flows import vllm_to_vllm
    from kvbridge.demo.vllm_server import start_vllm_server

    kw = dict(log_dir=tmp_path, block_size=16, wait=False)
    servers = [start_vllm_server(mla_dir, "kv_producer", **kw), start_vllm_server(mla_dir, "kv_consumer", **kw)]
    try:
        wait_healthy(servers, 400, lambda: "\n".join(f"--- {s.log_path} ---\n{s.log_tail(40)}" for s in servers))
        for n in (50, 17):
            prompt = random_prompt(n, seed=700 + n)
            ref = reference_generate(mla_dir, prompt, 8).token_ids
            r = vllm_to_vllm(servers[0], servers[1], prompt, 8)
            assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
            assert r["external_tokens"] == n
            rec = r["send"]["record"]
            assert r["send"]["ok"] and rec["bytes"] == n * 2 * 576 * 4 and rec["plan"] == "direct", rec
    finally:
        for s in servers:
            s.kill()
