"""Tiny causal LMs for the demo and the engine tests, built offline from configs with seeded random weights.

Nothing is downloaded: each builder makes a transformers config, initialises
the model with a fixed seed, and saves model + a word-level
``PreTrainedTokenizerFast`` with ``save_pretrained`` into one folder that
SGLang (``--model-path``) and transformers can both load.

``reference_generate`` runs transformers' greedy ``generate()`` in-process; it
is the ground truth the engine outputs are compared with.

Weights are drawn with a larger std than transformers' default (0.02) so that
greedy decoding has clear winners: with near-flat logits two implementations
that differ only in float rounding could pick different argmaxes.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

# Token ids 0..3 are special; prompts should use ids >= FIRST_WORD_ID.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
FIRST_WORD_ID = len(SPECIAL_TOKENS)

# The defaults named in the tests' brief.
LLAMA_DEFAULTS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def _save_tokenizer(out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.decoders import WordPiece  # joins words with spaces
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(FIRST_WORD_ID, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.decoder = WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1 << 20,
    )
    fast.save_pretrained(str(out_dir))


def _init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Re-draw every weight deterministically (independent of transformers' init code)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() == 1:  # norms: around 1, not exactly, so they matter
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def _finish(model, config, out_dir: Path, dtype: torch.dtype, seed: int, std: float) -> Path:
    from transformers import GenerationConfig

    _init_weights(model, seed, std)
    model = model.to(dtype).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Greedy by default, no sampling knobs that an engine might read differently.
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.save_pretrained(str(out_dir))
    _save_tokenizer(out_dir, config.vocab_size)
    (out_dir / "kvbridge_tiny_model.json").write_text(
        json.dumps({"seed": seed, "std": std, "dtype": str(dtype), "arch": config.architectures})
    )
    return out_dir


def _build(config_cls, model_cls, kw: dict, out_dir, dtype: torch.dtype, seed: int, std: float) -> Path:
    """``model_cls`` from ``config_cls(**kw)`` with the tokenizer's special ids, seeded
    weights, saved to ``out_dir``."""
    config = config_cls(**kw, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                        tie_word_embeddings=False, architectures=[model_cls.__name__], dtype=dtype)
    torch.manual_seed(seed)
    return _finish(model_cls(config), config, Path(out_dir), dtype, seed, std)


def build_tiny_llama(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.25,
    **overrides,
) -> Path:
    """A 2-layer Llama with grouped-query attention (64 hidden, 4 heads, 2 KV heads, vocab 512)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(LLAMA_DEFAULTS)
    kw.update(overrides)
    return _build(LlamaConfig, LlamaForCausalLM, kw, out_dir, dtype, seed, std)


# vLLM's CPU attention serves head sizes 32, 64, 80, ... (not the default's 16): the
# same Llama, twice as wide (128 hidden, 4 heads of 32, 2 KV heads). SGLang and the
# TensorRT-LLM stand-in serve it too, so it is the model of every pair with vLLM in it.
VLLM_LLAMA = dict(hidden_size=128, intermediate_size=256)


def build_tiny_llama_hd32(out_dir: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                          std: float = 0.25, **overrides) -> Path:
    """``build_tiny_llama`` with head_dim 32 (``VLLM_LLAMA``): what vLLM's CPU backend serves."""
    return build_tiny_llama(out_dir, seed=seed, dtype=dtype, std=std, **{**VLLM_LLAMA, **overrides})


def build_tiny_mla(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.25,
    **overrides,
) -> Path:
    """A 2-layer DeepSeek-V3-style model with multi-head latent attention and dense MLPs only.

    ``kv_lora_rank`` 32 + ``qk_rope_head_dim`` 16 (so SGLang's MLA pool row is 48
    wide), no q LoRA, ``first_k_dense_replace`` = layers (no MoE). RoPE is given as
    yarn with factor 1 (= plain RoPE) because SGLang's CPU path only builds the
    DeepSeek yarn rotary; ``moe_layer_freq`` is added because SGLang reads it.
    SGLang serves it with --attention-backend torch_native only with the test
    plugin in sgl_shim/mla_torch_native beside this module (``kvbridge.demo.sglang_server`` adds it).
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=2048,
        rope_interleave=True,
        # read by SGLang's deepseek_v2.py, absent from transformers' DeepseekV3Config
        moe_layer_freq=1,
        # SGLang's CPU path builds DeepSeek MLA rotary embeddings only for
        # rope_type "deepseek_yarn" (it renames any rope scaling to that). Yarn with
        # factor 1 is plain RoPE in both SGLang and transformers.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    kw.update(overrides)
    return _build(DeepseekV3Config, DeepseekV3ForCausalLM, kw, out_dir, dtype, seed, std)


# vLLM's CPU MLA backend (CPU_MLA) serves one latent width only: kv_lora_rank 512 + rope 64
VLLM_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)


def build_tiny_mla_576(out_dir: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       std: float = 0.25, **overrides) -> Path:
    """``build_tiny_mla`` with a 576-wide latent row (``VLLM_MLA``): what vLLM's CPU MLA serves."""
    return build_tiny_mla(out_dir, seed=seed, dtype=dtype, std=std, **{**VLLM_MLA, **overrides})


class Reference(NamedTuple):
    """Greedy output of transformers' ``generate()``."""

    token_ids: list[int]  # the new tokens only (max_new_tokens of them; EOS does not stop it)
    first_logits: torch.Tensor  # [vocab] float32 logits of the first generated position
    margins: list[float]  # per step: top-1 minus top-2 logit (how safe the argmax is)


_models: dict[str, torch.nn.Module] = {}
_models_lock = threading.Lock()


def load_model(model_dir: str | os.PathLike):
    """The transformers model in ``model_dir`` (loaded once per process, eval mode)."""
    from transformers import AutoModelForCausalLM

    key = str(Path(model_dir).resolve())
    with _models_lock:
        if key not in _models:
            _models[key] = AutoModelForCausalLM.from_pretrained(key, dtype="auto").eval()
        return _models[key]


def reference_generate(
    model_dir: str | os.PathLike, input_ids: Sequence[int], max_new_tokens: int
) -> Reference:
    """transformers' greedy ``generate()`` for one prompt, in this process.

    EOS does not stop generation (engines are asked to ``ignore_eos`` likewise), so
    exactly ``max_new_tokens`` ids come back.
    """
    from transformers import GenerationConfig

    model = load_model(model_dir)
    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        # not None: transformers (5.x) fills a None from the model's generation_config
        # (eos 2), and generation then stops at the first EOS
        eos_token_id=[],
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg
        )
    new = out.sequences[0, ids.shape[1]:].tolist()
    logits = [step[0].float() for step in out.logits]
    margins = []
    for lg in logits:
        top2 = torch.topk(lg, 2).values
        margins.append(float(top2[0] - top2[1]))
    return Reference(token_ids=new, first_logits=logits[0], margins=margins)


def random_prompt(n: int, *, seed: int, vocab_size: int = 512) -> list[int]:
    """n word ids (never special tokens), reproducible from seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_WORD_ID, vocab_size, (n,), generator=g).tolist()


if __name__ == "__main__":  # python -m kvbridge.demo.models OUT_DIR [llama|mla]
    import sys

    which = sys.argv[2] if len(sys.argv) > 2 else "llama"
    builder = {"llama": build_tiny_llama, "mla": build_tiny_mla, "llama-hd32": build_tiny_llama_hd32}[which]
    path = builder(sys.argv[1])
    p = random_prompt(8, seed=1)
    print(path, p, reference_generate(path, p, 8).token_ids)
