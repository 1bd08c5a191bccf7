"""SGLang's real server as a prefill/decode pair on CPU, with SGLang's own Mooncake backend (TCP).

The anchor for every other backend: greedy float32 outputs of the pair must
equal transformers' ``generate()`` on the same tiny model, token for token.
Servers start once per session (``tests.helpers.sglang_pairs``); the whole module takes
about a minute on 2 cores, most of it the server start.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.tiny_models import random_prompt, reference_generate

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 16
PROMPTS = [4, 37, 300]  # test_sglang_server_kvbridge.py checks the kvbridge pair on these too


def _check(pair, model_dir, prompt, max_new=MAX_NEW):
    ref = reference_generate(model_dir, prompt, max_new)
    t0 = time.monotonic()
    got = pair.generate(prompt, max_new)
    dt = time.monotonic() - t0
    assert got == ref.token_ids, (
        f"{len(prompt)}-token prompt: pair {got} != transformers {ref.token_ids} "
        f"(smallest top-1/top-2 logit margin {min(ref.margins):.2e})"
    )
    return dt


@pytest.mark.parametrize("prompt_len", PROMPTS)
def test_pair_matches_transformers(mooncake_pair, tiny_llama_dir, prompt_len):
    prompt = random_prompt(prompt_len, seed=prompt_len)
    dt = _check(mooncake_pair, tiny_llama_dir, prompt)
    print(f"[mooncake pair] {prompt_len}-token prompt, {MAX_NEW} new tokens: {dt:.2f}s "
          f"(pair start {mooncake_pair.start_seconds:.1f}s)")


def test_pair_concurrent_requests(mooncake_pair, tiny_llama_dir):
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 23, 64, 150)]
    refs = [reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids for p in prompts]
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: mooncake_pair.generate(p, MAX_NEW), prompts))
    dt = time.monotonic() - t0
    for p, got, ref in zip(prompts, outs, refs):
        assert got == ref, f"{len(p)}-token prompt (concurrent): pair {got} != transformers {ref}"
    print(f"[mooncake pair] 4 concurrent requests: {dt:.2f}s")


def test_pair_repeated_prompt_hits_prefill_cache(mooncake_pair, tiny_llama_dir):
    """The same prompt twice: the second prefill reuses its radix cache and must still transfer right."""
    prompt = random_prompt(48, seed=7)
    ref = reference_generate(tiny_llama_dir, prompt, MAX_NEW).token_ids
    first = mooncake_pair.generate_full(prompt, MAX_NEW)
    second = mooncake_pair.generate_full(prompt, MAX_NEW)
    assert first.output_ids == ref
    assert second.output_ids == ref
    first_cached = (first.prefill_json or {}).get("meta_info", {}).get("cached_tokens")
    cached = (second.prefill_json or {}).get("meta_info", {}).get("cached_tokens")
    # the radix cache held every prompt token but the last, which the prefill must compute
    assert first_cached == 0 and cached == len(prompt) - 1, (first_cached, cached)
