"""``scripts/gpu_check.sh`` on a host without a GPU: one JSON line per check, each skipped
with the reason, exit 0; a check that runs and raises is a failed line and fails the run;
and the device checks' own harness (the gather case, the digest case, both plugins'
layer-wise event order) run on the CPU, so the code a GPU host runs is exercised here too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

cpu_host = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device: the checks run there")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@cpu_host
def test_every_check_is_skipped_with_its_reason_and_the_run_passes(gpu_check, tmp_path):
    env = dict(os.environ, PY=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [json.loads(s) for s in r.stdout.splitlines()]
    assert [x["check"] for x in lines] == [c.name for c in gpu_check.CHECKS], r.stdout
    assert {"d2d_gather", "cuda_event_order", "mooncake_device_memory", "sglang_gpu_pair",
            "vllm_sglang_both_ways"} <= {x["check"] for x in lines}
    for x in lines:
        assert list(x)[:3] == ["check", "ok", "skipped"], x
        assert x["ok"] is None and isinstance(x["skipped"], str) and x["skipped"].strip(), x
    by = {x["check"]: x["skipped"] for x in lines}
    assert by["d2d_gather"].startswith("no CUDA device") or "CPU build" in by["d2d_gather"], by
    assert [json.loads(s) for s in (tmp_path / "results.jsonl").read_text().splitlines()] == lines


@cpu_host
def test_a_check_that_raises_is_a_failed_line_and_fails_the_run(gpu_check, tmp_path):
    (tmp_path / "env.json").write_text(json.dumps(gpu_check.probe_env()))
    res = gpu_check.run_child(gpu_check.BY_NAME["d2d_gather"], tmp_path, 60)  # run anyway: no device to allocate on
    assert res["check"] == "d2d_gather" and res["ok"] is False and res["skipped"] is None, res
    assert res["error"].strip() and res["seconds"] >= 0, res
    assert gpu_check.exit_status([res]) == 1
    assert gpu_check.exit_status([gpu_check.line("x", None, "why"), gpu_check.line("y", True)]) == 0


def test_the_gather_case_is_exact_on_cpu(gpu_check):
    dev = torch.device("cpu")
    for src_page, dst_tpb, path in ((16, 64, "row index"), (64, 16, "box tiles")):
        c = gpu_check.gather_case(dev, src_page=src_page, dst_tpb=dst_tpb, layers=3, heads=2, head_dim=32, tokens=256,
                                  reps=2)
        assert c["exact"] and c["path"] == path and c["bytes"] == 256 * 3 * 2 * 2 * 32 * 2, c
        assert set(c["ratio"]) == {"median", "p10", "p90", "n"}


def test_the_digest_case_agrees_with_a_host_copy_on_cpu(gpu_check):
    """``gpu_digest``'s harness: both algorithms over the pool on the device (here the
    host) equal the same over a copy of it, with every figure reported."""
    c = gpu_check.digest_case(torch.device("cpu"), layers=2, heads=2, head_dim=64, tokens=256, reps=2)
    assert c["equal_to_host_pool"] == {"wsum31x2/lkht/s32": True, "xxh3_64/lkht/s32": True}, c
    assert c["bytes"] == 256 * 2 * 2 * 2 * 64 * 2 and c["torch_gbps"] > 0 and c["xxh3_host_gbps"] > 0, c
    assert c["torch_vs_xxh3"]["n"] == 2, c


@pytest.mark.parametrize("plugin", ["sglang", "trtllm"])
def test_the_event_order_harness_drives_each_plugin_on_cpu(gpu_check, plugin):
    """On CPU the plugins call the sender at once (no events); every layer goes once, in
    order, with the bytes the forward wrote."""
    c = gpu_check.event_order_case(plugin, torch.device("cpu"), layers=3, heads=2, head_dim=32, tokens=64)
    assert c["ok"] and c["pieces"] == 3 and c["layers_once_in_order"] and c["stale_pieces"] == 0, c
