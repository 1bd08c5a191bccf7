"""The cost model's arithmetic on fixed inputs, and `kvbridge plan`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvbridge.common.costmodel import (
    LINK_PRESETS,
    MODEL_PRESETS,
    LinkProfile,
    ModelGeometry,
    break_even_prompt_len,
    decide,
    load_link,
    model_layout,
    predict_handoff_s,
)
from kvbridge.layout import PlanKind, plan_transfer

LINK = LinkProfile("test", bandwidth_bytes_per_s=1e9, per_segment_s=10e-6, setup_s=1e-3, repack_bytes_per_s=4e9)


def test_kv_bytes_of_presets():
    assert MODEL_PRESETS["llama3-8b"].kv_bytes(1) == 32 * 2 * 8 * 128 * 2 == 131072
    assert MODEL_PRESETS["llama3-8b"].kv_bytes(32768) == 4 << 30
    assert MODEL_PRESETS["deepseek-v3"].kv_bytes(1) == 61 * 576  # MLA latent, fp8


def test_handoff_prediction_parts():
    h = predict_handoff_s(1 << 30, 64, LINK, staged=False)
    assert h.wire_s == pytest.approx((1 << 30) / 1e9)
    assert h.segments_s == pytest.approx(64e-5)
    assert h.total_s == pytest.approx(1e-3 + (1 << 30) / 1e9 + 64e-5)
    # staged and overlapped, as the plan chooser prices it: the longer of the repack (1 GiB
    # at 4 GB/s) and the wire, plus an eighth of the shorter
    s = predict_handoff_s(1 << 30, 64, LINK, staged=True)
    rep = (1 << 30) / 4e9
    assert s.repack_s == pytest.approx(rep / 8) and s.total_s == pytest.approx(h.total_s + rep / 8)
    # not overlapped: all of it
    assert predict_handoff_s(1 << 30, 64, LINK, staged=True, overlapped=False).repack_s == pytest.approx(rep)
    # a repack slower than the wire shows beyond the wire time, with an eighth of the wire
    slow = LinkProfile("slow-repack", 1e9, 0, 0, 0.5e9)
    r = predict_handoff_s(1 << 30, 1, slow, staged=True)
    assert r.total_s == pytest.approx((1 << 30) / 0.5e9 + (1 << 30) / 1e9 / 8)
    # a measured overlap: none of the repack hidden (the gather and the transport's copies on
    # the same cores) is the unoverlapped sum; half hides half of the 7/8
    none = LinkProfile("shared-cores", 1e9, 10e-6, 1e-3, 4e9, repack_overlap=0.0)
    assert predict_handoff_s(1 << 30, 64, none, staged=True).repack_s == pytest.approx(rep)
    half = LinkProfile("half", 1e9, 10e-6, 1e-3, 4e9, repack_overlap=0.5)
    assert predict_handoff_s(1 << 30, 64, half, staged=True).repack_s == pytest.approx(rep - 0.5 * rep * 7 / 8)
    with pytest.raises(ValueError, match="repack_overlap"):
        LinkProfile("bad", 1e9, 0, 0, 1e9, repack_overlap=1.5)


@pytest.mark.parametrize("link, model, prompt, held", [
    ("tcp", "llama3-8b", 4096, 0),  # a direct plan
    ("nvlink", "llama3-8b", 32768, 0),  # staged: direct's segment count is the chooser's upper bound
    ("tcp", "llama3-70b", 4096, 100),  # staged, from a held prefix
    ("rdma", "deepseek-v3", 1000, 37),  # MLA, direct
])
def test_the_gate_prices_a_handoff_with_the_plan_choosers_own_figure(link, model, prompt, held):
    """One formula: the cost gate's handoff is the link's setup plus the estimate
    ``plan_transfer`` chose its plan by, between pools of the model (blocks in order)."""
    lk, m = LINK_PRESETS[link], MODEL_PRESETS[model]
    lay = model_layout(m, prompt)
    blocks = np.arange(lay.first_block, lay.first_block + -(-prompt // lay.tokens_per_block))
    plan = plan_transfer(lay, blocks, lay, blocks, (held, prompt), costs=lk.plan_costs(),
                         kinds=(PlanKind.DIRECT, PlanKind.STAGED_SEND))
    chosen = plan.estimates[plan.kind]
    v = CostGate(m, lk).check(prompt, held)
    assert v.decision.handoff.total_s == lk.setup_s + chosen.seconds
    assert v.decision.details["segments"] == chosen.segments
    assert v.decision.details["staged"] is (plan.kind is not PlanKind.DIRECT)
    assert decide(m, lk, prompt, held_tokens=held, plan=plan).handoff.total_s == lk.setup_s + chosen.seconds


def test_decision_compares_first_token_times():
    m = MODEL_PRESETS["llama3-8b"]
    d = decide(m, LINK, 4096, prefill_tps=10000, decode_prefill_tps=5000, queue_s=0.1)
    assert d.prefill_s == pytest.approx(0.4096) and d.recompute_s == pytest.approx(0.8192)
    assert d.disaggregated_ttft_s == pytest.approx(0.1 + 0.4096 + d.handoff.total_s)
    assert d.move is (d.disaggregated_ttft_s < d.local_ttft_s)
    # a long enough queue makes recomputing win
    assert not decide(m, LINK, 4096, prefill_tps=10000, decode_prefill_tps=5000, queue_s=5.0).move


def test_nvlink_and_tcp_give_opposite_verdicts_for_a_32k_llama3_8b_prompt():
    m = MODEL_PRESETS["llama3-8b"]
    nv, tcp = decide(m, LINK_PRESETS["nvlink"], 32768), decide(m, LINK_PRESETS["tcp"], 32768)
    assert nv.move and not tcp.move
    assert tcp.handoff.wire_s > nv.handoff.wire_s * 100
    assert "MOVE" in nv.verdict and "RECOMPUTE" in tcp.verdict


def test_break_even_is_where_the_verdict_flips():
    m, link = MODEL_PRESETS["llama3-8b"], LINK_PRESETS["tcp"]
    n = break_even_prompt_len(m, link)
    assert n is not None and not decide(m, link, n - 1).move and decide(m, link, n).move


def test_geometry_from_hf_config_and_link_files(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = ModelGeometry.from_hf_config(tmp_path)
    assert (g.layers, g.kv_heads, g.head_dim, g.kv_factor) == (4, 2, 32, 2) and g.kv_bytes(10) == 4 * 2 * 2 * 32 * 2 * 10
    mla = {**cfg, "kv_lora_rank": 64, "qk_rope_head_dim": 16}
    (tmp_path / "mla.json").write_text(json.dumps(mla))
    g = ModelGeometry.from_hf_config(tmp_path / "mla.json", dtype_bytes=1)
    assert (g.kv_heads, g.head_dim, g.kv_factor) == (1, 80, 1)
    link_file = tmp_path / "link.json"
    link_file.write_text(json.dumps({"name": "here", "bandwidth_bytes_per_s": 2e9, "per_segment_s": 3e-5, "setup_s": 1e-3,
                                     "repack_bytes_per_s": 8e9}))
    assert load_link(str(link_file)).source.startswith("measured") and load_link(str(link_file)).repack_overlap == 1.0
    other = tmp_path / "link2.json"  # what bench link writes now: the measured overlap too
    other.write_text(json.dumps({"name": "here", "bandwidth_bytes_per_s": 2e9, "per_segment_s": 3e-5, "setup_s": 1e-3,
                                 "repack_bytes_per_s": 8e9, "repack_overlap": 0.25}))
    assert load_link(str(other)).plan_costs().repack_overlap == 0.25
    with pytest.raises(ValueError, match="unknown link"):
        load_link("carrier-pigeon")


def test_plan_cli_json():
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "plan", "--preset", "llama3-8b", "--prompt-len", "32768",
                          "--link", "nvlink", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["move"] is True and d["handoff"]["bytes"] == 4 << 30 and "nvlink" in d["link"]


# -- the per-request gate (kvbridge.common.gate) ------------------------------------------
from kvbridge.common.gate import RECOMPUTE_PREFIX, CostGate, model_geometry  # noqa: E402

TINY = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 100}


def test_gate_is_off_without_a_link_and_names_bad_settings(tmp_path):
    assert CostGate.from_settings("", "llama3-8b") is None
    with pytest.raises(ValueError, match="no model geometry"):
        CostGate.from_settings("tcp", "")
    with pytest.raises(ValueError, match="not a preset"):
        CostGate.from_settings("tcp", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="decode_prefill_tps must be >= 0"):
        CostGate.from_settings("tcp", "llama3-8b", decode_prefill_tps=-1)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert model_geometry(str(tmp_path)).kv_bytes(1) == 3 * 2 * 4 * 8 * 2
    assert CostGate.from_settings("tcp", default_model=str(tmp_path)).model.layers == 3


def test_gate_verdicts_on_fixed_inputs():
    """tps fixed: recompute costs n / 1000 s; disaggregated 50 ms queue + n / 1e6 s + the
    handoff (1 ms setup + bytes / 1 GB/s + 10 us per 16 MiB segment + first chunk repack)."""
    gate = CostGate(ModelGeometry.from_hf_dict(TINY), LINK, prefill_tps=1e6, decode_prefill_tps=1000, queue_s=0.05)
    per_tok = 3 * 2 * 4 * 8 * 2
    # break-even: n / 1000 > 0.05 + n / 1e6 + 1e-3 + 1e-5 + n * per_tok * (1e-9 + 1 / 4e9)
    want = next(n for n in range(2, 200) if n / 1000 > 0.05 + n / 1e6 + 1e-3 + 1e-5 + n * per_tok * (1e-9 + 0.25e-9))
    assert gate.break_even == want == 52
    short, long_ = gate.check(32), gate.check(200)
    assert not short.move and short.label == "below_break_even"
    assert short.reason.startswith(RECOMPUTE_PREFIX) and "break-even 52 tokens" in short.reason
    assert short.decision.local_ttft_s == pytest.approx(0.032)
    assert long_.move and long_.label == "" and long_.decision.handoff.bytes == 200 * per_tok
    # the tokens the decode holds are neither moved nor recomputed: 200 with 180 held recomputes 20 (20 ms < 50 ms queue)
    held = gate.check(200, held_tokens=180)
    assert not held.move and held.decision.handoff.bytes == 20 * per_tok
    assert held.decision.recompute_s == pytest.approx(0.020)
    assert gate.check(64, held_tokens=64).move  # nothing left to move or compute
    with pytest.raises(ValueError, match="prompt_len must be positive"):
        gate.check(0)


def test_gate_from_flops_recomputes_only_the_new_tokens():
    m = MODEL_PRESETS["llama3-8b"]
    full, part = decide(m, LINK_PRESETS["nvlink"], 8192), decide(m, LINK_PRESETS["nvlink"], 8192, held_tokens=4096)
    assert part.recompute_s == pytest.approx(full.recompute_s * (m.prefill_flops(8192) - m.prefill_flops(4096))
                                             / m.prefill_flops(8192))
    assert part.handoff.bytes == full.handoff.bytes // 2 and part.prefill_s == full.prefill_s
    with pytest.raises(ValueError, match="held_tokens"):
        decide(m, LINK, 10, held_tokens=10)


def test_plan_cli_with_held_tokens():
    """What a router asks before sending a request whose prefix the decode holds."""
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "plan", "--preset", "llama3-8b", "--prompt-len", "4096",
                          "--held-tokens", "4000", "--link", "tcp", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["handoff"]["bytes"] == 96 * 131072 and d["details"]["held_tokens"] == 4000 and d["move"] is False
    bad = subprocess.run([sys.executable, "-m", "kvbridge.cli", "plan", "--preset", "llama3-8b", "--prompt-len", "10",
                          "--held-tokens", "10"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "held_tokens must be in [0, prompt_len=10)" in bad.stderr
