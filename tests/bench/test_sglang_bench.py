"""Smoke test of ``kvbridge bench sglang`` (kvbridge.bench.sglang): tiny sizes,
every backend (kvbridge's, SGLang's own Mooncake backend and SGLang's own NIXL backend
over UCX) in real worker processes with the real sglang and nixl packages on CPU. Checks
the report's keys and that every transfer of every backend landed the right bytes; no
timing assertions.

Slow-ish: three worker processes each import SGLang (20-90 s on a 2-core machine).
"""

from __future__ import annotations

import json

import pytest

import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
import mooncake  # noqa: F401  (pinned: a missing one fails the run, never skips)

from kvbridge.bench.sglang import nixl_installed

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(420)]

REPS = 1
ALL = ("kvbridge", "sglang_mooncake", "sglang_nixl")


KEPT: dict = {}  # (case, backend) -> the last transfer's token rows on each side (bench_sglang's keep)


@pytest.fixture(scope="module")
def report():
    from kvbridge.bench.sglang import bench_sglang

    return bench_sglang(tokens=128, tp_tokens=64, layers=2, heads=4, head_dim=16, reps=REPS, timeout_s=60.0,
                        sweep=(64,), sweep_layers=3, keep=KEPT)


def test_keys(report):
    for k in ("kvbridge_gbps", "sglang_mooncake_gbps", "ratio", "kvbridge_segments_tp2to1", "sglang_segments_tp2to1",
              "sglang_segments_tp2to1_expected", "verified", "same_tp", "tp2to1", "settings", "geometry",
              "sglang_nixl_gbps", "ratio_vs_nixl", "nixl"):
        assert k in report, k
    assert report["kvbridge_gbps"] > 0 and report["sglang_mooncake_gbps"] > 0 and report["ratio"] > 0
    assert report["sglang_nixl_gbps"] > 0 and report["ratio_vs_nixl"] > 0
    json.dumps(report)  # JSON-ready


def test_nixl_ran_where_sglang_lets_it():
    """nixl is pinned (requirements/sglang.txt): a missing one fails here, never skips."""
    assert nixl_installed()


def test_nixl_is_left_out_of_tp2to1_with_sglang_s_reason(report):
    assert report["nixl"]["ran"] is True and "UCX_TLS=tcp" in report["nixl"]["transport"]
    assert "sglang_nixl" not in report["tp2to1"] and "NotImplementedError" in report["nixl"]["tp2to1"]


def test_both_backends_moved_correct_bytes(report):
    assert report["verified"] == {"kvbridge": True, "sglang_mooncake": True, "sglang_nixl": True}, report
    for case, backends in (("same_tp", ALL), ("tp2to1", ALL[:2])):
        for backend in backends:
            s = report[case][backend]
            # warm-up + reps, each checked (decode pages digest == prefill pages digest, first token row)
            assert s["transfers_ok"] == s["transfers_verified"] == REPS + 1, (case, backend, s)
            assert s["transfers_failed"] == 0 and not s["errors"]


def test_decode_rows_are_the_prefill_ranks_rows(report):
    """Not the bench's own ``verified``: the decode's token rows of every K and V buffer (read
    by SGLang's indexing, ``buf[page * page_size + t]``) equal the prefill's, each prefill rank
    holding its slice of the heads (TP 2 -> 1), for every backend and both cases (NIXL: same TP)."""
    import numpy as np

    assert set(KEPT) == {(c, b) for c in ("same_tp", "tp2to1") for b in ALL} - {("tp2to1", "sglang_nixl")}, set(KEPT)
    for (case, backend), k in KEPT.items():
        want = [np.concatenate(bufs, axis=1) for bufs in zip(*k["prefill"])]  # heads of rank 0, then rank 1
        assert len(k["prefill"]) == (2 if case == "tp2to1" else 1)
        assert len(k["decode"]) == len(want) == 2 * 2 and k["decode"][0].shape[0] >= k["tokens"]
        for i, (got, exp) in enumerate(zip(k["decode"], want)):
            assert got.shape == exp.shape and np.array_equal(got[: k["tokens"]], exp[: k["tokens"]]), (case, backend, i)
        assert len(np.unique(want[0])) > 16, "the prefill's rows are not random KV"


def test_segment_counts(report):
    # SGLang's per-token slice path: one piece per token slot x layer x K/V from each prefill rank
    assert report["sglang_segments_tp2to1"] == report["sglang_segments_tp2to1_expected"] == 2 * 64 * 2 * 2
    assert report["kvbridge_plan_tp2to1"] == "staged_recv"
    assert 0 < report["kvbridge_segments_tp2to1"] < report["sglang_segments_tp2to1"]
    # contiguous pages, same TP: one piece per layer and K/V for SGLang
    assert report["sglang_segments_same_tp"] == 2 * 2


def test_sweep_per_length_and_its_chart(report, tmp_path):
    """The prompt-length sweep (``bench all --plot`` feeds it to the GB/s chart)."""
    from kvbridge.bench.plots import plot_sglang

    (p,) = report["per_length"]
    assert p["tokens"] == 64 and p["layers"] == 3 and p["bytes"] == 64 * 3 * 2 * 4 * 16 * 2
    assert p["verified"] == {"kvbridge": True, "sglang_mooncake": True, "sglang_nixl": True}
    assert p["kvbridge_gbps"] > 0 and p["sglang_mooncake_gbps"] > 0 and p["sglang_nixl_gbps"] > 0
    (png,) = plot_sglang(report, str(tmp_path))
    with open(png, "rb") as fh:
        assert fh.read(4) == b"\x89PNG"
