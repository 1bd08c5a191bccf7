"""One link description drives both the plan chooser and the cost model; one settings
reader for every engine plugin (kvbridge.common.settings)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbridge.adapters.sglang.config import SglangBridgeConfig
from kvbridge.adapters.trtllm.config import BridgeConfig
from kvbridge.adapters.vllm.config import VllmBridgeConfig
from kvbridge.common import costmodel
from kvbridge.common.costmodel import LINK_PRESETS, ModelGeometry, decide, load_link, model_layout, request_estimate
from kvbridge.common.settings import BridgeSettings, ConfigError, handoff_config
from kvbridge.layout import PlanCosts, PlanKind, allocate_pool, plan_transfer

SMALL = ModelGeometry("small", layers=2, kv_heads=4, head_dim=32, kv_factor=2, dtype_bytes=2, params=1e8, hidden=128,
                      attn_heads=4)


def test_tcp_preset_is_the_plan_default_and_each_protocol_has_a_preset():
    assert LINK_PRESETS["tcp"].plan_costs() == PlanCosts()
    assert load_link("", "rdma") is LINK_PRESETS["rdma"] and load_link("", "nvlink") is LINK_PRESETS["nvlink"]
    assert "nominal" in LINK_PRESETS["rdma"].source and "measured" in LINK_PRESETS["tcp"].source
    assert load_link("nvlink", "tcp") is LINK_PRESETS["nvlink"] and load_link() is LINK_PRESETS["tcp"]
    with pytest.raises(ValueError, match="carrier"):
        load_link("", "carrier")


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
    assert request_estimate(lay, lay, (held, prompt), LINK_PRESETS[link]) == plan.estimates[plan.kind]


def test_settings_reader_types_names_and_link():
    s = BridgeSettings.load({"peer_timeout_s": "4"}, environ={"KVBRIDGE_LINK": "nvlink",
                                                              "KVBRIDGE_COST_GATE_ENABLED": "true"})
    assert s.peer_timeout_s == 4.0 and s.gate_on and s.handoff().costs == LINK_PRESETS["nvlink"].plan_costs()
    # no link: the preset of the protocol in use
    assert BridgeSettings.load(environ={"KVBRIDGE_PROTOCOL": "rdma"}).handoff().costs == \
        LINK_PRESETS["rdma"].plan_costs()
    # a link alone costs the plans; the gate stays off
    s = BridgeSettings.load(environ={"KVBRIDGE_LINK": "nvlink"})
    assert not s.gate_on and s.link_profile() is LINK_PRESETS["nvlink"] and s.cost_gate() is None
    with pytest.raises(ConfigError, match="unknown"):
        BridgeSettings.load({"peer_timout_s": 1}, environ={})
    with pytest.raises(ConfigError, match="boolean"):
        BridgeSettings.load(environ={"KVBRIDGE_COST_GATE_ENABLED": "maybe"})
    with pytest.raises(ConfigError, match="link"):
        BridgeSettings(link="carrier-pigeon")


def test_link_file_from_bench_link(tmp_path):
    f = tmp_path / "link.json"
    f.write_text(json.dumps({"name": "here", "bandwidth_bytes_per_s": 3e9, "per_segment_s": 1e-5, "setup_s": 1e-3,
                             "repack_bytes_per_s": 6e9}))
    s = BridgeSettings.load(environ={"KVBRIDGE_LINK": str(f)})
    assert s.handoff().costs == PlanCosts(segment_s=1e-5, wire_bytes_per_s=3e9, repack_bytes_per_s=6e9)
    # read once: the plan costs, the cost gate and the layer-wise chooser of these settings
    # keep the figures they started with, whatever happens to the file afterwards
    f.write_text(json.dumps({"name": "changed", "bandwidth_bytes_per_s": 1e9, "per_segment_s": 1e-4, "setup_s": 1e-3,
                             "repack_bytes_per_s": 2e9}))
    assert s.link_profile().name == "here"
    f.unlink()
    assert s.handoff().costs == PlanCosts(segment_s=1e-5, wire_bytes_per_s=3e9, repack_bytes_per_s=6e9)


def test_every_plugin_takes_the_link_from_the_same_setting():
    env = {"KVBRIDGE_LINK": "nvlink"}
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


# -- networking and SGLang interop: shared settings, one reader --------------------------------
# (setting, a good value, a bad value, what the refusal says)
NEW_SETTINGS = [
    ("host", "10.1.2.3", "bad host", "not a host name or address"),
    ("metadata_server", "http://10.0.0.1:8080/metadata", "localhost", "metadata_server 'localhost' is not"),
    ("device_name", "mlx5_0,mlx5_1", "mlx5 0", "device_name 'mlx5 0' is not"),
    ("discovery_timeout_s", "12.5", "0", "discovery_timeout_s must be positive"),
    ("sglang_page_size", "64", "-1", "sglang_page_size must be positive"),
]
PLUGINS = {
    "shared": lambda env: BridgeSettings.load(environ=env),
    "sglang": lambda env: SglangBridgeConfig.load(environ=env),
    "trtllm": lambda env: BridgeConfig.load(environ=env),
    "vllm": lambda env: VllmBridgeConfig.load({}, environ=env),
}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
@pytest.mark.parametrize("name, good, bad, why", NEW_SETTINGS, ids=[s[0] for s in NEW_SETTINGS])
def test_networking_and_interop_settings_are_shared(tmp_path, plugin, name, good, bad, why):
    """Each is a ``BridgeSettings`` field every plugin reads the same way: from
    ``KVBRIDGE_<NAME>`` and from the ``KVBRIDGE_CONFIG`` file; a bad value is refused
    naming the setting."""
    load = PLUGINS[plugin]
    field_type = type(getattr(BridgeSettings(), name))
    assert getattr(load({f"KVBRIDGE_{name.upper()}": good}), name) == field_type(good)
    f = tmp_path / "kvbridge.json"
    f.write_text(json.dumps({name: field_type(good)}))
    assert getattr(load({"KVBRIDGE_CONFIG": str(f)}), name) == field_type(good)
    with pytest.raises(ConfigError, match=why):
        load({f"KVBRIDGE_{name.upper()}": bad})
    with pytest.raises(ConfigError, match=name):
        BridgeSettings(**{name: field_type(bad)})


def test_one_prefix_and_one_settings_file_for_every_plugin(tmp_path):
    """vLLM reads ``KVBRIDGE_<NAME>`` like the others; the retired names are refused by
    name, not silently ignored; ``KVBRIDGE_CONFIG`` names the file for all three, under an
    engine's own mapping (vLLM's ``kv_connector_extra_config``) and the environment."""
    assert VllmBridgeConfig.load({}, environ={"KVBRIDGE_BOOTSTRAP_PORT": "8998"}).bootstrap_port == 8998
    with pytest.raises(ConfigError, match="KVBRIDGE_VLLM_BOOTSTRAP_PORT.*KVBRIDGE_BOOTSTRAP_PORT"):
        VllmBridgeConfig.load({}, environ={"KVBRIDGE_VLLM_BOOTSTRAP_PORT": "8998"})
    f = tmp_path / "kvbridge.yaml"
    f.write_text("deadline_s: 7\nheartbeat_s: 0.25\n")
    with pytest.raises(ConfigError, match="KVBRIDGE_TRTLLM_CONFIG.*KVBRIDGE_CONFIG"):
        BridgeConfig.load(environ={"KVBRIDGE_TRTLLM_CONFIG": str(f)})
    env = {"KVBRIDGE_CONFIG": str(f), "KVBRIDGE_HEARTBEAT_S": "0.5"}
    for cfg in (BridgeConfig.load(environ=env), SglangBridgeConfig.load(environ=env),
                VllmBridgeConfig.load({"deadline_s": 8}, environ=env)):
        assert cfg.heartbeat_s == 0.5 and cfg.deadline_s == (8.0 if isinstance(cfg, VllmBridgeConfig) else 7.0)
    f.write_text("bus_port: 1\n")  # another plugin's setting in a file this one reads: refused by name
    with pytest.raises(ConfigError, match="unknown kvbridge vLLM settings \\['bus_port'\\]"):
        VllmBridgeConfig.load({}, environ={"KVBRIDGE_CONFIG": str(f)})


def test_handoff_config_is_made_from_the_settings_only():
    """``HandoffConfig`` has no defaults of its own for the settings: it comes from
    ``BridgeSettings.handoff`` (or ``handoff_config`` over one mapping), which takes only
    the transfer core's own fields besides and refuses any other name."""
    from kvbridge.common.settings import HandoffConfig

    with pytest.raises(TypeError):
        HandoffConfig()
    s = BridgeSettings(deadline_s=5.0, recv_staging_bytes=4096)
    h = s.handoff(receiver=True, write_timeout_s=9.0)
    assert (h.deadline_s, h.recv_staging_bytes, h.write_timeout_s, h.costs) == (5.0, 4096, 9.0, PlanCosts())
    assert s.handoff().recv_staging_bytes == 0
    with pytest.raises(ConfigError, match=r"unknown handoff fields \['deadline_s'\]"):
        s.handoff(deadline_s=1.0)  # a setting goes through the settings
    with pytest.raises(ConfigError, match=r"unknown handoff fields \['write_timeout'\]"):
        s.handoff(write_timeout=1.0)
    assert handoff_config({"deadline_s": "5", "part_bytes": 1 << 20}).part_bytes == 1 << 20
    with pytest.raises(ConfigError, match="nope"):
        handoff_config({"nope": 1})


def test_a_link_file_is_read_once_per_process(tmp_path, monkeypatch):
    """Every settings object, plugin config, cost gate and layer-wise chooser naming the
    same file gets the figures of one read; a file rewritten (another modification time or size) is
    read again by whoever resolves it next, while settings made before keep theirs."""
    from kvbridge.common.gate import CostGate, LayerwiseChooser

    reads = []
    real = costmodel._read_link_file
    monkeypatch.setattr(costmodel, "_read_link_file", lambda p: reads.append(p) or real(p))
    f = tmp_path / "link.json"
    f.write_text(json.dumps({"name": "here", "bandwidth_bytes_per_s": 3e9, "per_segment_s": 1e-5, "setup_s": 1e-3,
                             "repack_bytes_per_s": 6e9}))
    env = {"KVBRIDGE_LINK": str(f), "KVBRIDGE_COST_MODEL": "llama3-8b"}
    first = BridgeSettings.load(environ=env)
    for _ in range(3):
        BridgeSettings.load(environ=env).handoff()
        BridgeConfig.load(environ=env).handoff()
        SglangBridgeConfig.load(environ=env).handoff()
        VllmBridgeConfig.load({}, environ=env).handoff(receiver=True)
        CostGate.from_settings(str(f), "llama3-8b")
        LayerwiseChooser.from_settings(str(f), "llama3-8b")
        assert load_link(str(f)) is first.link_profile()
    assert len(reads) == 1
    f.write_text(json.dumps({"name": "rewritten", "bandwidth_bytes_per_s": 1e9, "per_segment_s": 1e-4,
                             "setup_s": 1e-3, "repack_bytes_per_s": 2e9}))
    later = BridgeSettings.load(environ=env)
    assert later.link_profile().name == "rewritten" and first.link_profile().name == "here" and len(reads) == 2
    assert BridgeSettings.load(environ=env).link_profile() is later.link_profile() and len(reads) == 2


@pytest.mark.parametrize("config", [BridgeConfig, SglangBridgeConfig, VllmBridgeConfig])
def test_every_plugin_starts_its_rank_the_same_way(config):
    """One start-up for the three plugins (``BridgeRank``): the receiver offers the
    deployment's ``recv_staging_bytes`` (and the sender none), both bind the settings'
    host, the record names the sender, the session and the layout, and close ends both
    sides and the transport."""
    from kvbridge.common.rank import BridgeRank

    env = {"KVBRIDGE_RECV_STAGING_BYTES": str(3 << 20), "KVBRIDGE_HOST": "127.0.0.1"}
    cfg = config.load({}, environ=env) if config is VllmBridgeConfig else config.load(environ=env)
    lay = allocate_pool("sglang", layers=2, total_heads=2, head_dim=8, dtype="bfloat16", tokens_per_block=16, num_blocks=4)
    rank = BridgeRank(cfg, "x")
    try:
        send, recv = rank.start_sender(lay), rank.start_receiver(lay)
        assert (recv.config.recv_staging_bytes, send.config.recv_staging_bytes) == (3 << 20, 0)
        assert send.endpoint.startswith("tcp://127.0.0.1:")
        rec = rank.record()
        assert (rec.endpoint, rec.session, rec.engine, rec.page_size) == (send.endpoint, rank.transport.session_id,
                                                                          "x", 16)
        assert rec.layout.to_layout().relative_key == lay.relative_key
        with pytest.raises(RuntimeError, match="started twice"):
            rank.start_sender(lay)
    finally:
        rank.close()
    assert send.channel._closed and recv.channel._closed
