"""The benchmarks run end to end and report what the issues ask for (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_transfer_reports_its_keys():
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "transfer", "--json", "--tokens", "256",
                          "--small-tokens", "64", "--reps", "1", "--sweep", "128,256"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    for key in ("handoff_gbps", "raw_gbps", "ratio", "small_handoff_ms", "small_raw_ms", "scattered_ratio",
                "model_error_max", "link"):
        assert key in res, key
    assert res["bytes"] == 256 * 32 * 2 * 8 * 128 * 2 and res["plan"] == "staged_send"
    assert [p["tokens"] for p in res["model_check"]] == [128, 256]
    assert res["link"]["bandwidth_bytes_per_s"] > 0
