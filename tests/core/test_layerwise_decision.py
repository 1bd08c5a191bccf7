"""When to send a request's KV layer by layer: the cost model's
decision (``decide_layerwise``), the ``layerwise: auto | true | false`` setting and its
per-request chooser, and `kvbridge plan` showing the decision.

The expected figures are computed here from first principles (bytes from the geometry,
segments from ``plan_transfer`` over per-layer views made here, the pipeline stepped
layer by layer in a plain loop), not by the code under test."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvbridge.common.costmodel import (LINK_PRESETS, MODEL_PRESETS, LinkProfile, decide_layerwise, layer_plan_segments,
                                       model_layout)
from kvbridge.common.settings import BridgeSettings, ConfigError
from kvbridge.layout import PlanKind, plan_transfer

M8B = MODEL_PRESETS["llama3-8b"]


def _reference(model, link: LinkProfile, prompt_len: int, prefill_s: float) -> tuple[float, float]:
    """(whole, layer-wise) first-token times: per-layer plans made here, sends stepped in a loop."""
    lay = model_layout(model, prompt_len)
    blocks = np.arange(lay.first_block, lay.first_block + -(-prompt_len // lay.tokens_per_block))
    whole_plan = plan_transfer(lay, blocks, lay, blocks, (0, prompt_len), costs=link.plan_costs(),
                               kinds=(PlanKind.DIRECT, PlanKind.STAGED_SEND))
    assert whole_plan.kind is PlanKind.DIRECT or prompt_len > 2048  # the cases below: staging only for long prompts
    nbytes = model.layers * model.kv_factor * model.kv_heads * model.head_dim * model.dtype_bytes * prompt_len
    wire = nbytes / link.bandwidth_bytes_per_s
    whole = prefill_s + link.setup_s + wire + whole_plan.num_segments * link.per_segment_s
    if whole_plan.kind is not PlanKind.DIRECT:  # staged: the longer of repack and wire, plus an eighth of the shorter
        rep, on_wire = nbytes / link.repack_bytes_per_s, wire + whole_plan.num_segments * link.per_segment_s
        whole += max(rep, on_wire) + min(rep, on_wire) / 8 - on_wire
    t_link = link.setup_s
    for layer in range(model.layers):
        v = lay.layer_range(layer, layer + 1)
        p = plan_transfer(v, blocks, v, blocks, (0, prompt_len), costs=link.plan_costs(),
                          kinds=(PlanKind.DIRECT, PlanKind.STAGED_SEND))
        send = nbytes / model.layers / link.bandwidth_bytes_per_s + p.num_segments * link.per_segment_s + link.per_batch_s
        if p.kind is not PlanKind.DIRECT:
            send += nbytes / model.layers / link.repack_bytes_per_s
        ready = link.setup_s + prefill_s * (layer + 1) / model.layers
        t_link = max(t_link, ready) + send
    return whole, t_link


@pytest.mark.parametrize("link, prompt_len, expect", [
    ("tcp", 4096, True),  # 512 MiB at 2 GB/s next to a 157 ms prefill: the transfer hides behind it
    ("nvlink", 4096, False),  # 1.8 ms of transfer: nothing to hide, only per-layer cost to pay
    ("tcp", 128, False),  # a short prompt on TCP: setup and per-layer batches eat the gain
    ("tcp", 1024, True),
])
def test_decision_flips_with_link_and_prompt_length(link, prompt_len, expect):
    lk = LINK_PRESETS[link]
    est = decide_layerwise(M8B, lk, prompt_len)
    prefill = M8B.prefill_flops(prompt_len) / (989e12 * 0.45)
    whole, lw = _reference(M8B, lk, prompt_len, prefill)
    assert est.prefill_s == pytest.approx(prefill)
    assert est.ttft_whole_s == pytest.approx(whole, rel=1e-9)
    assert est.ttft_layerwise_s == pytest.approx(lw, rel=1e-9)
    assert est.layerwise is expect is (lw < 0.9 * whole), est.reason
    assert est.reason.startswith("LAYER-WISE" if expect else "WHOLE")
    assert est.bytes == 32 * 2 * 8 * 128 * 2 * prompt_len
    # the bound layer-wise sends are held to: about max(prefill, transfer) + one layer's transfer
    assert est.ttft_layerwise_s <= est.bound_layerwise_s + 1e-12
    assert est.bound_layerwise_s == pytest.approx(lk.setup_s + max(prefill, est.transfer_layerwise_s - lk.setup_s)
                                                  + est.one_layer_s)


def test_decision_uses_the_per_layer_plans_segments():
    """The per-layer segment counts are those of plans over ``layer_range`` views (here a
    4k prompt in 16-token pages on a 70B: two segments per layer, K and V)."""
    m = MODEL_PRESETS["llama3-70b"]
    segs, staged = layer_plan_segments(m, LINK_PRESETS["tcp"], 0, 4096)
    lay = model_layout(m, 4096)
    blocks = np.arange(lay.first_block, lay.first_block + 4096 // lay.tokens_per_block)
    want = [plan_transfer(lay.layer_range(i, i + 1), blocks, lay.layer_range(i, i + 1), blocks, (0, 4096),
                          costs=LINK_PRESETS["tcp"].plan_costs(),
                          kinds=(PlanKind.DIRECT, PlanKind.STAGED_SEND)).num_segments for i in range(m.layers)]
    assert segs.tolist() == want and len(want) == 80
    est = decide_layerwise(m, LINK_PRESETS["tcp"], 4096)
    assert est.segments_layerwise == sum(want)
    assert est.overhead_layerwise_s == pytest.approx(est.transfer_layerwise_s - est.transfer_whole_s)
    assert est.one_layer_s >= m.kv_bytes(4096) / 80 / 2e9 + 2 * 30e-6 + 120e-6  # its bytes, 2 segments, one batch


def test_decision_bad_input_is_named():
    with pytest.raises(ValueError, match="prompt_len"):
        decide_layerwise(M8B, LINK_PRESETS["tcp"], 0)
    with pytest.raises(ValueError, match="held_tokens"):
        decide_layerwise(M8B, LINK_PRESETS["tcp"], 10, held_tokens=10)
    with pytest.raises(ValueError, match="margin"):
        decide_layerwise(M8B, LINK_PRESETS["tcp"], 10, margin=1.5)


# -- the setting ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, want", [("auto", "auto"), ("AUTO", "auto"), ("true", True), ("on", True), ("1", True),
                                       ("false", False), ("off", False), ("0", False), (True, True), (False, False)])
def test_layerwise_setting_words(raw, want):
    assert BridgeSettings.load({"layerwise": raw}, environ={}).layerwise == want
    assert BridgeSettings.load(environ={"KVBRIDGE_LAYERWISE": str(raw)}).layerwise == want
    assert BridgeSettings(layerwise=raw).layerwise == want


def test_layerwise_setting_refuses_other_words():
    with pytest.raises(ConfigError, match="layerwise='sometimes'.*auto, true, false"):
        BridgeSettings.load({"layerwise": "sometimes"}, environ={})
    with pytest.raises(ConfigError, match="layerwise"):
        BridgeSettings(layerwise="2")


def test_auto_chooser_from_settings():
    assert BridgeSettings(layerwise=True).layerwise_chooser() is None  # forced: no decision to make
    assert BridgeSettings().layerwise_chooser() is None
    with pytest.raises(ConfigError, match="cost_model"):
        BridgeSettings(layerwise="auto").layerwise_chooser()
    slow = BridgeSettings(layerwise="auto", link="tcp", cost_model="llama3-8b").layerwise_chooser()
    fast = BridgeSettings(layerwise="auto", link="nvlink", cost_model="llama3-8b").layerwise_chooser()
    assert slow.choose(4096).layerwise and not fast.choose(4096).layerwise
    assert not slow.choose(128).layerwise
    # a length between buckets is decided at its bucket's length (rounded up)
    b = slow.bucket(3000)
    assert 3000 <= b < 3000 * 2 ** (1 / 8) + 1
    assert slow.choose(3000) == decide_layerwise(M8B, LINK_PRESETS["tcp"], b)
    # prefill speed from the settings: a prefill as long as the transfer hides it, for a short prompt too
    even = BridgeSettings(layerwise="auto", link="tcp", cost_model="llama3-8b", cost_prefill_tps=10000.0)
    est = even.layerwise_chooser().choose(128)
    assert est.layerwise and est.prefill_s == pytest.approx(128 / 10000.0), est.reason


# -- `kvbridge plan` ----------------------------------------------------------------------------
def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", "plan", "--preset", "llama3-8b", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_cli_shows_the_layerwise_decision():
    got = {}
    for link in ("tcp", "nvlink"):
        out = _plan("--prompt-len", "4096", "--link", link, "--json")
        assert out.returncode == 0, out.stderr
        got[link] = json.loads(out.stdout)["layerwise"]
    assert got["tcp"]["layerwise"] is True and got["nvlink"]["layerwise"] is False
    for link, d in got.items():
        prefill = M8B.prefill_flops(4096) / (989e12 * 0.45)
        whole, lw = _reference(M8B, LINK_PRESETS[link], 4096, prefill)
        assert d["ttft_whole_s"] == pytest.approx(whole) and d["ttft_layerwise_s"] == pytest.approx(lw)
        assert d["bytes"] == 4096 * 131072
    text = _plan("--prompt-len", "4096", "--link", "tcp")
    assert text.returncode == 0, text.stderr
    assert "layer-wise: first token, whole send" in text.stdout and "layer by layer" in text.stdout
    line = next(x for x in text.stdout.splitlines() if x.startswith("layer-wise sends"))
    assert "LAYER-WISE" in line and f"{got['tcp']['ttft_layerwise_s'] * 1e3:.2f} ms" in line
    short = _plan("--prompt-len", "128", "--link", "tcp")
    assert "WHOLE:" in next(x for x in short.stdout.splitlines() if x.startswith("layer-wise sends"))


def test_both_plugins_ask_one_decision():
    """The SGLang prefill (``layerwise_wanted``) and the TensorRT-LLM scheduler (its
    ``_layerwise``) both ask ``BridgeSettings.sends_layerwise``: the same settings and
    chooser give the same answer in each, for every mode and length, reference computed
    here from the chooser and the mode alone."""
    from kvbridge.adapters.sglang.config import SglangBridgeConfig
    from kvbridge.adapters.trtllm.config import BridgeConfig

    lens = (16, 128, 1024, 4096)
    for mode in ("auto", "true", "false"):
        env = {"KVBRIDGE_LAYERWISE": mode, "KVBRIDGE_LINK": "tcp", "KVBRIDGE_COST_MODEL": "llama3-8b"}
        sgl = SglangBridgeConfig.load(environ=env)
        trt = BridgeConfig.load(environ=env)
        chooser = trt.layerwise_chooser(None)
        assert (chooser is None) is (mode != "auto")
        for n in lens:
            want = chooser.choose(n).layerwise if mode == "auto" else mode == "true"
            assert sgl.sends_layerwise(n, chooser)[0] is want and trt.sends_layerwise(n, chooser)[0] is want, (mode, n)
        assert sgl.sends_layerwise(None, chooser)[0] is (mode != "false")  # may any request? (auto: some may)
    auto = BridgeConfig.load(environ={"KVBRIDGE_LAYERWISE": "auto"})
    assert auto.sends_layerwise(4096, None) == (False, "layerwise=auto without a cost model: whole")
