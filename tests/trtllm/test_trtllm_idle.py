"""TensorRT-LLM 1.2's idle executor and a prefill's pinned blocks, through the stand-in.

With block reuse on, 1.2 drops a finished request whose KV is still being sent from
``active_requests``, and an executor with nothing active waits for its next request
with no timeout: ``get_finished`` is not called, so the blocks every rank has let go of
stay pinned until another request arrives (the stand-in models both: ``idle_waits``
counts the iterations spent waiting). The plugin wakes such an executor through its own
request queue (``kvbridge.adapters.trtllm.idle``); main keeps polling while a transfer is
pending and is never woken. Blocks, pins and the executor's cancelled ids are read from
the stand-in's executor, not from kvbridge.
"""

from __future__ import annotations

import time

import pytest

from kvbridge.adapters.trtllm import Handle, announce
from kvbridge.demo.models import random_prompt, reference_generate
from tests.helpers.trtllm_servers import PLUGIN, check_clean, run_until

MAX_NEW = 4


def _handoff(pre, dec, prompt, room):
    announce(pre.bus, prompt, Handle("send", room))
    announce(dec.bus, prompt, Handle("recv", room, prefill=pre.bus))
    a, d = pre.submit(prompt, 1), dec.submit(prompt, MAX_NEW)
    run_until([pre, dec], lambda: a in pre.responses and d in dec.responses and dec.drained(), 60)
    return a, d


@pytest.mark.parametrize("pv", ["1.2", "main"])
def test_prefill_blocks_come_back_within_the_deadline_on_an_idle_executor(trt_servers, tiny_llama_dir, pv):
    """Prefill TP 2 -> decode TP 1, one request and then nothing: the prefill's executor
    has nothing active while its blocks are pinned for the send. Its blocks are back
    well within the room's deadline with no further request; on 1.2 the executor was
    idle meanwhile and was woken, and no id the wake used is left in its cancelled ids;
    main polls and is never woken."""
    pre = trt_servers(pv, tiny_llama_dir, tp=2, tokens_per_block=16, num_blocks=64)
    dec = trt_servers("main", tiny_llama_dir, tp=1, tokens_per_block=32, num_blocks=48)
    prompt = random_prompt(150, seed=21)
    a, d = _handoff(pre, dec, prompt, 201)
    assert dec.responses[d]["output_token_ids"] == reference_generate(tiny_llama_dir, prompt, MAX_NEW).token_ids
    t0 = time.monotonic()
    run_until([pre, dec], pre.drained, PLUGIN["deadline_s"])
    assert time.monotonic() - t0 < PLUGIN["deadline_s"]
    for r in range(2):
        st = pre.state(r)
        assert st["canceled_req_ids"] == [], f"rank {r}: wake ids left in the executor's cancelled ids: {st}"
        assert st["finished_saves"][a]["ok"], st["finished_saves"]
    st0 = pre.state(0)
    if pv == "1.2":
        assert st0["idle_waits"] > 0, "the 1.2 executor never waited idle: the test does not show the wait"
        assert st0["idle_wakes"] >= 1, st0["idle_wakes"]
    else:
        assert st0["idle_wakes"] == 0, "main polls while a transfer is pending: nothing to wake"
    check_clean(pre)
    check_clean(dec)


def test_without_the_wake_a_1p2_prefill_holds_its_blocks_until_the_next_request(trt_servers, tiny_llama_dir):
    """The control: the plugin's wake switched off in every rank (a test hook). The 1.2
    prefill waits idle with its blocks pinned, however long it waits, although every rank
    let go of them; the next request ends the wait, and the blocks come back then."""
    pre = trt_servers("1.2", tiny_llama_dir, tp=1, tokens_per_block=16, num_blocks=64,
                      setup=("tests.helpers.trtllm_servers:no_idle_wake", None))
    dec = trt_servers("main", tiny_llama_dir, tp=1, tokens_per_block=32, num_blocks=48)
    a, _ = _handoff(pre, dec, random_prompt(150, seed=22), 202)
    waits = pre.state()["idle_waits"]
    end = time.monotonic() + PLUGIN["deadline_s"] / 2
    while time.monotonic() < end:
        pre.step()
    st = pre.state()
    assert st["idle_waits"] > waits + 100, "the executor did not wait idle"
    assert st["pinned"] == 1 and st["free"] < st["total"], f"blocks came back without an iteration: {st}"
    assert st["active"] == 0, "1.2 keeps a saving request in active_requests: the stand-in does not model 1.2"
    b = pre.submit(random_prompt(20, seed=23), 1)  # any request ends the wait
    run_until([pre], lambda: b in pre.responses and pre.drained(), 30)
    assert pre.state()["finished_saves"][a]["ok"]
    check_clean(pre)
