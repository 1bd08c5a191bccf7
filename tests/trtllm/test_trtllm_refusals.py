"""Configurations the TensorRT-LLM plugin refuses at start-up, by name, through both
versions of the stand-in (TensorRT-LLM's ``create_py_executor`` builds the connector, and
the rank's error reaches the server's start), and settings that reach every rank whatever
started it (adapters/trtllm/README.md, "Will refuse" and "Settings")."""

from __future__ import annotations

import os
import socket

import pytest

from kvbridge.adapters.trtllm import Handle, announce
from kvbridge.adapters.trtllm.config import BridgeConfig, ConfigError, agree_with_rank0, settings_environ
from kvbridge.demo.models import random_prompt, reference_generate
from kvbridge.demo.trtllm.server import StandInError
from tests.helpers.trtllm_servers import check_clean, wait_done

VERSIONS = ["1.2", "main"]


@pytest.mark.parametrize("version", VERSIONS)
def test_host_cache_offloading_is_refused(trt_servers, tiny_llama_dir, version):
    """1.2 lets a connector run with host offloading (main refuses it later, in
    ``_maybe_init_kv_connector_manager``): the plugin refuses it first, on both."""
    with pytest.raises(StandInError, match=r"kv_cache_config.host_cache_size \(host offloading\) is set"):
        trt_servers(version, tiny_llama_dir, num_blocks=8, host_cache_size=1 << 30)


@pytest.mark.parametrize("version", VERSIONS)
def test_flashinfer_turns_block_reuse_off_and_is_refused(trt_servers, tiny_llama_dir, version):
    """``create_py_executor`` turns block reuse off for FLASHINFER with a warning only; a
    decode server would never load: refused, naming the backend."""
    with pytest.raises(StandInError, match=r"block reuse is off \(the FLASHINFER attention backend\)"):
        trt_servers(version, tiny_llama_dir, num_blocks=8, attn_backend="FLASHINFER")


def test_force_deterministic_turns_block_reuse_off_and_is_refused(trt_servers, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("FORCE_DETERMINISTIC", "1")  # the ranks inherit it
    with pytest.raises(StandInError, match=r"block reuse is off \(FORCE_DETERMINISTIC=1\)"):
        trt_servers("1.2", tiny_llama_dir, num_blocks=8)


def test_block_reuse_off_is_refused(trt_servers, tiny_llama_dir):
    """TensorRT-LLM asks a connector for matched tokens on the block-reuse path only."""
    with pytest.raises(StandInError, match=r"block reuse is off \(kv_cache_config.enable_block_reuse: false\).*"
                                           r"never load a handoff"):
        trt_servers("main", tiny_llama_dir, num_blocks=8, enable_block_reuse=False)


def test_kv_cache_manager_v2_is_refused(trt_servers, tiny_llama_dir):
    with pytest.raises(StandInError, match="use_kv_cache_manager_v2 is on"):
        trt_servers("main", tiny_llama_dir, num_blocks=8, use_kv_cache_manager_v2=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("windows", [[64], [64, 8192]], ids=["sliding-window", "variable-windows"])
def test_sliding_window_attention_is_refused(trt_servers, tiny_llama_dir, version, windows):
    """A window shorter than ``max_seq_len`` (one for every layer, or per layer: VSWA) is
    refused at ``register_kv_caches`` from the KV cache manager's own window vector,
    before any request: not a room at a time when the first page id is -1."""
    with pytest.raises(StandInError, match=r"refuses sliding-window attention \(attention window\(s\) \[64\] < "
                                           r"max_seq_len 8192"):
        trt_servers(version, tiny_llama_dir, num_blocks=8, max_attention_window=windows)


def test_a_window_as_long_as_max_seq_len_is_no_sliding_window(trt_servers, tiny_llama_dir):
    """``max_attention_window`` at (or clamped to) ``max_seq_len`` is full attention: served."""
    s = trt_servers("1.2", tiny_llama_dir, num_blocks=8, max_attention_window=[1 << 20], max_seq_len=4096)
    assert s.info["free"] == 8


def _handoff(pre, dec, model_dir, room: int, n: int = 40):
    prompt = random_prompt(n, seed=room)
    ref = reference_generate(model_dir, prompt, 4).token_ids
    announce(pre.bus, prompt, Handle("send", room))
    announce(dec.bus, prompt, Handle("recv", room, prefill=pre.bus))
    pre.submit(prompt, 1)
    d = dec.submit(prompt, 4)
    wait_done([pre, dec], dec, [d])
    assert dec.responses[d]["output_token_ids"] == ref
    assert dec.state()["finished_loads"][d]["verdict"] == "ok"


def test_settings_in_env_overrides_reach_ranks_whose_environment_lost_them(trt_servers, tiny_llama_dir):
    """Ranks spawned by an MPI pool that forwards only ``TRTLLM*``/``TLLM*`` variables
    (``rank_env="filtered"``) see none of the process's ``KVBRIDGE_*``; the same settings
    in the LLM args' ``env_overrides`` (pickled to every rank) reach them all."""
    port = _free_port()
    lost = trt_servers("1.2", tiny_llama_dir, tp=2, num_blocks=16, rank_env="filtered", plugin={"deadline_s": 7.0})
    # the defaults: nothing arrived, the secret neither
    assert [(st["deadline_s"], st["secret"]) for st in (lost.state(r)["settings"] for r in range(2))] == [(60.0, False)] * 2
    lost.stop()
    pre = trt_servers("1.2", tiny_llama_dir, tp=2, num_blocks=16, rank_env="filtered",
                      env_overrides={"KVBRIDGE_DEADLINE_S": "7", "KVBRIDGE_BUS_PORT": str(port),
                                     "KVBRIDGE_SECRET": os.environ["KVBRIDGE_SECRET"]})  # the deployment's key
    assert pre.bus.endswith(f":{port}")
    assert [(st["deadline_s"], st["secret"]) for st in (pre.state(r)["settings"] for r in range(2))] == [(7.0, True)] * 2
    dec = trt_servers("main", tiny_llama_dir, num_blocks=16)
    _handoff(pre, dec, tiny_llama_dir, 301)
    check_clean(pre)


def test_a_rank_no_setting_reached_takes_rank0s(trt_servers, tiny_llama_dir):
    """Only rank 0 has the ``KVBRIDGE_*`` variables (ranks ``mpirun`` started without
    ``-x``), the deployment's secret among them: rank 1 takes rank 0's settings over MPI at
    start-up, so its bus messages are sealed with the same key and the handoff goes through."""
    pre = trt_servers("main", tiny_llama_dir, tp=2, num_blocks=16, rank_env="rank0", plugin={"deadline_s": 9.0})
    st = [pre.state(r)["settings"] for r in range(2)]
    assert st[0] == st[1] and st[1]["deadline_s"] == 9.0 and st[1]["secret"], st
    dec = trt_servers("1.2", tiny_llama_dir, num_blocks=16)
    _handoff(pre, dec, tiny_llama_dir, 302)


def test_a_page_index_that_is_not_a_block_fails_the_plan_naming_it():
    """Main's sliding window reports ``-1`` for pages the window passed: a plan over such
    ids is refused before a byte moves (``-1`` would address the pool's last block)."""
    from kvbridge.layout import CopySpec, LayoutError, allocate_pool

    src = allocate_pool("trtllm", layers=2, total_heads=2, head_dim=8, dtype="bf16", tokens_per_block=16, num_blocks=8, seed=1)
    dst = allocate_pool("trtllm", layers=2, total_heads=2, head_dim=8, dtype="bf16", tokens_per_block=16, num_blocks=8, seed=2)
    for sb, db, side in (([-1, 3, 4], [1, 2, 5], "source"), ([1, 2, 5], [6, -1, 7], "destination")):
        with pytest.raises(LayoutError, match=rf"{side} block ids \[-1\] outside the pool's valid ids"):
            CopySpec.build(src, sb, dst, db, (0, 40))


def test_ranks_with_settings_of_their_own_must_agree():
    """A rank whose own settings differ from rank 0's stops at start-up naming each setting
    (never its value); one on another host that received none cannot take rank 0's address."""
    rank0 = BridgeConfig.load(environ={"KVBRIDGE_DEADLINE_S": "9", "KVBRIDGE_SECRET": "s" * 32, "KVBRIDGE_HOST": "10.0.0.1"})
    same = BridgeConfig.load(environ={"KVBRIDGE_DEADLINE_S": "9", "KVBRIDGE_SECRET": "s" * 32, "KVBRIDGE_HOST": "10.0.0.2"})
    assert agree_with_rank0(same, True, rank0, True, 1, same_host=False) is same  # its own address is its own
    other = BridgeConfig.load(environ={"KVBRIDGE_DEADLINE_S": "5", "KVBRIDGE_SECRET": "t" * 32})
    with pytest.raises(ConfigError, match=r"rank 1's settings differ from rank 0's in deadline_s, secret:") as e:
        agree_with_rank0(other, True, rank0, True, 1, same_host=True)
    assert "s" * 32 not in str(e.value) and "t" * 32 not in str(e.value)
    none = BridgeConfig.load(environ={})
    assert not settings_environ(None, {}) and settings_environ(None, {"KVBRIDGE_DEADLINE_S": "9"})
    assert agree_with_rank0(none, False, rank0, True, 1, same_host=True) == rank0
    with pytest.raises(ConfigError, match="received none of its settings .* another host"):
        agree_with_rank0(none, False, rank0, True, 1, same_host=False)
    assert agree_with_rank0(none, False, BridgeConfig.load(environ={}), False, 1, same_host=False) == none


def test_env_overrides_feed_the_settings():
    class Args:
        env_overrides = {"KVBRIDGE_DEADLINE_S": "4", "OTHER": "x"}

    cfg = BridgeConfig.load(environ={"KVBRIDGE_DEADLINE_S": "3", "KVBRIDGE_QUIESCE_S": "0.25"}, llm_args=Args())
    assert cfg.deadline_s == 4.0 and cfg.quiesce_s == 0.25  # env_overrides win over the process's environment

    class Bad:
        env_overrides = ["KVBRIDGE_DEADLINE_S=4"]

    with pytest.raises(ConfigError, match="env_overrides must be a mapping"):
        BridgeConfig.load(environ={}, llm_args=Bad())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
