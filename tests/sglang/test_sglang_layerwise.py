"""Layer-wise sends from SGLang's REAL prefill server, on CPU.

The prefill runs with ``KVBRIDGE_LAYERWISE=true``: kvbridge's plugin hooks
``Scheduler.run_batch`` and ``MHATokenToKVPool.set_kv_buffer`` through SGLang's
``HookRegistry``, and hands each layer of the tokens a forward computes to the sender as
soon as the attention wrote it; the first token ends the room (``KVSender.finish``).
Checked: greedy outputs equal transformers' ``generate()``; the prefill's log says, for
each room, how many layer pieces went and that nothing was left to send whole (a hook that
silently fell back would send the room whole: the test fails); a prompt longer than the
prefill's ``--chunked-prefill-size`` streams every chunk's layers; a prefix cached on the
prefill (radix hit) goes whole before the streamed suffix. One pair for all of it.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.tiny_models import random_prompt, reference_generate

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_NEW = 8
CHUNK = 64  # the prefill's --chunked-prefill-size
LAYERS = 2  # the tiny Llama's
LINE = re.compile(r"room (\d+) went layer by layer: (\d+) layer piece\(s\), (\d+) token\(s\) sent whole; ended by (\w+)")


@pytest.fixture
def layerwise_pair(sglang_pair_factory, tiny_llama_dir):
    return sglang_pair_factory("kvbridge", model_dir=tiny_llama_dir,
                               extra_env={"SGLANG_PLUGINS": "kvbridge", "KVBRIDGE_LAYERWISE": "true"},
                               prefill_args=["--chunked-prefill-size", str(CHUNK)], timeout=600)


def _room_line(pair, room: int, timeout: float = 10.0) -> tuple[int, int, str]:
    """(layer pieces, tokens sent whole, how the room ended) from the prefill's log."""
    end = time.monotonic() + timeout
    while True:
        text = pair.prefill.log_path.read_text(errors="replace")
        for m in LINE.finditer(text):
            if int(m.group(1)) == room:
                return int(m.group(2)), int(m.group(3)), m.group(4)
        if time.monotonic() > end:
            raise AssertionError(f"no layer-wise line for room {room} in the prefill's log:\n{pair.log_tails(30)}")
        time.sleep(0.05)


def _gen(pair, prompt, room):
    return pair.generate_full(prompt, MAX_NEW, room=room).output_ids


def test_layerwise_pair_matches_transformers_concurrent_and_chunked(layerwise_pair, tiny_llama_dir):
    """Two short prompts at once (one batch, or two) and one of 3 chunks and a bit; each
    room streamed every layer of every forward, nothing sent whole after a forward."""
    lens = (5, 37, 3 * CHUNK + 11)
    prompts = [random_prompt(n, seed=900 + n) for n in lens]
    refs = [reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids for p in prompts]
    rooms = [7_000_000 + 17 * i + n for i, n in enumerate(lens)]
    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda pr: _gen(layerwise_pair, *pr), zip(prompts[:2], rooms[:2])))
    outs.append(_gen(layerwise_pair, prompts[2], rooms[2]))
    for n, got, ref in zip(lens, outs, refs):
        assert got == ref, f"{n}-token prompt, layer-wise: pair {got} != transformers {ref}"
    for n, room in zip(lens, rooms):
        pieces, whole, ended = _room_line(layerwise_pair, room)
        forwards = -(-n // CHUNK)
        # one piece per layer per forward (queued pieces may coalesce in the sender, not here)
        assert pieces == LAYERS * forwards, f"{n}-token prompt: {pieces} layer pieces, want {LAYERS} x {forwards}"
        assert whole == 0 and ended == "finish", f"{n}-token prompt: {whole} tokens sent whole, ended by {ended}"


def test_layerwise_prefix_cached_on_prefill_goes_whole_first(layerwise_pair, tiny_llama_dir):
    """The same prompt again with a longer tail: the prefill's radix cache holds the first
    part (not computed by this forward), which goes whole; the tail streams."""
    base = random_prompt(40, seed=77)
    first = base + random_prompt(6, seed=78)
    second = base + random_prompt(20, seed=79)
    r1, r2 = 7_100_001, 7_100_002
    assert _gen(layerwise_pair, first, r1) == reference_generate(tiny_llama_dir, first, MAX_NEW).token_ids
    got = _gen(layerwise_pair, second, r2)
    assert got == reference_generate(tiny_llama_dir, second, MAX_NEW).token_ids
    pieces, whole, ended = _room_line(layerwise_pair, r2)
    assert pieces == LAYERS and ended == "finish"
    assert 0 < whole < len(second), f"the cached prefix went whole: {whole} tokens"


def test_layerwise_mla_pair_matches_transformers(sglang_pair_factory, tiny_mla_dir):
    """A DeepSeek-style MLA model (one latent row per token and layer, kv_factor 1): the
    hook on ``MLATokenToKVPool``'s writes streams every layer of every forward, greedy
    outputs equal transformers' ``generate()``, nothing went whole after a forward."""
    pair = sglang_pair_factory("kvbridge", model_dir=tiny_mla_dir,
                               extra_env={"SGLANG_PLUGINS": "kvbridge", "KVBRIDGE_LAYERWISE": "true"},
                               prefill_args=["--chunked-prefill-size", str(CHUNK)], timeout=600)
    layers = 2  # the tiny MLA model's
    lens = (9, 2 * CHUNK + 5)
    for i, n in enumerate(lens):
        prompt = random_prompt(n, seed=950 + n)
        room = 7_200_000 + i
        assert _gen(pair, prompt, room) == reference_generate(tiny_mla_dir, prompt, MAX_NEW).token_ids, n
        pieces, whole, ended = _room_line(pair, room)
        forwards = -(-n // CHUNK)
        assert pieces == layers * forwards, f"{n}-token MLA prompt: {pieces} layer pieces, want {layers} x {forwards}"
        assert whole == 0 and ended == "finish", f"{n}-token MLA prompt: {whole} tokens sent whole, ended by {ended}"


def test_unsupported_pool_falls_back_to_whole_sends_once(sglang_pools, caplog):
    """A pool whose KV writes do not go through a hooked method is not armed: its requests
    go whole, said once in the log. Here: SGLang's real MHA pool with its own
    ``set_kv_buffer`` (a subclass, as FP4/MXFP8 pools are), and SGLang's real MLA pool in a
    process where MLA's methods are not hooked (this test process)."""
    import logging
    from types import SimpleNamespace

    import torch

    from kvbridge.adapters.sglang.layerwise import LayerStreamer, _supported_pool

    mha_cls, mla_cls = sglang_pools
    mha = mha_cls(size=64, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=2, device="cpu",
                  enable_memory_saver=False)
    mla = mla_cls(size=64, page_size=16, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=2,
                  device="cpu", enable_memory_saver=False)

    class OwnWrites(mha_cls):
        def set_kv_buffer(self, *args, **kwargs):  # writes KV its own way, past the hook
            return super().set_kv_buffer(*args, **kwargs)

    own = OwnWrites(size=64, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=2, device="cpu",
                    enable_memory_saver=False)
    assert _supported_pool(mha) and not _supported_pool(own) and not _supported_pool(mla)
    mgr = SimpleNamespace(layout=SimpleNamespace(num_layers=2, device="cpu"), kvb_settings=SimpleNamespace(layerwise=True))
    st = LayerStreamer(mgr, owns=lambda sender: True)
    sched = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: own, page_size=16))
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), reqs=[object()])
    with caplog.at_level(logging.WARNING, logger="kvbridge.adapters.sglang.layerwise"):
        for _ in range(3):
            st.arm_batch(sched, batch)
    assert not st.armed and st.pool is None
    said = [r for r in caplog.records if "not supported: requests go whole" in r.getMessage()]
    assert len(said) == 1 and "OwnWrites" in said[0].getMessage()


def test_auto_decides_per_prompt_length_from_the_cost_model(tiny_llama_dir):
    """``layerwise: auto`` on an SGLang prefill: the hooks go in (some request may stream),
    and each request's answer is the cost model's for its prompt length, from the served
    model's config: the same answers ``LayerwiseChooser`` gives, which flip with the length
    on a slow link; true and false force it regardless of the length."""
    from types import SimpleNamespace

    from kvbridge.adapters.sglang.config import SglangBridgeConfig
    from kvbridge.adapters.sglang.layerwise import layerwise_wanted
    from kvbridge.common.gate import LayerwiseChooser

    args = SimpleNamespace(model_path=str(tiny_llama_dir))
    env = {"KVBRIDGE_LAYERWISE": "auto", "KVBRIDGE_LINK": "tcp"}
    served = SglangBridgeConfig.load(environ=env).layerwise_chooser(args)
    assert isinstance(served, LayerwiseChooser)
    assert (served.model.layers, served.model.kv_heads) == (2, 2) and str(tiny_llama_dir) in served.model.source, served.model
    auto = SglangBridgeConfig.load(environ={**env, "KVBRIDGE_COST_MODEL": "llama3-8b"})
    chooser = auto.layerwise_chooser(args)
    assert chooser.model.name == "llama3-8b"
    assert layerwise_wanted(auto, None, chooser) is True  # the hooks are installed
    lens = (16, 128, 1024, 4096)
    want = [chooser.choose(n).layerwise for n in lens]
    assert [layerwise_wanted(auto, n, chooser) for n in lens] == want
    assert want[0] is False and want[-1] is True, dict(zip(lens, want))  # flips with the length on tcp
    assert layerwise_wanted(auto, 4096, None) is False  # no chooser: whole
    for word, forced in (("true", True), ("off", False)):
        s = SglangBridgeConfig.load(environ={**env, "KVBRIDGE_LAYERWISE": word})
        assert s.layerwise_chooser(args) is None
        assert all(layerwise_wanted(s, n, None) is forced for n in lens)
