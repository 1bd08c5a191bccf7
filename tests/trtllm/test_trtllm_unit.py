"""Unit tests of the TensorRT-LLM plugin's pieces: handles and their announcement, bus
messages, settings, pool geometry (from the engine, not the config) and which prefill
ranks each decode rank pulls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvbridge.adapters.trtllm import (AnnounceError, BridgeConfig, ConfigError, Handle, HandleError, RankGeometry,
                                      announce, pool_layout, prompt_key, pull_plan, rank_geometry)
from kvbridge.adapters.trtllm import bus as B
from kvbridge.layout import LayoutError, tp_head_slice
from tests.helpers.peek import ready_ids

SECRET = os.environ["KVBRIDGE_SECRET"]  # the session's (tests/conftest.py): announce() seals with it


def test_package_imports_without_tensorrt_llm_or_mooncake():
    code = ("import sys; sys.modules['tensorrt_llm'] = None; sys.modules['mooncake'] = None; "
            "import kvbridge.adapters.trtllm as t; assert not t.TRTLLM_AVAILABLE and t.CONNECTOR_MODULE == ''")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _import_with(tmp_path, files: dict[str, str]) -> subprocess.CompletedProcess:
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    return subprocess.run([sys.executable, "-c", "import kvbridge.adapters.trtllm"], env=env, capture_output=True,
                          text=True, timeout=120)


def test_installed_tensorrt_llm_without_a_connector_api_is_refused_by_name(tmp_path):
    """A TensorRT-LLM with neither module path is an ImportError naming its version,
    never a silent fallback to local bases (which lack what the executor calls)."""
    out = _import_with(tmp_path, {"tensorrt_llm/__init__.py": "__version__ = '9.9.9'\n",
                                  "tensorrt_llm/_torch/__init__.py": "", "tensorrt_llm/_torch/pyexecutor/__init__.py": ""})
    assert out.returncode != 0
    assert "TensorRT-LLM 9.9.9 has no KV cache connector API" in out.stderr and "1.2.x and main" in out.stderr, out.stderr


def test_a_connector_module_that_fails_to_import_is_not_skipped(tmp_path):
    """A path that exists but breaks while importing is reported, not taken for 'absent'."""
    out = _import_with(tmp_path, {
        "tensorrt_llm/__init__.py": "__version__ = '1.2.1'\n", "tensorrt_llm/_torch/__init__.py": "",
        "tensorrt_llm/_torch/pyexecutor/__init__.py": "",
        "tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py": "import a_module_that_is_missing\n"})
    assert out.returncode != 0 and "a_module_that_is_missing" in out.stderr, out.stderr


def test_handles_and_prompt_keys():
    h = Handle("recv", 42, prefill="tcp://10.0.0.1:18500", on_failure="fail")
    assert Handle.from_dict(h.to_dict()) == h
    assert Handle.from_dict(Handle("send", 7).to_dict()) == Handle("send", 7)
    for bad in ({"op": "recv", "room": 1}, {"op": "send", "room": -1}, {"op": "send", "room": 1, "x": 2},
                {"op": "recv", "room": 1, "endpoints": ["http://a"]}, {"op": "send", "room": True},
                {"op": "send", "room": 1, "prefill": "tcp://a:1"}, [1, 2]):
        with pytest.raises(HandleError):
            Handle.from_dict(bad)
    k = prompt_key([1, 2, 3])
    assert len(k) == 32 and k == prompt_key((1, 2, 3)) != prompt_key([1, 2, 4]) != prompt_key([1, 2])
    with pytest.raises(HandleError, match="empty"):
        prompt_key([])


def test_bus_messages_are_typed_and_bounded():
    o = B.Load(req=3, room=9, blocks=[1, 2], start=0, stop=40, endpoints=["tcp://a:1"], on_failure="recompute")
    assert B.decode(B.encode(B.Orders(orders=[o]))).orders == [o]
    v = B.BUS_VERSION
    load = {"t": "load", "req": 3, "room": 9, "blocks": [1], "start": 0, "stop": 1, "endpoints": [], "on_failure": "recompute"}
    assert B.decode(B.encode({"t": "orders", "v": v, "orders": [load]})).orders[0].blocks == [1]
    for bad in (b"garbage", B.encode({"t": "orders", "v": v + 1, "orders": []}), B.encode({"t": "nope", "v": v}),
                B.encode({"t": "orders", "v": v, "orders": [{**load, "blocks": [-1]}]}),
                B.encode({"t": "orders", "v": v, "orders": [{**load, "on_failure": "maybe"}]}),
                B.encode({"t": "orders", "v": v, "orders": [{**load, "extra": 1}]}),
                B.encode({"t": "expect", "v": v, "key": "x" * 32, "handle": {}}),
                B.encode({"t": "hello", "v": v, "rank": 0, "endpoint": "e", "extra": 1})):
        with pytest.raises(B.BusError):
            B.decode(bad)


def test_announce_is_refused_with_a_reason_and_times_out_on_silence():
    """A scheduler answers an announcement whose handle is not valid (sealed, from a
    router that built it by hand) naming why; a bus nobody serves fails in time."""
    import msgspec
    import zmq

    from kvbridge.adapters.trtllm import KVBridgeConnectorScheduler, prompt_key

    cfg = BridgeConfig(secret=SECRET)
    sched = KVBridgeConnectorScheduler(SimpleNamespace(model=None), config=cfg)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        announce(sched.endpoint, [5, 6, 7], Handle("send", 1))
        ring = cfg.keyring()
        raw = {"t": "expect", "v": B.BUS_VERSION, "key": prompt_key([5]), "handle": {"op": "recv", "room": 2}, "nonce": 9}
        sock.connect(sched.endpoint)
        sock.send(ring.seal(msgspec.msgpack.encode(raw), B.DOMAIN))
        assert sock.poll(5000), "no answer to an invalid announcement"
        ans = B.unpack(sock.recv(), ring)
        assert isinstance(ans, B.Expected) and not ans.ok and ans.nonce == 9, ans
        assert "a decode handle needs" in ans.reason and "$.handle" in ans.reason, ans.reason
    finally:
        sock.close()
        sched.close()
    with pytest.raises(AnnounceError, match="did not answer"):
        announce("tcp://127.0.0.1:9", [1], Handle("send", 3), timeout_s=0.5)


def test_config_from_file_env_and_overrides(tmp_path):
    f = tmp_path / "kvb.json"
    f.write_text(json.dumps({"bus_port": 18500, "on_failure": "fail", "deadline_s": 5}))
    env = {"KVBRIDGE_CONFIG": str(f), "KVBRIDGE_DEADLINE_S": "7.5", "KVBRIDGE_HOST": "10.1.2.3"}
    cfg = BridgeConfig.load({"tp_rank": 1}, environ=env)
    assert (cfg.bus_port, cfg.on_failure, cfg.deadline_s, cfg.host, cfg.tp_rank) == (18500, "fail", 7.5, "10.1.2.3", 1)
    assert cfg.handoff().deadline_s == 7.5
    with pytest.raises(ConfigError, match="unknown"):
        BridgeConfig.load({"nope": 1}, environ={})
    with pytest.raises(ConfigError, match="on_failure"):
        BridgeConfig.load({"on_failure": "retry"}, environ={})


@pytest.mark.parametrize("heads, tp, tpb, hd, dtype, mla", [(8, 2, 32, 128, torch.bfloat16, False),
                                                            (4, 4, 16, 64, torch.float16, False),
                                                            (1, 2, 64, 576, torch.uint8, True)])
def test_pool_layout_has_tensorrt_llm_geometry(heads, tp, tpb, hd, dtype, mla):
    """Every (layer, kv, block, token, head) address is where TensorRT-LLM's HND block puts it."""
    rank = tp - 1
    h = 1 if mla else tp_head_slice(heads, tp, rank)[1]
    kvf = 1 if mla else 2
    pool = torch.zeros(5, 3, kvf, h * tpb * hd, dtype=dtype)
    lay = pool_layout(pool, RankGeometry(tpb, 0 if mla else heads, tp, rank, "fp8" if dtype == torch.uint8 else ""))
    assert (lay.num_layers, lay.kv_factor, lay.num_heads, lay.head_dim, lay.tokens_per_block) == (3, kvf, h, hd, tpb)
    item = pool.element_size()
    view = pool.view(5, 3, kvf, h, tpb, hd)  # HND inside a block
    for blk, layer, kv, tok, head in [(0, 0, 0, 0, 0), (4, 2, kvf - 1, tpb - 1, h - 1), (2, 1, 0, 3, h // 2)]:
        addr = lay.base[layer, kv] + blk * lay.block_stride + tok * lay.token_stride + head * lay.head_stride
        assert addr == view[blk, layer, kv, head, tok].data_ptr(), (blk, layer, kv, tok, head)
    assert lay.head_bytes == hd * item
    if not mla:
        assert lay.head_offset == tp_head_slice(heads, tp, rank)[0]


def _manager(tpb, heads_per_rank, head_dim, layers=2, dtype="BF16", kv_factor=2):
    return SimpleNamespace(tokens_per_block=tpb, head_dim=head_dim, kv_factor=kv_factor,
                           num_kv_heads_per_layer=[heads_per_rank] * layers,
                           total_num_kv_heads_per_layer=[heads_per_rank] * layers,  # per rank, as TensorRT-LLM keeps it
                           dtype=SimpleNamespace(name=dtype))


def test_geometry_comes_from_the_engine_not_the_config():
    """Tokens per block from the KV cache manager (the executor may have forced them: 64 for
    FlashMLA, max_num_tokens for VANILLA) even where kv_cache_config says otherwise; heads
    per rank from the manager, checked against the model's total and the TP split; the
    manager's ``total_num_kv_heads_per_layer`` holds per-rank counts and is not taken for
    the model's."""
    args = SimpleNamespace(model=None, tensor_parallel_size=2, kv_cache_config=SimpleNamespace(tokens_per_block=32))
    pool = torch.zeros(4, 2, 2, 4 * 64 * 16, dtype=torch.bfloat16)
    geo = rank_geometry(pool, manager=_manager(64, 4, 16), dist=SimpleNamespace(tp_size=2, tp_rank=1), llm_args=args,
                        cfg=BridgeConfig(num_kv_heads=8))
    assert (geo.tokens_per_block, geo.tp_size, geo.tp_rank, geo.total_kv_heads, geo.dtype) == (64, 2, 1, 8, "bfloat16")
    lay = pool_layout(pool, geo)
    assert (lay.num_heads, lay.head_offset, lay.total_heads, lay.tokens_per_block) == (4, 4, 8, 64)
    with pytest.raises(LayoutError, match="holds 4 KV head.*8 KV heads over tensor-parallel size 1 give 8"):
        rank_geometry(pool, manager=_manager(64, 4, 16), dist=SimpleNamespace(tp_size=1, tp_rank=0), llm_args=args,
                      cfg=BridgeConfig(num_kv_heads=8))
    # MLA: one latent head; without a manager the pool's block size gives tokens per block
    mla = torch.zeros(4, 2, 1, 64 * 576, dtype=torch.uint8)
    geo = rank_geometry(mla, llm_args=SimpleNamespace(kv_cache_config=SimpleNamespace(tokens_per_block=32, dtype="fp8")),
                        cfg=BridgeConfig(head_dim=576))
    assert (geo.tokens_per_block, geo.head_dim, geo.dtype) == (64, 576, "fp8")
    with pytest.raises(LayoutError, match="block_size 36864 != 1 head"):
        rank_geometry(mla, manager=_manager(32, 1, 576, kv_factor=1), llm_args=args, cfg=BridgeConfig())
    with pytest.raises(ConfigError, match="attention data parallelism"):
        rank_geometry(pool, llm_args=SimpleNamespace(enable_attention_dp=True), cfg=BridgeConfig())


def test_block_order_follows_the_attention_backend():
    """TRTLLM writes HND inside a block; VANILLA / FLASHINFER go through get_buffers' NHD view."""
    pool = torch.zeros(3, 2, 2, 2 * 8 * 4, dtype=torch.float32)
    for backend, order in (("TRTLLM", "HND"), ("VANILLA", "NHD"), ("FLASHINFER", "NHD")):
        geo = rank_geometry(pool, manager=_manager(8, 2, 4, dtype="FLOAT"), llm_args=SimpleNamespace(attn_backend=backend),
                            cfg=BridgeConfig(num_kv_heads=2))
        lay = pool_layout(pool, geo)
        h, t = 1, 5
        view = pool.view(3, 2, 2, 2, 8, 4) if order == "HND" else pool.view(3, 2, 2, 8, 2, 4).transpose(3, 4)
        assert lay.base[1, 1] + 2 * lay.block_stride + t * lay.token_stride + h * lay.head_stride == \
            view[2, 1, 1, h, t].data_ptr(), backend
    with pytest.raises(ConfigError, match="block_order"):
        BridgeConfig(block_order="XYZ")


@pytest.mark.parametrize("heads, ptp, dtp", [(4, 2, 1), (4, 1, 2), (4, 2, 4), (4, 4, 2), (1, 2, 1), (1, 1, 4),
                                             (1, 4, 2), (4, 8, 2), (4, 2, 8), (8, 8, 8)])
def test_pull_plans_cover_every_head_and_every_prefill_rank(heads, ptp, dtp):
    pulled = {p: 0 for p in range(ptp)}
    for d in range(dtp):
        plan = pull_plan(heads, ptp, dtp, d)
        d0, dn = tp_head_slice(heads, dtp, d)
        got = set()
        for p in plan.ranks:
            p0, pn = tp_head_slice(heads, ptp, p)
            got |= set(range(max(p0, d0), min(p0 + pn, d0 + dn)))
            pulled[p] += 1
        assert got == set(range(d0, d0 + dn)), (d, plan)
    assert all(n > 0 for n in pulled.values()), pulled  # no prefill rank is left waiting
    for d in range(dtp):  # each prefill rank is told the number of decode ranks that really pull it
        plan = pull_plan(heads, ptp, dtp, d)
        assert all(pulled[p] == plan.receivers for p in plan.ranks), (d, plan, pulled)


def test_cost_gate_settings(tmp_path):
    """Off by default; on with a link; the model from cost_model or the served model's config."""
    assert BridgeConfig.load(environ={}).cost_gate() is None
    env = {"KVBRIDGE_COST_GATE_ENABLED": "true", "KVBRIDGE_LINK": "tcp", "KVBRIDGE_COST_MODEL": "llama3-8b",
           "KVBRIDGE_COST_QUEUE_S": "0.25"}
    gate = BridgeConfig.load(environ=env).cost_gate()
    assert gate.model.name == "llama3-8b" and gate.link.name == "tcp" and gate.break_even is not None
    served = tmp_path / "model"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                                    "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert BridgeConfig(cost_gate_enabled=True, link="nvlink").cost_gate(str(served)).model.layers == 2
    with pytest.raises(ConfigError, match="no model geometry"):
        BridgeConfig(cost_gate_enabled=True, link="tcp").cost_gate(None)
    with pytest.raises(ConfigError, match="unknown link"):
        BridgeConfig(cost_gate_enabled=True, link="carrier-pigeon", cost_model="llama3-8b").cost_gate()
    with pytest.raises(ConfigError, match="cost_queue_s must be >= 0"):
        BridgeConfig(cost_queue_s=-1.0)
    with pytest.raises(ConfigError, match="cost_prefill_tps"):
        BridgeConfig.load(environ={"KVBRIDGE_COST_PREFILL_TPS": "fast"})


def test_announce_command_hands_the_server_its_handle():
    """``kvbridge announce`` as a router script runs it: the server's next request with that
    prompt gets the handle; a bad handle exits 2 naming the field."""
    from kvbridge.adapters.trtllm import KVBridgeConnectorScheduler

    sched = KVBridgeConnectorScheduler(SimpleNamespace(model=None), config=BridgeConfig(secret=SECRET))
    try:
        cmd = [sys.executable, "-m", "kvbridge.cli", "announce", "--bus", sched.endpoint, "--prompt-ids", "4,5,6",
               "--handle", '{"op": "recv", "room": 9, "endpoints": ["tcp://10.0.0.1:5000"]}']
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert sched._take_expected(prompt_key([4, 5, 6]), "recv") == Handle("recv", 9, endpoints=("tcp://10.0.0.1:5000",))
        bad = subprocess.run(cmd[:-1] + ['{"op": "recv", "room": 9, "prefill": "http://x"}'], capture_output=True,
                             text=True, timeout=120)
        assert bad.returncode == 2 and "not a tcp:// address" in bad.stderr, bad.stderr
    finally:
        sched.close()


def test_the_bus_takes_only_sealed_messages():
    """A forged Hello (a rank's endpoint replaced), LoadResult (a failed load made to look
    loaded) or Expect, unsealed, sealed with another key, or replayed, is refused before it
    is decoded and counted; the sealed announcement beside them is served."""
    import time

    import zmq

    from kvbridge.adapters.trtllm import KVBridgeConnectorScheduler
    from kvbridge.common.auth import Keyring
    from kvbridge.common.handoff import default_metrics

    def refused(code):
        m = default_metrics()
        return m.child(m.auth_refused, "bus", code)._value.get()

    sched = KVBridgeConnectorScheduler(SimpleNamespace(model=None), config=BridgeConfig(secret=SECRET))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sched.endpoint)
    try:
        forged = [B.Hello(rank=0, endpoint="tcp://attacker:1"),
                  B.LoadResult(req=7, rank=0, ok=True, reason=""),
                  B.Expect(key="k" * 32, handle=Handle("send", 5), ttl_s=60.0, nonce=1)]
        before = {c: refused(c) for c in ("unsigned", "unknown_key", "replay")}
        other = Keyring("another-deployment-" + "z" * 20)
        for msg in forged:
            sock.send(B.encode(msg))
            sock.send(B.pack(msg, other))
        captured = B.pack(B.Expect(key="c" * 32, handle=Handle("send", 6), ttl_s=60.0, nonce=2),
                          Keyring(SECRET))
        sock.send(captured)
        sock.send(captured)  # the same frame again: a replay
        announce(sched.endpoint, [1, 2, 3], Handle("send", 8))  # the honest one, beside them
        deadline = time.monotonic() + 10
        while refused("replay") < before["replay"] + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refused("unsigned") == before["unsigned"] + 3
        assert refused("unknown_key") == before["unknown_key"] + 3
        assert refused("replay") == before["replay"] + 1
        assert sched._endpoints.get(0) != "tcp://attacker:1" and not sched._workers
        assert sched._take_expected(prompt_key([1, 2, 3]), "send") == Handle("send", 8)
        assert sched._take_expected("k" * 32, "send") is None
    finally:
        sock.close(0)
        sched.close()


def test_released_is_taken_only_from_that_ranks_worker():
    """A sealed ``Released`` counts for a rank only when it comes from the worker that
    joined as that rank: a stranger holding the key cannot make rank 0's executor be
    woken (nor hide a rank's release by claiming it early)."""
    import time

    import zmq

    from kvbridge.adapters.trtllm import KVBridgeConnectorScheduler
    from kvbridge.common.auth import Keyring

    sched = KVBridgeConnectorScheduler(SimpleNamespace(model=None), config=BridgeConfig(secret=SECRET))
    ring = Keyring(SECRET)
    socks = []
    try:
        for _ in range(2):
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(sched.endpoint)
            socks.append(s)
        worker, stranger = socks
        worker.send(B.pack(B.Hello(rank=0, endpoint="tcp://127.0.0.1:1"), ring))
        deadline = time.monotonic() + 10
        while 0 not in sched._workers and time.monotonic() < deadline:
            time.sleep(0.01)
        stranger.send(B.pack(B.Released(req=5, rank=0), ring))
        worker.send(B.pack(B.Released(req=6, rank=0), ring))
        # both messages handled: the worker's counted, the stranger's refused (its warning logged)
        while not (ready_ids(sched.idle_wake) and "released" in sched._bad_bus._last) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "released" in sched._bad_bus._last, "the stranger's Released was never refused"
        assert ready_ids(sched.idle_wake) == [6]
    finally:
        for s in socks:
            s.close(0)
        sched.close()


def test_idle_wake_wakes_only_an_executor_that_runs_no_iteration():
    """``IdleWake``: a request is ready once every rank let go of it; an executor that
    keeps calling ``get_finished`` is never woken; one that stops is woken after
    ``after_s``, once per ``after_s``; two iterations after readiness take it with more
    than one rank (a rank's ``get_finished`` of the first may precede its release), one
    with one rank."""
    from kvbridge.adapters.trtllm.idle import IdleWake, forget_wake_ids

    woken = []
    w = IdleWake(world_size=2, after_s=0.1)
    w.attach(woken.append)
    w.released(7, 0)
    w.tick(1e9)
    assert ready_ids(w) == [] and woken == []  # rank 1 has not let go yet
    w.released(7, 1)
    w.polled()
    w.tick()
    assert woken == [] and ready_ids(w) == [7]  # polled just now: nothing to wake
    import time as _t
    now = _t.monotonic()
    w.tick(now + 0.05)
    assert woken == []
    w.tick(now + 0.2)
    w.tick(now + 0.25)  # not again within after_s of the last wake
    assert woken == [7] and w.wakes == 1
    w.polled()
    assert ready_ids(w) == []  # the second iteration since it was ready takes it
    one = IdleWake(world_size=1, after_s=0.1)
    one.released(3, 0)
    one.polled()
    assert ready_ids(one) == []
    ex = SimpleNamespace(executor_request_queue=SimpleNamespace(canceled_req_ids=[3, 4, 9]),
                         active_requests=[SimpleNamespace(py_request_id=4)])
    forget_wake_ids(ex, {3, 4}.__contains__)
    assert ex.executor_request_queue.canceled_req_ids == [4, 9]  # 4 cancels an active request: kept


def test_an_expect_flood_expires_in_log_time():
    """4,096 announcements under one prompt are held up to the per-prompt cap (the rest
    refused by name); those held plus 4,096 under as many prompts expire in one tick well
    under a second (a heap, not a scan per key); one taken first never expires; the count
    and the maps end empty."""
    import time

    from kvbridge.adapters.trtllm import KVBridgeConnectorScheduler
    from kvbridge.adapters.trtllm import scheduler as S

    sched = KVBridgeConnectorScheduler(SimpleNamespace(model=None), config=BridgeConfig(secret=SECRET))
    try:
        same = [B.Expect(key="5" * 32, handle=Handle("send", i), ttl_s=60.0, nonce=i) for i in range(4096)]
        many = [B.Expect(key=f"{i:032x}", handle=Handle("send", i), ttl_s=60.0, nonce=i) for i in range(4096)]
        answers = []
        sched.bus.send = lambda peer, payload: answers.append(B.unpack(payload, sched._keyring))
        for m in same + many:
            sched._expect("00", m)
        cap = S._MAX_EXPECTED_PER_KEY
        assert sched._n_expected == cap + 4096
        refused = [a.reason for a in answers if not a.ok]
        assert len(refused) == 4096 - cap and all("with this prompt" in r for r in refused), refused[:1]
        assert sched._take_expected("5" * 32, "send") == Handle("send", 0)
        t0 = time.perf_counter()
        with sched._lock:
            sched._expire(time.monotonic() + 61.0)
        took = time.perf_counter() - t0
        assert sched._n_expected == 0 and not sched._expected and not sched._expiry
        assert took < 0.5, f"expiring {cap + 4095:,} announcements took {took:.2f} s"
        print(f"{cap + 4095:,} announcements expired in {took * 1e3:.1f} ms")
    finally:
        sched.close()
