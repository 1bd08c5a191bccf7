"""Unit tests of the TensorRT-LLM plugin's pieces: handles, settings, pool geometry and
which prefill ranks each decode rank pulls."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvbridge.adapters.trtllm import (BridgeConfig, ConfigError, Handle, HandleError, RankGeometry, decode_params,
                                      handle_of, layout_from_kv_cache_manager, pool_layout, prefill_params, pull_plan)
from kvbridge.adapters.trtllm.geometry import geometry_from_llm_args
from kvbridge.layout import LayoutError, tp_head_slice


def test_package_imports_without_tensorrt_llm_or_mooncake():
    code = ("import sys; sys.modules['tensorrt_llm'] = None; sys.modules['mooncake'] = None; "
            "import kvbridge.adapters.trtllm as t; assert not t.TRTLLM_AVAILABLE; print(t.TRTLLM_IMPORT_ERROR)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_handles_round_trip_and_refuse_garbage():
    h = Handle("recv", 42, prefill="tcp://10.0.0.1:18500", on_failure="fail")
    assert Handle.from_json(h.to_json()) == h
    req = SimpleNamespace(py_disaggregated_params=SimpleNamespace(opaque_state=h.to_json()))
    assert handle_of(req) == h
    assert handle_of(SimpleNamespace(py_disaggregated_params=None)) is None
    assert handle_of(SimpleNamespace(py_disaggregated_params=SimpleNamespace(opaque_state=b"\x00binary"))) is None
    p = decode_params(7, endpoints=["tcp://a:1", "tcp://b:2"])
    assert p["request_type"] == "context_and_generation"
    assert json.loads(base64.b64decode(p["encoded_opaque_state"])) == {
        "kvbridge": 1, "op": "recv", "room": 7, "endpoints": ["tcp://a:1", "tcp://b:2"]}
    assert json.loads(base64.b64decode(prefill_params(7)["encoded_opaque_state"]))["op"] == "send"
    for bad in (b'{"kvbridge": 1, "op": "recv", "room": 1}', b'{"kvbridge": 1, "op": "send", "room": -1}',
                b'{"kvbridge": 1, "op": "send", "room": 1, "x": 2}', b'{"kvbridge": 1, "op": "recv", "room": 1, '
                b'"endpoints": ["http://a"]}', b'{"kvbridge": 2, "op": "send", "room": 1}'):
        with pytest.raises(HandleError):
            Handle.from_json(bad)


def test_config_from_file_env_and_overrides(tmp_path):
    f = tmp_path / "kvb.json"
    f.write_text(json.dumps({"bus_port": 18500, "on_failure": "fail", "deadline_s": 5}))
    env = {"KVBRIDGE_TRTLLM_CONFIG": str(f), "KVBRIDGE_DEADLINE_S": "7.5", "KVBRIDGE_HOST": "10.1.2.3"}
    cfg = BridgeConfig.load({"tp_rank": 1}, environ=env)
    assert (cfg.bus_port, cfg.on_failure, cfg.deadline_s, cfg.host, cfg.tp_rank) == (18500, "fail", 7.5, "10.1.2.3", 1)
    assert cfg.handoff().deadline_s == 7.5
    with pytest.raises(ConfigError, match="unknown"):
        BridgeConfig.load({"nope": 1}, environ={})
    with pytest.raises(ConfigError, match="on_failure"):
        BridgeConfig.load({"on_failure": "retry"}, environ={})


@pytest.mark.parametrize("heads, tp, tpb, hd, dtype, mla", [(8, 2, 32, 128, torch.bfloat16, False),
                                                            (4, 4, 16, 64, torch.float16, False),
                                                            (1, 2, 64, 576, torch.uint8, True)])
def test_pool_layout_has_tensorrt_llm_geometry(heads, tp, tpb, hd, dtype, mla):
    """Every (layer, kv, block, token, head) address is where TensorRT-LLM's HND block puts it."""
    rank = tp - 1
    h = 1 if mla else tp_head_slice(heads, tp, rank)[1]
    kvf = 1 if mla else 2
    pool = torch.zeros(5, 3, kvf, h * tpb * hd, dtype=dtype)
    lay = pool_layout(pool, RankGeometry(tpb, 0 if mla else heads, tp, rank, "fp8" if dtype == torch.uint8 else ""))
    assert (lay.num_layers, lay.kv_factor, lay.num_heads, lay.head_dim, lay.tokens_per_block) == (3, kvf, h, hd, tpb)
    item = pool.element_size()
    view = pool.view(5, 3, kvf, h, tpb, hd)  # HND inside a block
    for blk, layer, kv, tok, head in [(0, 0, 0, 0, 0), (4, 2, kvf - 1, tpb - 1, h - 1), (2, 1, 0, 3, h // 2)]:
        addr = lay.base[layer, kv] + blk * lay.block_stride + tok * lay.token_stride + head * lay.head_stride
        assert addr == view[blk, layer, kv, head, tok].data_ptr(), (blk, layer, kv, tok, head)
    assert lay.head_bytes == hd * item
    if not mla:
        assert lay.head_offset == tp_head_slice(heads, tp, rank)[0]


def test_geometry_from_llm_args_and_from_the_kv_cache_manager():
    args = SimpleNamespace(model=None, kv_cache_config=SimpleNamespace(tokens_per_block=64, dtype="fp8"),
                           parallel_config=SimpleNamespace(tp_size=2))
    geo = geometry_from_llm_args(args, BridgeConfig(num_kv_heads=8, tp_rank=1))
    assert (geo.tokens_per_block, geo.tp_size, geo.tp_rank, geo.dtype, geo.total_kv_heads) == (64, 2, 1, "fp8", 8)
    with pytest.raises(ConfigError, match="attention data parallelism"):
        geometry_from_llm_args(SimpleNamespace(enable_attention_dp=True), BridgeConfig())
    pool = torch.zeros(4, 2, 2, 4 * 32 * 16, dtype=torch.bfloat16)
    mgr = SimpleNamespace(get_unique_primary_pool=lambda: pool, tokens_per_block=32, kv_factor=2, head_dim=16,
                          num_kv_heads_per_layer=[4, 4], total_num_kv_heads_per_layer=[8, 8], layer_offsets={0: 0, 1: 1})
    lay = layout_from_kv_cache_manager(mgr, tp_rank=1, tp_size=2)
    assert (lay.num_heads, lay.head_offset, lay.total_heads, lay.head_dim) == (4, 4, 8, 16)
    mgr.num_kv_heads_per_layer = [4, 2]
    with pytest.raises(LayoutError, match="one pool each"):
        layout_from_kv_cache_manager(mgr, tp_rank=1, tp_size=2)


@pytest.mark.parametrize("heads, ptp, dtp", [(4, 2, 1), (4, 1, 2), (4, 2, 4), (4, 4, 2), (1, 2, 1), (1, 1, 4),
                                             (1, 4, 2), (4, 8, 2), (4, 2, 8), (8, 8, 8)])
def test_pull_plans_cover_every_head_and_every_prefill_rank(heads, ptp, dtp):
    pulled = {p: 0 for p in range(ptp)}
    for d in range(dtp):
        plan = pull_plan(heads, ptp, dtp, d)
        d0, dn = tp_head_slice(heads, dtp, d)
        got = set()
        for p in plan.ranks:
            p0, pn = tp_head_slice(heads, ptp, p)
            got |= set(range(max(p0, d0), min(p0 + pn, d0 + dn)))
            pulled[p] += 1
        assert got == set(range(d0, d0 + dn)), (d, plan)
    assert all(n > 0 for n in pulled.values()), pulled  # no prefill rank is left waiting
    for d in range(dtp):  # each prefill rank is told the number of decode ranks that really pull it
        plan = pull_plan(heads, ptp, dtp, d)
        assert all(pulled[p] == plan.receivers for p in plan.ranks), (d, plan, pulled)


def test_cost_gate_settings(tmp_path):
    """Off by default; on with a link; the model from cost_model or the served model's config."""
    assert BridgeConfig.load(environ={}).cost_gate() is None
    env = {"KVBRIDGE_COST_LINK": "tcp", "KVBRIDGE_COST_MODEL": "llama3-8b", "KVBRIDGE_COST_QUEUE_S": "0.25"}
    gate = BridgeConfig.load(environ=env).cost_gate()
    assert gate.model.name == "llama3-8b" and gate.link.name == "tcp" and gate.break_even is not None
    served = tmp_path / "model"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                                    "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert BridgeConfig(cost_link="nvlink").cost_gate(str(served)).model.layers == 2
    with pytest.raises(ConfigError, match="no model geometry"):
        BridgeConfig(cost_link="tcp").cost_gate(None)
    with pytest.raises(ConfigError, match="unknown link"):
        BridgeConfig(cost_link="carrier-pigeon", cost_model="llama3-8b").cost_gate()
    with pytest.raises(ConfigError, match="cost_queue_s must be >= 0"):
        BridgeConfig(cost_queue_s=-1.0)
    with pytest.raises(ConfigError, match="cost_prefill_tps"):
        BridgeConfig.load(environ={"KVBRIDGE_COST_PREFILL_TPS": "fast"})
