"""Unit check of the demo's TinyLlamaRunner (no server, no transfer): prefill into a
TensorRT-LLM-geometry pool, then the paged decode loop reading K/V only from the pool,
equals transformers' greedy ``generate()``; the pool holds exactly what transformers'
cache holds (post-RoPE K, V)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.demo.llama_runner import TinyLlamaRunner, pool_kv
from tests.helpers.tiny_models import assert_paged_decode_matches, random_prompt

MAX_NEW = 32
TPB = 32


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return TinyLlamaRunner(tiny_llama_dir)


@pytest.mark.parametrize("n", [5, 45])
def test_runner_prefill_and_paged_decode_match_transformers(runner, tiny_llama_dir, n):
    assert_paged_decode_matches(runner, tiny_llama_dir, n, MAX_NEW, TPB)


def test_pool_holds_what_transformers_cache_holds(runner, tiny_llama_dir):
    """K after RoPE and V, per layer and KV head, as transformers' DynamicCache (and
    SGLang's MHATokenToKVPool) store them."""
    from tests.helpers.tiny_models import _load

    prompt = random_prompt(40, seed=5)
    lay = runner.allocate_pool(tokens_per_block=TPB, num_blocks=8)
    runner.prefill(prompt, lay.tensors[0], TPB, [5, 2])
    ours = pool_kv(runner, lay.tensors[0], TPB, [5, 2], len(prompt))
    model = _load(tiny_llama_dir)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    for i, (k, v) in enumerate(ours):
        hk, hv = cache.layers[i].keys[0], cache.layers[i].values[0]  # [kv_heads, T, D]
        np.testing.assert_allclose(k, hk.transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v, hv.transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)
