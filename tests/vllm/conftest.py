"""vLLM's REAL servers shared by the modules here (package scope: started on first use,
stopped after the last module of tests/vllm), in the vLLM venv.

- ``model_dir``: the tiny GQA Llama with head_dim 32 (vLLM's CPU backend serves no smaller head).
- ``vllm_servers``: two vLLM servers of it, each prefill and decode (``kv_both``).
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory) -> Path:
    """The tiny GQA Llama with head_dim 32, built once for tests/vllm."""
    from kvbridge.demo.models import build_tiny_llama_hd32

    return build_tiny_llama_hd32(tmp_path_factory.mktemp("vllm") / "tiny-llama-hd32")


@pytest.fixture(scope="package")
def vllm_servers(model_dir, tmp_path_factory):
    """Two vLLM servers, each prefill and decode (kv_both), started together."""
    from tests.helpers.vllm_env import vllm_pair

    settings = {"discovery_timeout_s": 3.0, "deadline_s": 30.0}
    with vllm_pair(model_dir, tmp_path_factory.mktemp("vllm-logs"), settings=settings) as servers:
        yield servers
