"""The tiny models moved into the library (``kvbridge.demo.models``); the tests import
them from here as before."""

from kvbridge.demo.models import (  # noqa: F401
    BOS_ID,
    EOS_ID,
    FIRST_WORD_ID,
    LLAMA_DEFAULTS,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    Reference,
    build_tiny_llama,
    build_tiny_mla,
    load_model,
    random_prompt,
    reference_generate,
)

_load = load_model


def assert_paged_decode_matches(runner, model_dir, n: int, max_new: int, tpb: int) -> None:
    """A ``PagedRunner``'s prefill of an ``n``-token prompt into out-of-order blocks of its
    own pool, then its paged decode reading only that pool, gives transformers' greedy
    tokens and first-step logits (within 1e-4)."""
    import torch

    prompt = random_prompt(n, seed=1000 + n)
    ref = reference_generate(model_dir, prompt, max_new)
    pool = runner.allocate_pool(tokens_per_block=tpb, num_blocks=16).tensors[0]
    blocks = [11, 3, 7]  # out of order, not from 0: the runner must address blocks, not slots
    first, logits = runner.prefill(prompt, pool, tpb, blocks)
    rest, _ = runner.decode(first, n, max_new - 1, pool, tpb, blocks)
    got = [first] + rest
    assert got == ref.token_ids, f"runner {got} != transformers {ref.token_ids}"
    torch.testing.assert_close(logits, ref.first_logits, rtol=1e-4, atol=1e-4)
