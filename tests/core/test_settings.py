"""One link description drives both the plan chooser and the cost model; one settings
reader for every engine plugin (kvbridge.common.settings)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbridge.adapters.sglang.config import SglangBridgeConfig
from kvbridge.adapters.trtllm.config import BridgeConfig
from kvbridge.adapters.vllm.config import VllmBridgeConfig
from kvbridge.common.costmodel import (LINK_PRESETS, ModelGeometry, decide, link_for_protocol, model_layout,
                                       request_plan, resolve_link)
from kvbridge.common.settings import BridgeSettings, ConfigError, read_settings
from kvbridge.layout import PlanCosts, PlanKind, allocate_pool, plan_transfer

SMALL = ModelGeometry("small", layers=2, kv_heads=4, head_dim=32, kv_factor=2, dtype_bytes=2, params=1e8, hidden=128,
                      attn_heads=4)


def test_tcp_preset_is_the_plan_default_and_each_protocol_has_a_preset():
    assert LINK_PRESETS["tcp"].plan_costs() == PlanCosts()
    assert link_for_protocol("rdma") is LINK_PRESETS["rdma"] and link_for_protocol("nvlink") is LINK_PRESETS["nvlink"]
    assert "nominal" in LINK_PRESETS["rdma"].source and "measured" in LINK_PRESETS["tcp"].source
    assert resolve_link("", "rdma") is LINK_PRESETS["rdma"] and resolve_link("nvlink", "tcp") is LINK_PRESETS["nvlink"]
    with pytest.raises(ValueError, match="carrier"):
        link_for_protocol("carrier")


@pytest.mark.parametrize("link", ["tcp", "nvlink"])
@pytest.mark.parametrize("held, prompt", [(0, 100), (0, 1000), (37, 2500)])
def test_cost_model_counts_the_segments_of_the_plan_it_would_run(link, held, prompt):
    """The verdict's segments and staging are those of plan_transfer between two real
    SGLang pools of the model's geometry (blocks handed out in order), not a rule of thumb."""
    pool = allocate_pool("sglang", layers=2, total_heads=4, head_dim=32, dtype="bf16", tokens_per_block=16,
                         num_blocks=prompt // 16 + 2, seed=1)
    blocks = np.arange(1, 1 + -(-prompt // 16))
    plan = plan_transfer(pool, blocks, pool, blocks, (held, prompt), kinds=(PlanKind.DIRECT, PlanKind.STAGED_SEND),
                         costs=LINK_PRESETS[link].plan_costs())
    d = decide(SMALL, LINK_PRESETS[link], prompt, held_tokens=held)
    assert d.details["segments"] == plan.num_segments == d.handoff.segments
    assert d.details["staged"] is (plan.kind is not PlanKind.DIRECT)
    assert d.handoff.bytes == plan.nbytes
    lay = model_layout(SMALL, prompt)
    assert request_plan(lay, lay, (held, prompt), LINK_PRESETS[link]).num_segments == plan.num_segments


def test_settings_reader_types_names_and_link():
    s = read_settings(BridgeSettings, {"peer_timeout_s": "4"}, environ={"KVBRIDGE_LINK": "nvlink",
                                                                        "KVBRIDGE_COST_GATE_ENABLED": "true"})
    assert s.peer_timeout_s == 4.0 and s.gate_on and s.handoff().costs == LINK_PRESETS["nvlink"].plan_costs()
    # no link: the preset of the protocol in use
    assert read_settings(BridgeSettings, environ={"KVBRIDGE_PROTOCOL": "rdma"}).handoff().costs == \
        LINK_PRESETS["rdma"].plan_costs()
    # a link alone costs the plans; the gate stays off
    s = read_settings(BridgeSettings, environ={"KVBRIDGE_LINK": "nvlink"})
    assert not s.gate_on and s.link_profile() is LINK_PRESETS["nvlink"] and s.make_cost_gate() is None
    with pytest.raises(ConfigError, match="unknown"):
        read_settings(BridgeSettings, {"peer_timout_s": 1}, environ={})
    with pytest.raises(ConfigError, match="boolean"):
        read_settings(BridgeSettings, environ={"KVBRIDGE_COST_GATE_ENABLED": "maybe"})
    with pytest.raises(ConfigError, match="link"):
        BridgeSettings(link="carrier-pigeon")


def test_link_file_from_bench_link(tmp_path):
    f = tmp_path / "link.json"
    f.write_text(json.dumps({"name": "here", "bandwidth_bytes_per_s": 3e9, "per_segment_s": 1e-5, "setup_s": 1e-3,
                             "repack_bytes_per_s": 6e9}))
    s = read_settings(BridgeSettings, environ={"KVBRIDGE_LINK": str(f)})
    assert s.handoff().costs == PlanCosts(segment_s=1e-5, wire_bytes_per_s=3e9, repack_bytes_per_s=6e9)
    # read once: the plan costs, the cost gate and the layer-wise chooser of these settings
    # keep the figures they started with, whatever happens to the file afterwards
    f.write_text(json.dumps({"name": "changed", "bandwidth_bytes_per_s": 1e9, "per_segment_s": 1e-4, "setup_s": 1e-3,
                             "repack_bytes_per_s": 2e9}))
    assert s.link_profile().name == "here"
    f.unlink()
    assert s.handoff().costs == PlanCosts(segment_s=1e-5, wire_bytes_per_s=3e9, repack_bytes_per_s=6e9)


def test_every_plugin_takes_the_link_from_the_same_setting():
    env = {"KVBRIDGE_LINK": "nvlink", "KVBRIDGE_VLLM_LINK": "nvlink"}
    want = LINK_PRESETS["nvlink"].plan_costs()
    assert BridgeConfig.load(environ=env).handoff().costs == want
    assert VllmBridgeConfig.load({}, environ=env).handoff(receiver=True).costs == want
    assert VllmBridgeConfig.load({"link": "nvlink"}, environ={}).handoff().costs == want
    assert SglangBridgeConfig.load(environ=env).handoff().costs == want
    # each keeps its own defaults
    assert BridgeConfig.load(environ={}).peer_timeout_s == 3.0 and VllmBridgeConfig.load({}, environ={}).peer_timeout_s == 5.0
    assert SglangBridgeConfig.load(environ={}).peer_timeout_s == 10.0
    with pytest.raises(ConfigError, match="vLLM"):
        VllmBridgeConfig.load({"cost_gate_enabled": True}, environ={})


def test_sglang_settings_keep_their_environment_names_and_defaults(tmp_path):
    env = {"KVBRIDGE_PEER_TIMEOUT_S": "2.5", "KVBRIDGE_SECRET": "s" * 16, "KVBRIDGE_MODEL": "m",
           "KVBRIDGE_RECV_STAGING_BYTES": "4096", "MOONCAKE_PROTOCOL": "rdma"}
    c = SglangBridgeConfig.load(ib_device="mlx5_0", sglang_timeout_s=42.0, environ=env)
    assert (c.peer_timeout_s, c.secret, c.model, c.deadline_s, c.protocol, c.device_name) == (2.5, "s" * 16, "m", 42.0, "rdma",
                                                                                              "mlx5_0")
    assert c.handoff(receiver=True).recv_staging_bytes == 4096 and c.handoff().recv_staging_bytes == 0
    assert c.link_profile() is LINK_PRESETS["rdma"]  # derived from the protocol in use
    assert SglangBridgeConfig.load(ib_device="mlx5_0", environ={}).protocol == "rdma"
    assert SglangBridgeConfig.load(environ={"MOONCAKE_PROTOCOL": "nvlink"}).protocol == "nvlink"
    assert SglangBridgeConfig.load(environ={}).protocol == "tcp"
    assert SglangBridgeConfig.load(ib_device="mlx5_0", environ={"MC_FORCE_TCP": "1"}).protocol == "tcp"
    assert SglangBridgeConfig.load(environ={**env, "KVBRIDGE_PROTOCOL": "tcp"}).protocol == "tcp"
    assert SglangBridgeConfig.load(environ={"KVBRIDGE_DEADLINE_S": "5"}, sglang_timeout_s=42.0).deadline_s == 5.0
    f = tmp_path / "kvbridge.yaml"
    f.write_text("link: nvlink\nheartbeat_s: 0.25\n")
    c = SglangBridgeConfig.load(environ={"KVBRIDGE_CONFIG": str(f)})
    assert c.heartbeat_s == 0.25 and c.link_profile() is LINK_PRESETS["nvlink"]
    with pytest.raises(ConfigError, match="cost_prefill_tps"):
        SglangBridgeConfig.load(environ={"KVBRIDGE_COST_PREFILL_TPS": "fast"})
