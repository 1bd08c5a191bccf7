"""Unit check of demo/mla_runner.py (no server, no transfer): the tiny DeepSeek-V3 MLA
model's prefill into a TensorRT-LLM MLA pool, then the paged decode loop reading the
latent rows only from the pool, equals transformers' greedy ``generate()``; the pool
rows hold what transformers' cache holds (normalized compressed KV, RoPE'd k_pe) in
SGLang's ``MLATokenToKVPool`` order (k_pe interleaved as SGLang's DeepSeek rotary
leaves it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.demo.mla_runner import TinyMLARunner
from kvbridge.demo.models import load_model, random_prompt
from tests.helpers.tiny_models import assert_paged_decode_matches

MAX_NEW = 32
TPB = 32


@pytest.fixture(scope="module")
def runner(tiny_mla_dir):
    return TinyMLARunner(tiny_mla_dir)


def test_pool_geometry_is_trtllm_mla(runner):
    lay = runner.allocate_pool(tokens_per_block=TPB, num_blocks=4)
    pool = lay.tensors[0]
    assert tuple(pool.shape) == (4, 2, 1, TPB * (32 + 16))
    assert (lay.engine, lay.kv_factor, lay.num_heads, lay.head_dim) == ("trtllm-mla", 1, 1, 48)
    with pytest.raises(ValueError, match="MLA pool"):
        runner.read_kv(torch.zeros(4, 2, 2, TPB * 48), TPB, [0], 0, 3)
    with pytest.raises(ValueError, match="beyond the request's 1 blocks"):
        runner.read_kv(pool, TPB, [1], 0, TPB + 1)


@pytest.mark.parametrize("n", [5, 45])
def test_mla_runner_prefill_and_paged_decode_match_transformers(runner, tiny_mla_dir, n):
    assert_paged_decode_matches(runner, tiny_mla_dir, n, MAX_NEW, TPB)


def test_decode_reads_only_the_pool(runner):
    """Corrupting one pool row the decode needs changes its output; the rows of other
    blocks do not matter."""
    prompt = random_prompt(40, seed=9)
    pool = runner.allocate_pool(tokens_per_block=TPB, num_blocks=8).tensors[0]
    blocks = [5, 2]
    first, _ = runner.prefill(prompt, pool, TPB, blocks)
    snap = pool.clone()
    base, base_logits = runner.decode(first, len(prompt), 4, pool, TPB, blocks)
    pool.copy_(snap)
    pool[[0, 1, 3, 4, 6, 7]] = 123.0  # blocks the request does not own
    again, again_logits = runner.decode(first, len(prompt), 4, pool, TPB, blocks)
    assert again == base
    torch.testing.assert_close(again_logits, base_logits, rtol=0, atol=0)
    pool.copy_(snap)
    pool[2, 0, 0, 3 * 48: 4 * 48] += 5.0  # layer 0, prompt position 32 + 3
    _, bad_logits = runner.decode(first, len(prompt), 1, pool, TPB, blocks)
    assert (bad_logits - base_logits).abs().max() > 1e-3


def test_pool_rows_are_sglang_mla_rows(runner, tiny_mla_dir):
    """Per layer and token: [kv_a_layernorm(compressed kv) | RoPE'd k_pe]. transformers'
    cache holds the same latent ("keys") and k_pe ("values") with the rotary dims
    de-interleaved (cat(even, odd)); the pool keeps SGLang's interleaved order."""
    prompt = random_prompt(40, seed=5)
    pool = runner.allocate_pool(tokens_per_block=TPB, num_blocks=8).tensors[0]
    runner.prefill(prompt, pool, TPB, [5, 2])
    model = load_model(tiny_mla_dir)
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    R = runner.rope_dim
    deinterleave = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
    for i in range(runner.layers):
        ckv, k_pe = runner.read_kv(pool, TPB, [5, 2], i, len(prompt))
        hk, hv = cache.layers[i].keys[0, 0], cache.layers[i].values[0, 0]  # [T, 32], [T, 16]
        np.testing.assert_allclose(ckv.numpy(), hk.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(k_pe[:, deinterleave].numpy(), hv.numpy(), rtol=1e-5, atol=1e-5)


def test_k_pe_order_is_sglang_rotary(runner, monkeypatch):
    """The rope part of a pool row equals SGLang's own DeepSeek rotary embedding
    (``DeepseekScalingRotaryEmbedding``, ``is_neox_style = not rope_interleave``, as
    deepseek_v2.py builds it; its torch ``forward_native``) applied to the raw k_pe."""
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.layers.rotary_embedding import base as rope_base
        from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding
    # as on SGLang's CPU engine (SGLANG_USE_CPU_ENGINE, read at import): no CUDA/vllm kernel
    monkeypatch.setattr(rope_base, "_is_cpu", True)
    rp = runner.cfg.rope_parameters
    R = runner.rope_dim
    rot = DeepseekScalingRotaryEmbedding(R, R, 2048, int(rp["rope_theta"]), not runner.cfg.rope_interleave,
                                         float(rp["factor"]), torch.float32, beta_fast=int(rp["beta_fast"]),
                                         beta_slow=int(rp["beta_slow"]), mscale=float(rp["mscale"]),
                                         mscale_all_dim=float(rp["mscale_all_dim"]), device="cpu")
    g = torch.Generator().manual_seed(3)
    pos = torch.tensor([0, 1, 7, 40, 300])
    k_raw = torch.randn(len(pos), 1, R, generator=g)
    q_raw = torch.randn(len(pos), 1, R, generator=g)
    _, k_sgl = rot.forward_native(pos, q_raw.clone(), k_raw.clone())
    ours = runner._rope(k_raw[:, 0], pos)
    torch.testing.assert_close(ours, k_sgl[:, 0], rtol=1e-5, atol=1e-5)
