"""The benchmarks run end to end and report what the issues ask for (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_transfer_reports_its_keys(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "transfer", "--json", "--tokens", "256",
                          "--small-tokens", "64", "--reps", "1", "--sweep", "128,256", "--plot", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    for key in ("handoff_gbps", "raw_gbps", "ratio", "small_handoff_ms", "small_raw_ms", "small_overhead_paired_ms", "scattered_ratio",
                "model_error_max", "link"):
        assert key in res, key
    assert res["bytes"] == 256 * 32 * 2 * 8 * 128 * 2 and res["plan"] == "staged_send"
    # the same tokens between two SGLang pools: no repack, one run per layer and K/V
    assert res["same_layout_plan"] == "direct" and res["same_layout_segments"] == 32 * 2 and res["same_layout_ratio"] > 0
    assert set(res["cpu_s_per_gib"]) == {"raw", "handoff", "same_layout"}
    assert [p["tokens"] for p in res["model_check"]] == [128, 256]
    assert res["link"]["bandwidth_bytes_per_s"] > 0 and 0.0 <= res["link"]["repack_overlap"] <= 1.0
    # the baseline is the fastest raw shape, picked before the repetitions: every shape
    # measured, the best named, then written again beside each handoff
    got = {(r["segment_mib"], r["depth"]) for r in res["raw_shapes"]}
    assert got == {(m, d) for m in (1, 4, 16) for d in ("one batch", 1, 2, 4, 8)}, got  # 32 MiB of KV: no 64 MiB segment
    best = max(res["raw_shapes"], key=lambda r: r["gbps"])
    assert res["best_raw_shape"] == {"segment_mib": best["segment_mib"], "depth": best["depth"]}
    assert len(res["samples_s"]["best_raw"]) == len(res["samples_s"]["handoff"]) == 1
    assert res["spread"]["ratio"]["n"] == res["spread"]["one_batch_ratio"]["n"] == 1
    # the link's setup and overlap are medians of paired samples, reported with their spread
    assert {k: v["n"] for k, v in res["link"]["samples"].items()} == {"setup_ms": 25, "repack_overlap": 25}
    for p in res["model_check"]:
        assert set(p["breakdown_ms"]) == {"plan", "repack", "transfer", "notify"}
        # the prediction's terms add up to it, and the overlap that would have made it exact is named
        assert abs(sum(p["terms_ms"].values()) - p["predicted_ms"]) <= 0.05, p
        assert isinstance(p["implied_overlap"], float), p
    # the small request stage by stage: the sender's own figures, and the rest of the decode's time
    st = res["small_breakdown_ms"]
    assert set(st) == {"plan", "gather", "wire", "control"} and st["gather"] > 0 and st["wire"] > 0
    # and its critical path from both processes' records, in the order things happen
    tl = res["small_timeline_ms"]
    assert list(tl) == ["request", "accept", "first_write", "writes", "done", "settle", "wake"], tl
    assert all(v["p10"] >= 0 for v in tl.values()), tl
    assert tl["writes"]["median"] > 0 and sum(v["median"] for v in tl.values()) <= 1.5 * res["small_handoff_ms"], tl
    # the same request in each engine's order, each handoff against the raw write before it
    orders = res["small_orders"]
    assert set(orders) == {"request_first", "data_first"}, orders
    for o in orders.values():
        assert o["overhead_ms"]["n"] == o["handoff_ms"]["n"] == o["raw_ms"]["n"] == 13, o
        assert o["handoff_ms"]["p10"] > 0 and o["raw_ms"]["p10"] > 0 and o["what"], o
        assert list(o["timeline_ms"]) == list(tl) and all(v["p10"] >= 0 for v in o["timeline_ms"].values()), o
    # the control floor: a bare request and reply between the peers, once per pair of orders,
    # less than any handoff (which makes the same two hops and works besides)
    cf = res["control_floor_ms"]
    assert cf["n"] == 13 and 0 < cf["p10"] and cf["median"] < orders["data_first"]["handoff_ms"]["median"], cf
    # the machine's floor under the gather: one copy of the small request's bytes (64 tokens by
    # the geometry's bytes per token), and its warnings carried into the result's
    floor = res["copy_floor"]
    assert floor["small_bytes"] == 64 * 32 * 2 * 8 * 128 * 2 and floor["small_ms"] > 0 and floor["cpu_s_per_gib"] > 0
    assert all(w in res["warnings"] for w in floor["warnings"])
    # the gather on every thread against one beside TCP, interleaved pairs of the handoff
    ct = res["copy_threads_cost"]
    assert ct["tokens"] == 256 and ct["ratio"]["n"] == 5 and ct["all_threads_ms"]["p10"] > 0, ct
    names = sorted(os.path.basename(f) for f in res["plots"])
    assert names == ["break_even_llama3-8b.png", "transfer_breakdown.png", "transfer_gbps.png"]
    for f in res["plots"]:
        with open(f, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_lengths():
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "transfer", "--sweep", "128,0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--sweep needs positive token counts" in out.stderr


def test_bench_load_smoke_and_its_report_section(tmp_path):
    """20 handoffs, 4 in flight, two processes: none lost, none corrupted, no block leaked;
    its section lands in the report file between its markers, twice written once present."""
    from kvbridge.bench.report import render_load, write_section

    md = tmp_path / "reliability.md"
    md.write_text("# kept\n\n<!-- kvbridge:faults:begin -->\n## Fault matrix\n\nrows\n<!-- kvbridge:faults:end -->\n")
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "bench", "load", "--json", "--count", "20",
                          "--inflight", "4", "--max-tokens", "1024", "--markdown", str(md)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    write_section(str(md), "load", "Load: concurrent handoffs", render_load(res), res)  # again: replaced, not added
    for key in ("handoffs", "lost", "corrupted", "peak_rss_mb", "p99_ms", "p50_ms", "throughput_gbps", "blocks_leaked"):
        assert key in res, key
    assert res["handoffs"] == res["succeeded"] == 20, res
    assert res["lost"] == 0 and res["corrupted"] == 0 and res["failed"] == 0, res
    assert res["blocks_leaked"] == {"prefill": 0, "decode": 0} and res["double_frees"] == {"prefill": 0, "decode": 0}
    assert res["max_inflight"] == 4 and res["bytes"] > 0
    text = md.read_text()
    assert text.startswith("# kept") and text.count("<!-- kvbridge:load:begin -->") == 1 and "rows" in text
    assert "| **lost** | 0 |" in text
    assert set(json.loads((tmp_path / "reliability.json").read_text())) == {"load"}


def test_bench_load_checksum_sees_one_changed_byte():
    """The load bench's write/read pair: what the prefill writes into SGLang-format blocks,
    moved by a real plan into TensorRT-LLM-format blocks, reads back equal; one flipped byte
    or a swapped block does not."""
    import numpy as np
    import torch

    from kvbridge.bench.load import GEOM, _digest, read_room, token_bytes, write_room
    from kvbridge.layout import allocate_pool, plan_transfer
    from tests.helpers.kvhelpers import execute_segments

    src = allocate_pool("sglang", tokens_per_block=64, num_blocks=8, seed=1, **GEOM)
    dst = allocate_pool("trtllm", tokens_per_block=32, num_blocks=16, seed=2, **GEOM)
    n = 200
    data = torch.randint(0, 256, (n * token_bytes(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    sb, db = np.array([5, 2, 7, 1]), np.array([9, 3, 12, 0, 6, 14, 4])
    write_room(src, sb, data)
    plan = plan_transfer(src, sb, dst, db, n)
    for part in plan.chunks(1 << 30):
        if plan.kind.value == "direct":
            execute_segments(part.wire)
        else:
            stage = torch.empty(part.nbytes, dtype=torch.uint8)
            part.gather().run(stage)
            execute_segments(part.wire.shifted(src_by=stage.data_ptr()))
    assert _digest(read_room(dst, db, n)) == _digest(data)
    assert _digest(read_room(dst, db[[1, 0, 2, 3, 4, 5, 6]], n)) != _digest(data)
    dst.tensors[0].view(torch.uint8).reshape(16, -1)[12, 77] ^= 1
    assert _digest(read_room(dst, db, n)) != _digest(data)


def test_bench_all_json_is_one_object_keyed_by_suite(monkeypatch, capsys):
    """`bench all --json` prints ONE JSON object (each suite's result under its name), not
    one object per suite; the suites themselves are replaced here by instant stand-ins
    that report the way the real ones do (each suite runs for real in its own test)."""
    from kvbridge import cli
    from kvbridge.bench import cli as bench_cli

    def suite(name):
        def run(args):
            bench_cli._print_json(args, name, {"suite": name, "value": len(name)})
            return 0
        return run

    monkeypatch.setattr(bench_cli, "BENCHES", {n: suite(n) for n in ("layout", "transfer", "link")})
    assert cli.main(["bench", "all", "--json"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0, out
    assert json.loads(out) == {"layout": {"suite": "layout", "value": 6}, "transfer": {"suite": "transfer", "value": 8},
                               "link": {"suite": "link", "value": 4}, "plots": []}


def test_bench_load_rooms_read_back_by_each_engines_indexing(tmp_path):
    """Not the bench's own ``corrupted`` count: each side saves every room's blocks as its pool
    holds them (indexed by block id only), and here the decode's TensorRT-LLM-format blocks,
    read by TensorRT-LLM's indexing rule, equal the prefill's SGLang-format pages read by
    SGLang's (tests/helpers/engine_kv.py, written apart from ``KVLayout``), room by room."""
    import torch

    from tests.helpers.engine_kv import sglang_kv, trtllm_kv
    from kvbridge.bench.load import DST_BLOCK, GEOM, SRC_PAGE, bench_load

    res = bench_load(count=12, inflight=4, max_tokens=512, seed=3, sample_dir=str(tmp_path))
    assert res["succeeded"] == 12, res
    layers, hb = GEOM["layers"], GEOM["head_dim"] * 2
    rooms = sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("decode-*.pt"))
    assert rooms == list(range(1, 13)), rooms
    for room in rooms:
        pre = torch.load(tmp_path / f"prefill-{room}.pt")
        dec = torch.load(tmp_path / f"decode-{room}.pt")
        n, pages = pre["n"], pre["data"]  # [layers * kv, k, page, heads, head_bytes]
        assert dec["n"] == n
        bufs = [pages[i].reshape(-1, pages.shape[3], hb) for i in range(2 * layers)]
        positions = range(n)
        want = sglang_kv(bufs[:layers], bufs[layers:], range(pages.shape[1]), SRC_PAGE, positions)
        got = trtllm_kv(dec["data"], range(dec["data"].shape[0]), DST_BLOCK, hb, positions)
        assert torch.equal(got, want), f"room {room} ({n} tokens): the decode holds other bytes than the prefill sent"
        assert want.reshape(-1).unique().numel() > 16, f"room {room}: the prefill's KV is not the bench's noise"


def test_machine_notes_name_smt_siblings_and_the_last_level_cache(monkeypatch):
    """Four CPUs that sysfs says are two cores with two threads each: the notes count two
    cores, name the largest cache level, and warn that a second copy thread may not help."""
    import kvbridge.bench.machine as M

    fake = {f"/sys/devices/system/cpu/cpu{c}/topology/core_id": str(c // 2) for c in range(4)}
    fake.update({f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id": "0" for c in range(4)})
    fake.update({"/sys/devices/system/cpu/cpu0/cache/index0/level": "1", "/sys/devices/system/cpu/cpu0/cache/index0/size": "48K",
                 "/sys/devices/system/cpu/cpu0/cache/index1/level": "3", "/sys/devices/system/cpu/cpu0/cache/index1/size": "32768K",
                 "/sys/devices/system/cpu/cpu0/cache/index2/level": "2", "/sys/devices/system/cpu/cpu0/cache/index2/size": "2048K"})
    monkeypatch.setattr(M, "_read", fake.get)
    monkeypatch.setattr(M.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    n = M.machine_notes()
    assert (n["cpus"], n["cores"], n["llc"]) == (4, 2, "L3 32768K"), n
    assert any("4 CPU(s) on 2 core(s)" in w for w in n["warnings"]), n["warnings"]
    assert "4 CPU(s) on 2 core(s), last-level cache L3 32768K" in M.machine_line(n)
    fake.pop("/sys/devices/system/cpu/cpu3/topology/core_id")  # a topology sysfs does not show: unreadable, no warning
    n = M.machine_notes()
    assert n["cores"] == "unreadable" and not any("core(s)" in w for w in n["warnings"]), n
