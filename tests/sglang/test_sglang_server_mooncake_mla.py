"""SGLang's real server pair on CPU serving a DeepSeek-V3-style MLA model, Mooncake backend (TCP).

The MLA pool is one latent row per token and layer (kv_lora_rank +
qk_rope_head_dim), kv_factor 1: the other geometry a transfer backend must
handle. Needs the test-only plugin in kvbridge/demo/sgl_shim/mla_torch_native (added by
sglang_servers for MLA models) because SGLang 0.5.23's torch_native backend
cannot run DeepSeek's MHA prefill method.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.tiny_models import random_prompt, reference_generate

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 16


@pytest.mark.parametrize("prompt_len", [4, 37, 300])
def test_mla_pair_matches_transformers(mooncake_mla_pair, tiny_mla_dir, prompt_len):
    prompt = random_prompt(prompt_len, seed=prompt_len)
    ref = reference_generate(tiny_mla_dir, prompt, MAX_NEW)
    got = mooncake_mla_pair.generate(prompt, MAX_NEW)
    assert got == ref.token_ids, (
        f"{prompt_len}-token prompt: pair {got} != transformers {ref.token_ids} "
        f"(smallest top-1/top-2 logit margin {min(ref.margins):.2e})"
    )


def test_mla_pair_concurrent_requests(mooncake_mla_pair, tiny_mla_dir):
    prompts = [random_prompt(n, seed=200 + n) for n in (5, 23, 64, 150)]
    refs = [reference_generate(tiny_mla_dir, p, MAX_NEW).token_ids for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: mooncake_mla_pair.generate(p, MAX_NEW), prompts))
    for p, got, ref in zip(prompts, outs, refs):
        assert got == ref, f"{len(p)}-token prompt (concurrent): pair {got} != transformers {ref}"
