"""vLLM's REAL server with multi-head latent attention (CPU_MLA) on either side of a handoff.

vLLM's CPU backend serves MLA (``CPU_MLA``) for one latent width only, kv_lora_rank 512 +
rope 64, in blocks of 16: a tiny DeepSeek-V3-style model of that shape is served by two
vLLM servers (``kv_both``, started for this module) and by SGLang's real servers (the
kvbridge backend, one pair): vLLM -> vLLM, SGLang prefill -> vLLM decode and vLLM prefill
-> SGLang decode. The decode's tokens must equal transformers' ``generate()``; a vLLM
decode loads every prompt token (vLLM's ``external_kv_transfer`` count); the bytes moved
are the prompt's latent rows (576 float32 per token and layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.demo.models import build_tiny_mla_576, random_prompt, reference_generate
from tests.helpers.vllm_env import requires_vllm, vllm_pair

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

ROW = 2 * 576 * 4  # layers x latent x float32, per token
MAX_NEW = 8


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory) -> Path:
    return build_tiny_mla_576(tmp_path_factory.mktemp("vllm-mla") / "tiny-mla-576")


@pytest.fixture(scope="module")
def mla_servers(mla_dir, tmp_path_factory):
    with vllm_pair(mla_dir, tmp_path_factory.mktemp("vllm-mla-logs"), block_size=16) as servers:
        yield servers


def reference(mla_dir, n):
    prompt = random_prompt(n, seed=700 + n)
    return prompt, reference_generate(mla_dir, prompt, MAX_NEW).token_ids


def test_vllm_mla_to_vllm_mla(mla_dir, mla_servers):
    from kvbridge.demo.vllm_flows import vllm_to_vllm

    for n in (50, 17):
        prompt, ref = reference(mla_dir, n)
        r = vllm_to_vllm(mla_servers[0], mla_servers[1], prompt, MAX_NEW)
        assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
        assert r["external_tokens"] == n
        rec = r["send"]["record"]
        assert r["send"]["ok"] and rec["bytes"] == n * ROW and rec["plan"] == "direct", rec


def test_sglang_mla_and_vllm_mla(mla_dir, mla_servers):
    """SGLang prefill -> vLLM decode, then vLLM prefill -> SGLang decode, on MLA."""
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    from tests.helpers.sglang_pairs import get_pair
    from kvbridge.demo.vllm_flows import sglang_to_vllm, vllm_to_sglang

    pair = get_pair("kvbridge", model_dir=mla_dir, extra_env={"SGLANG_PLUGINS": "kvbridge"})
    prompt, ref = reference(mla_dir, 40)
    r = sglang_to_vllm(pair.prefill, pair.bootstrap_port, mla_servers[1], prompt, MAX_NEW)
    assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
    assert r["external_tokens"] == 40 and r["load"]["ok"] and r["load"]["record"]["bytes"] == 40 * ROW, r["load"]
    r = vllm_to_sglang(mla_servers[0], pair.decode, prompt, MAX_NEW)
    assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
    rec = r["send"]["record"]
    assert r["send"]["ok"] and rec["bytes"] == 40 * ROW, rec
