"""`kvbridge bench layerwise` runs end to end on small prompts: what it moved and generated
is checked here against figures computed apart from it (the model's config, transformers'
``generate()``), not against its own verdicts. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.demo.models import random_prompt, reference_generate

LENS = (48, 130)
MAX_NEW = 3


def test_bench_layerwise_smoke(tmp_path):
    model = tmp_path / "model"
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "layerwise", "--json", "--prompt-lens",
                          ",".join(map(str, LENS)), "--reps", "1", "--warmup", "0", "--max-new", str(MAX_NEW), "--layers", "3",
                          "--head-dim", "32", "--model-dir", str(model), "--plot", str(tmp_path / "plots")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout)
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["head_dim"] == 32
    token_bytes = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # float32 pools
    assert [r["prompt_len"] for r in res["lengths"]] == list(LENS)
    for i, r in enumerate(res["lengths"]):
        n = r["prompt_len"]
        want = reference_generate(model, random_prompt(n, seed=i), MAX_NEW).token_ids
        assert r["outputs"]["whole"] == [want] and r["outputs"]["layerwise"] == [want], n
        # the decode pulled the whole prompt in both modes (no device cache held any of it)
        assert r["bytes_moved"] == {"whole": [n * token_bytes], "layerwise": [n * token_bytes]}, n
        # layer-wise: one piece per layer of the one forward, the room ended by finish(); whole: one send
        assert r["layer_pieces"] == {"whole": [0], "layerwise": [cfg["num_hidden_layers"]]}, n
        assert r["ended_by"] == {"whole": ["send"], "layerwise": ["finish"]}, n
        for key in ("ttft_whole_ms", "ttft_layerwise_ms", "ttft_ratio"):
            assert set(r[key]) == {"median", "p10", "p90", "n"} and r[key]["n"] == 1, key
        for key in ("prefill_ms", "transfer_ms", "bound_whole_ms", "bound_layerwise_ms", "decode_step_ms"):
            assert isinstance(r[key], float), key
    (png,) = res["plots"]
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_layerwise_on_sglang_real_servers(tmp_path):
    """``--engine sglang``: SGLang's real prefills (whole, layer-wise) and decode. Checked
    apart from the bench: both modes' outputs equal transformers' ``generate()``; the
    layer-wise prefill's log (read by the bench) gave one piece per layer of the one
    forward and a room ended by ``finish``; the aggregated server timed a prefill."""
    model = tmp_path / "model"
    lens = (40,)
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "layerwise", "--engine", "sglang", "--json",
                          "--prompt-lens", ",".join(map(str, lens)), "--reps", "1", "--warmup", "0", "--max-new", str(MAX_NEW),
                          "--layers", "3", "--head-dim", "32", "--model-dir", str(model)],
                         capture_output=True, text=True, timeout=1100)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout)
    assert res["engine"].startswith("sglang 0.5.23 real servers")
    (r,) = res["lengths"]
    want = reference_generate(model, random_prompt(lens[0], seed=0), MAX_NEW).token_ids
    assert r["outputs"] == {"whole": [want], "layerwise": [want]}
    assert r["layer_pieces"] == {"whole": [0], "layerwise": [3]} and r["ended_by"]["layerwise"] == ["finish"]
    assert r["prefill_ms"] > 0 and r["ttft_whole_ms"]["n"] == 1
    # the prefill's own timeline: its send after the forward, in each mode, and the prefill alone
    assert set(r["tail_after_forward_ms"]) == {"whole", "layerwise"} and r["prefill_alone_ms"]["n"] == 1
    assert r["transfer_ms"] == r["tail_after_forward_ms"]["whole"]["median"]


def test_bench_layerwise_over_a_shaped_link(tmp_path):
    """``--link-rate auto``: the KV crosses the loopback shaped with tc at the rate that
    makes moving each prompt take as long as its prefill. Checked apart from the bench: the
    kernel's own counter of the shaped class carried at least the KV bytes of the measured
    runs (by the model's config), the outputs equal transformers' ``generate()``, and the
    loopback is left as it was. Skipped where the host cannot shape its loopback."""
    from kvbridge.bench.link import LinkShapingError, ShapedLoopback

    try:
        with ShapedLoopback(1000.0):
            pass
    except LinkShapingError as e:
        pytest.skip(f"this host cannot shape its loopback: {e}")
    before = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    model = tmp_path / "model"
    n = 96
    try:
        out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "layerwise", "--json", "--prompt-lens",
                              str(n), "--reps", "1", "--warmup", "1", "--max-new", str(MAX_NEW), "--layers", "3",
                              "--head-dim", "32", "--model-dir", str(model), "--link-rate", "auto"],
                             capture_output=True, text=True, timeout=280)
        after = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    finally:  # a bench killed on a timeout cannot unshape the loopback; the rest of the suite needs it unshaped
        if subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout != before:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    assert out.returncode == 0, out.stderr[-4000:]
    assert after == before
    res = json.loads(out.stdout)
    (r,) = res["lengths"]
    cfg = json.loads((model / "config.json").read_text())
    token_bytes = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    want = reference_generate(model, random_prompt(n, seed=0), MAX_NEW).token_ids
    assert r["outputs"] == {"whole": [want], "layerwise": [want]}
    assert r["kv_bytes_moved"] == 2 * n * token_bytes  # one measured run per mode
    assert r["shaped_bytes"] >= r["kv_bytes_moved"], "the KV did not cross the shaped class"
    assert r["link_rate_mbit"] > 0 and "shaped with tc" in res["link"]
    assert not [w for w in res["warnings"] if "shaped path" in w]


@pytest.mark.parametrize("args, said", [
    (["--engine", "vllm"], "invalid choice: 'vllm'"),
    (["--prompt-lens", "64,0"], "--prompt-lens needs positive token counts"),
    (["--hidden", "8", "--kv-heads", "32"], "hidden size 8 must be a multiple of the 32 attention heads"),
    (["--link-rate", "fast"], "--link-rate 'fast': Mbit/s (a number) or 'auto'"),
    (["--link-rate", "auto", "--warmup", "0"], "auto sets each length's rate from its first warm-up"),
])
def test_bench_layerwise_refuses_what_it_cannot_run(args, said):
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "layerwise", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and said in out.stderr
