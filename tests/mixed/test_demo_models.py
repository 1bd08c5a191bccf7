"""The demo's model choice (``kvbridge demo --model llama|mla``) without servers: the
cached build, what its KV holds per token (the bytes the demo expects to move), and the
runner each kind gets."""

from __future__ import annotations

import json

import pytest


def test_model_info_counts_kv_bytes_per_token(tiny_llama_dir, tiny_mla_dir):  # noqa: F811
    from kvbridge.demo.run import _model_info

    llama = _model_info(tiny_llama_dir)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert llama["attention"] == "GQA"
    assert llama["kv_bytes_per_token"] == cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    mla = _model_info(tiny_mla_dir)
    cfg = json.loads((tiny_mla_dir / "config.json").read_text())
    assert mla["attention"] == "MLA" and mla["kv_factor"] == 1
    # one latent row per token and layer: [kv_lora_rank | qk_rope_head_dim] float32, as both pools store it
    assert mla["kv_bytes_per_token"] == cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4


def test_tiny_models_are_built_once_into_the_cache(tmp_path):
    from kvbridge.demo.run import DemoError, ensure_tiny_model

    path, built = ensure_tiny_model("mla", tmp_path)
    assert built and (path / "config.json").is_file()
    assert json.loads((path / "config.json").read_text())["kv_lora_rank"] > 0
    again, built_again = ensure_tiny_model("mla", tmp_path)
    assert again == path and not built_again
    with pytest.raises(DemoError, match="unknown demo model 'gpt'"):
        ensure_tiny_model("gpt", tmp_path)


def test_demo_cli_takes_the_model_kind():
    from kvbridge.cli import build_parser

    args = build_parser().parse_args(["demo", "--model", "mla", "--reverse", "--json"])
    assert args.model == "mla" and args.reverse and args.json
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--model", "gpt"])
