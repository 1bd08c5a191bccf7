"""kvbridge's SGLang transfer backend against the REAL sglang package (0.5.23), on CPU.

Three OS processes each import SGLang once and load plugins with SGLang's own loader
(``sglang.srt.plugins.load_plugins``) from the installed entry point; they then play
prefill and decode scheduler ranks, case after case (tests/helpers/sglang_peers.py), with real
MHA/MLA token pools, real KVArgs and SGLang's bootstrap server, Mooncake TCP on
127.0.0.1. Every moved byte is compared with the prefill pools; decode pages outside the
request must be unchanged; the decode metadata row must hold the first token.
"""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np
import pytest

import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
import mooncake  # noqa: F401  (pinned: a missing one fails the run, never skips)

from tests.helpers import sglang_peers  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(240)]


class Peer:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=sglang_peers.main, args=(child,), daemon=True)
        self.proc.start()

    def recv(self, timeout=120):
        if not self.conn.poll(timeout):
            raise TimeoutError("peer did not answer")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise AssertionError(msg[1])
        return msg

    def call(self, *cmd, timeout=120):
        self.conn.send(cmd)
        return self.recv(timeout)[1]

    def stop(self):
        try:
            self.conn.send(("stop",))
            self.conn.poll(3)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def peers():
    ctx = mp.get_context("spawn")
    ps = [Peer(ctx) for _ in range(3)]
    ready = [p.recv(timeout=180) for p in ps]
    yield ps, ready
    for p in ps:  # all at once: each needs a moment to close its transport
        try:
            p.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
    for p in ps:
        p.conn.poll(3)
        p.proc.join(1)
        if p.proc.is_alive():
            p.proc.kill()
            p.proc.join(5)


_PORT = [18700 + random.randint(0, 500) * 2]


def _case(**kw):
    _PORT[0] += 1
    base = dict(mla=False, dtype="bfloat16", layers=3, heads=4, head_dim=8, lora=16, rope=8, slots=2048,
                page_size=16, p_tp=1, d_tp=1, seed=1, port=_PORT[0])
    base.update(kw)
    return base


def _run(peers, case, requests):
    """Set up prefill ranks then decode ranks on the three processes; run ``requests``
    [(room, num_tokens, chunk_pages, decode_prefix_len)]; verify every byte: each token
    past the prefix holds the prefill's bytes in the decode's pages (its own page size,
    ``d_page_size``), nothing else of the decode pool changed (the unused tail of the
    request's last page included)."""
    procs = peers
    pre = procs[: case["p_tp"]]
    dec = procs[case["p_tp"]: case["p_tp"] + case["d_tp"]]
    assert len(dec) == case["d_tp"]
    for rank, p in enumerate(pre):  # rank 0 starts the bootstrap server
        rec = p.call("setup", "prefill", case, rank)
        assert rec.endpoint.startswith("tcp://") and rec.layout.tokens_per_block == case["page_size"]
    for rank, p in enumerate(dec):
        p.call("setup", "decode", case, rank)
    ps = case["page_size"]
    rng = np.random.default_rng(case["seed"])
    npages_pool = case["slots"] // ps
    results = []
    for room, num_tokens, chunk_pages, prefix in requests:
        n_all = -(-num_tokens // ps)
        pages = [int(x) for x in rng.permutation(np.arange(1, npages_pool + 1))[:n_all]]
        for p in pre:
            p.conn.send(("serve", room, pages, num_tokens, chunk_pages, room % 1000 + 7, 60.0))
        for p in dec:
            p.conn.send(("pull", room, num_tokens, prefix, 60.0))
        sres = [p.recv()[1] for p in pre]
        dres = [p.recv()[1] for p in dec]
        for s in sres:
            assert s["state"] == 4, s
            assert s["prefix"] == prefix - prefix % ps  # the decode's prefix, on a prefill page boundary
        src = [p.call("rows", pages, 0, prefix, num_tokens) for p in pre]  # per rank, per buffer [tokens, heads, dim]
        for d_rank, d in enumerate(dec):
            r = dres[d_rank]
            assert r["state"] == 4, r
            assert r["output_id"] == room % 1000 + 7 and r["room_row"] == room
            assert r["cached"] == prefix - prefix % ps and r["logprob"] == -0.25  # what serve() wrote
            assert r["untouched"], f"bytes outside the request's pages changed: slots {r['changed_slots']}, pages {r['pages']}"
            for b, got in enumerate(r["content"]):
                if case["mla"]:
                    want = src[0][b]
                    for other in src[1:]:
                        assert np.array_equal(other[b], want)
                else:
                    full = np.concatenate([s[b] for s in src], axis=1) if case["p_tp"] > 1 else src[0][b]
                    h = full.shape[1] // case["d_tp"]
                    want = full[:, d_rank * h:(d_rank + 1) * h]
                assert np.array_equal(got, want), f"buffer {b} differs on decode rank {d_rank}"
        results.append((sres, dres))
    for p in pre + dec:
        p.call("teardown")
    return results


def test_plugin_loaded_by_sglang(peers):
    """SGLang's loader ran kvbridge's entry point in every process: choice, enum member,
    get_kv_class hook (also where prefill/decode/disagg_service imported it by name)."""
    _, ready = peers
    for _, import_s, chk in ready:
        assert chk["entry_points"] == ["kvbridge.adapters.sglang:register"]
        assert chk["choice"]
        assert chk["enum"] == (True, "KVBRIDGE", True, True)
        assert chk["classes"] and chk["kvargs"] == "KVArgs" and chk["mooncake_still"]
        assert all(a and b for a, b in chk["patched_in"].values()), chk["patched_in"]
        assert chk["argv_backend"] == "kvbridge" and chk["server_args"] == "kvbridge"
        assert chk["scales_hook"]


@pytest.mark.parametrize(
    "case,requests",
    [
        pytest.param(_case(page_size=16), [(11, 200, 3, 0), (12, 77, 1, 32)], id="mha-p16-tp1to1-prefix"),
        pytest.param(_case(page_size=1, d_tp=2, seed=2), [(21, 150, 40, 0)], id="mha-p1-tp1to2"),
        pytest.param(_case(page_size=64, p_tp=2, seed=3), [(31, 300, 2, 0)], id="mha-p64-tp2to1"),
        pytest.param(_case(mla=True, page_size=16, d_tp=2, seed=4), [(41, 130, 2, 0)], id="mla-p16-tp1to2"),
        pytest.param(_case(mla=True, page_size=64, p_tp=2, seed=5), [(51, 200, 1, 0)], id="mla-p64-tp2to1"),
        # page sizes that differ: prompts that do not fill their last page on either side,
        # decode prefixes that are not on a prefill page boundary, chunks of prefill pages
        pytest.param(_case(page_size=16, d_page_size=64, seed=8), [(71, 37, 1, 0), (72, 200, 3, 64), (73, 130, 2, 0)],
                     id="mha-p16-d64-prefix"),
        pytest.param(_case(page_size=64, d_page_size=1, d_tp=2, seed=9), [(81, 150, 1, 37)], id="mha-p64-d1-tp1to2-prefix"),
        pytest.param(_case(page_size=1, d_page_size=16, p_tp=2, seed=10), [(91, 77, 40, 16)], id="mha-p1-d16-tp2to1-prefix"),
        pytest.param(_case(page_size=128, d_page_size=16, seed=11), [(111, 300, 1, 32)], id="mha-p128-d16-prefix"),
        pytest.param(_case(mla=True, page_size=16, d_page_size=1, d_tp=2, seed=12), [(101, 130, 2, 5)],
                     id="mla-p16-d1-tp1to2-prefix"),
    ],
)
def test_handoff(peers, case, requests):
    procs, _ = peers
    _run(procs, case, requests)


def test_cost_gate_fails_fast_below_break_even(peers, tmp_path):
    """Decode with the cost gate on (the case's geometry as an HF config, tcp preset, fixed
    throughputs: break-even 52 tokens). SGLang's decode cannot prefill locally, so a
    32-token prompt fails at ``send_metadata`` with "recompute: below break-even" before
    any prefill rank is asked for bytes, and the prefill's room ends declined (its serve
    never sees a decode rank); a 200-token prompt moves, every byte checked."""
    import json

    procs, _ = peers
    case = _case(page_size=16, seed=6)
    cfg = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 100}  # 3 layers x 4 heads x 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    env = {"KVBRIDGE_COST_GATE_ENABLED": "true", "KVBRIDGE_LINK": "tcp", "KVBRIDGE_COST_MODEL": str(tmp_path),
           "KVBRIDGE_COST_PREFILL_TPS": "1e6", "KVBRIDGE_COST_DECODE_PREFILL_TPS": "1000", "KVBRIDGE_COST_QUEUE_S": "0.05"}
    pre, dec = procs[0], procs[1]
    dec.call("env", env)
    try:
        pre.call("setup", "prefill", case, 0)
        dec.call("setup", "decode", case, 0)
        before = dec.call("metrics")
        pages = list(range(1, 3))
        pre.conn.send(("serve", 61, pages, 32, 1, 7, 30.0))
        d = dec.call("pull", 61, 32, 0, 30.0)
        s = pre.recv()[1]
        assert d["state"] == 0 and "recompute: below break-even" in d["reason"], d
        assert s["state"] == 0 and s["phase"] == "bootstrap", s  # no decode rank ever asked for bytes
        assert "declined by decode: recompute: below break-even" in s["reason"], s
        after = dec.call("metrics")
        assert after["fallbacks"] == before["fallbacks"] + 1
        assert after["declined"]["receiver"] == before["declined"]["receiver"] + 1
        assert after["blocks_held"]["receiver"] == 0  # no room, no pages leased
        p = pre.call("metrics")
        assert p["declined"]["sender"] >= 1 and p["blocks_held"]["sender"] == 0
        for p_ in (pre, dec):
            p_.call("teardown")
        # above break-even the same decode moves the KV
        _run(procs, _case(page_size=16, seed=7), [(62, 200, 3, 0)])
        assert dec.call("metrics")["fallbacks"] == after["fallbacks"]
    finally:
        dec.call("env", {"KVBRIDGE_COST_GATE_ENABLED": "", "KVBRIDGE_LINK": ""})


def test_refused_pairing_fails_the_request_not_the_decode(peers):
    """SGLang's own pairing check still refuses a prefill (here its page size, as reported
    by SGLang's mooncake bootstrap server: 16 vs the decode's 64; before kvbridge caught it,
    ``try_ensure_parallel_info`` raised on the decode scheduler's event loop and the server
    went down). The request fails with SGLang's reason, the decode rank goes on, and its
    next request, to a kvbridge prefill of page size 16, moves every byte."""
    procs, _ = peers
    refused = _case(page_size=16, d_page_size=64, bootstrap="mooncake", seed=13)
    good = _case(page_size=16, seed=14)
    pre_a, dec, pre_b = procs
    pre_a.call("setup", "prefill", refused, 0)
    pre_b.call("setup", "prefill", good, 0)
    dec.call("setup", "decode", refused, 0)
    try:
        for room in (131, 132):  # every request to it fails, at once
            d = dec.call("pull", room, 100, 0, 20.0)
            assert d["state"] == 0, d
            assert "cannot pair with this decode server" in d["reason"] and "Page size mismatch" in d["reason"], d
        rng = np.random.default_rng(14)
        pages = [int(x) for x in rng.permutation(np.arange(1, 129))[:7]]
        pre_b.conn.send(("serve", 133, pages, 100, 2, 9, 60.0))
        dec.conn.send(("pull", 133, 100, 0, 60.0, None, 0.0, good["port"]))
        s, d = pre_b.recv()[1], dec.recv()[1]
        assert s["state"] == 4 and d["state"] == 4, (s, d)
        want = pre_b.call("rows", pages, 0, 0, 100)
        assert d["untouched"] and d["output_id"] == 9
        for b, got in enumerate(d["content"]):
            assert np.array_equal(got, want[b]), f"buffer {b} differs"
    finally:
        for p in procs:
            p.call("teardown")


def test_kv_dtype_kvbridge_does_not_convert_fails_both_sides(peers):
    """A decode pool of float16 against a bfloat16 prefill (and another page size): kvbridge
    does not convert dtypes, so the request fails on both sides with the mismatch named,
    at once (not at a timeout); the same prefill then serves a bfloat16 decode."""
    procs, _ = peers
    d, s = _refused_request(procs, _case(page_size=16, d_page_size=64, d_dtype="float16", seed=15), 141,
                            "dtype: source bfloat16 != destination float16")
    assert s["t_end"] - d["t_end"] < 5, "the prefill learned of it late"
    _run(procs, _case(page_size=16, d_page_size=64, seed=16), [(142, 100, 2, 0)])


def _refused_request(procs, case, room, why):
    """One 100-token request between a prefill and a decode of ``case`` that both sides
    fail, each naming ``why``; (decode's, prefill's) results."""
    pre, dec = procs[0], procs[1]
    pre.call("setup", "prefill", case, 0)
    dec.call("setup", "decode", case, 0)
    try:
        pre.conn.send(("serve", room, list(range(1, 8)), 100, 2, 9, 20.0))
        d = dec.call("pull", room, 100, 0, 20.0)
        s = pre.recv()[1]
        for side in (d, s):
            assert side["state"] == 0 and why in side["reason"], side
        return d, s
    finally:
        for p in (pre, dec):
            p.call("teardown")


def test_fp8_caches_with_other_scales_fail_naming_both(peers):
    """Two fp8 caches whose models were loaded with different KV scales (SGLang's own
    loading path: layer 1's V scale 0.5 on the prefill, 0.25 on the decode): the bytes would
    decode to other numbers, so the request fails on both sides naming the layer and both
    scales, nothing lands; caches whose scales agree move byte-exact; and with
    ``torch_native`` (which applies no scale) on both sides the checkpoint's scales do not
    matter."""
    procs, _ = peers
    p_scales, d_scales = [(1.0, 1.0), (1.0, 0.5), (2.0, 2.0)], [(1.0, 1.0), (1.0, 0.25), (2.0, 2.0)]
    case = _case(page_size=16, d_page_size=64, dtype="float8_e4m3fn", p_scales=p_scales, d_scales=d_scales, seed=17)
    d, _ = _refused_request(procs, case, 151, "layer 1 V head 0: source 0.5 != destination 0.25")
    assert not d["landed_before_fail"], d
    _run(procs, _case(page_size=16, d_page_size=64, dtype="float8_e4m3fn", p_scales=p_scales, d_scales=p_scales,
                      seed=18), [(152, 100, 2, 0)])
    _run(procs, _case(page_size=16, dtype="float8_e4m3fn", p_scales=p_scales, d_scales=d_scales,
                      attention_backend="torch_native", seed=19), [(153, 100, 2, 0)])
